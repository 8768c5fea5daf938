"""Exclusive DRAM (``exclusive_dram``; one KV cache group): a computed block goes down to
DRAM only when vLLM hands its HBM slot to another request.

Owns: the engine blocks watched in HBM (vLLM's ``BlockPool.unpin_blocks`` with an
``on_reuse`` callback: engine block id -> its key and chain parent), the
write-backs planned when one is reused, waiting for this step's metadata (the
workers copy them out before the forward), and the loads out of DRAM whose
blocks move up (the DRAM copy is dropped once the loaded HBM block is
watched). Must not import vLLM (the block pool is the scheduler's, bound
late), nor plan anything but these DRAM writes.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence
from typing import Any

from kvtier.keys import BlockKey
from kvtier.manager import LoadPlan, StorePlan, TierManager
from kvtier.tiers.lossy import LossyCopies

from .kv_events import TierEvents
from .metadata import StoreJob, TierWrite


class WriteBacks:
    """Exclusive DRAM's watched blocks and write-backs (see the module doc). ``store_plans``: the
    scheduler's store plans in flight (a write-back's joins them); ``job_ids``: its job ids."""

    def __init__(self, manager: TierManager, counters: Counter[str], lossy: LossyCopies, events: TierEvents,
                 store_plans: dict[int, StorePlan], job_ids: itertools.count[int]) -> None:
        self.manager = manager
        self.counters = counters
        self.lossy = lossy
        self.events = events
        self._store_plans = store_plans
        self._job_ids = job_ids
        self.pool: Any = None  # vLLM's block pool, once bound
        self.watched: dict[int, tuple[BlockKey, BlockKey | None]] = {}
        self.pending: list[tuple[int, BlockKey, BlockKey | None, StorePlan]] = []
        self.load_starts: dict[int, int] = {}  # load plan id -> the request's first block loaded

    def watch(self, block_ids: Sequence[int], keys: Sequence[BlockKey], parents: Sequence[BlockKey | None]) -> None:
        """Be told (:meth:`_on_reuse`) when vLLM hands these engine blocks to another request.
        The request holds them, so ``touch`` then ``unpin_blocks`` leaves their reference
        counts and places in the free queue as they were. O(blocks)."""
        pool = self.pool
        if not block_ids or pool is None:
            return
        blocks = [pool.blocks[i] for i in block_ids]
        pool.touch(blocks)
        pool.unpin_blocks(blocks, self._on_reuse)
        self.watched.update(zip(block_ids, zip(keys, parents)))

    def _on_reuse(self, block: Any) -> None:
        """vLLM's block pool hands ``block`` out again (inside ``get_new_blocks``, in this
        scheduling pass): the block it held goes down to DRAM, unless DRAM has it (refreshed)
        or it came from a lossy value. The copy leaves before this step's forward."""
        entry = self.watched.pop(block.block_id, None)
        if entry is None:
            return
        key, parent = entry
        mgr = self.manager
        plan = None
        if self.lossy.is_copy(key) or mgr.is_pending(key, "dram"):
            pass
        elif mgr.contains(key, "dram"):
            mgr.touch((key,), "dram")
            self.counters["write_back_present"] += 1
        else:
            plan = mgr.prepare_store("dram", (key,), parent)
            if plan is None or not plan.keys:
                plan = None
                self.counters["write_back_no_room"] += 1
        if plan is not None:
            self.pending.append((block.block_id, key, parent, plan))
        elif self.events.enabled:  # (a block only HBM held: what its KV event would have said goes)
            self.events.forget_if_gone(key)

    def job(self, scheduler_output: Any) -> StoreJob | None:
        """This step's write-backs as one job the workers copy out before the forward. A
        block vLLM zeroes or copies into before the forward (``new_block_ids_to_zero``,
        ``kv_cache_block_copies``) has lost its bytes by then: its write fails."""
        wbs, self.pending = self.pending, []
        lost = set(getattr(scheduler_output, "new_block_ids_to_zero", None) or ())
        lost.update(c.dst_block_id for c in getattr(scheduler_output, "kv_cache_block_copies", None) or ())
        keep = []
        for wb in wbs:
            if wb[0] in lost:
                self.manager.complete_store(wb[3], False)
                self.counters["write_back_lost"] += 1
            else:
                keep.append(wb)
                self._store_plans[wb[3].plan_id] = wb[3]
        self.events.pump()
        if not keep:
            return None
        self.counters["write_back_blocks"] += len(keep)
        return StoreJob(job_id=next(self._job_ids), req_id="", block_ids=tuple(wb[0] for wb in keep),
                        keys=tuple(wb[1] for wb in keep), parents=tuple(wb[2] for wb in keep),
                        writes=tuple(TierWrite(wb[3].plan_id, "dram", (i,), wb[3].slots) for i, wb in enumerate(keep)))

    def moved_up(self, block_ids: Sequence[int], plan: LoadPlan, num_ok: int, parent: BlockKey | None) -> None:
        """The first ``num_ok`` blocks of load ``plan`` now live in HBM blocks ``block_ids``
        (``parent``: the key before the first): watch them there and drop their DRAM copies
        (a copy another load still reads stays)."""
        keys = list(plan.keys[:num_ok])
        self.watch(block_ids, keys, [parent, *keys[:-1]])
        dram = [k for k, t in zip(keys, plan.tiers) if t == "dram"]
        self.counters["dram_moved_blocks"] += self.manager.remove(dram, "dram")

    def reset(self) -> None:
        """A connector reset: fail the write-backs not sent yet and stop watching (vLLM reset its
        prefix cache first: every watched block came)."""
        for _, _, _, plan in self.pending:
            self.manager.complete_store(plan, False)
        self.pending.clear()
        self.watched.clear()

