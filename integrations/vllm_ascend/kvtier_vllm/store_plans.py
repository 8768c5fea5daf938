"""Store planning: which of a request's blocks that became full are written to which tier.

Owns: the rule of what is stored (every tier's plan of each new run of keys, a
key loaded from a lossy value left out; a sliding-window group only inside its
window; with exclusive DRAM, no DRAM plan: the block is watched in HBM
instead; cold blocks, whose agent then waits long, to the slow tiers with the
lossy codec; the remote tier's write of what the store may not hold, soft
pinned for an agent's blocks) and the store job that carries them, one row per
block some plan writes. Must not complete plans (the scheduler does, once every
worker reported), import vLLM (its KV cache manager, bound late, gives the
engine block ids), or move bytes.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from kvtier.keys import BlockKey
from kvtier.manager import StorePlan, TierManager
from kvtier.sdk.params import request_tool_wait_s
from kvtier.tiers.lossy import LossyCopies

from .kv_events import TierEvents
from .lanes import HybridLanes, Units
from .metadata import StoreJob, TierWrite
from .remote_index import RemoteIndex
from .settings import ConnectorSettings
from .write_backs import WriteBacks

Write = tuple[int, str, Sequence[BlockKey], Sequence[int]]
"""(plan id, tier, keys, slots) of one tier's write."""


class StorePlanner:
    """The store plans of each step (see the module doc). ``store_plans`` and ``job_to_req``: the
    scheduler's plans and jobs in flight (this adds to them); ``job_ids``: its job ids;
    ``keys_of(st)``: a request's keys; ``exclusive``: exclusive DRAM is on."""

    def __init__(self, settings: ConnectorSettings, manager: TierManager, counters: Counter[str], lossy: LossyCopies,
                 events: TierEvents, lanes: HybridLanes, write_backs: WriteBacks, remote: RemoteIndex | None,
                 exclusive: bool, keys_of: Callable[[Any], list[BlockKey]], store_plans: dict[int, StorePlan],
                 job_to_req: dict[int, str], job_ids: itertools.count[int]) -> None:
        self.cold = settings.cold
        self.manager = manager
        self.counters = counters
        self.lossy = lossy
        self.events = events
        self.lanes = lanes
        self.write_backs = write_backs
        self.remote = remote
        self.exclusive = exclusive
        self._keys_of = keys_of
        self._store_plans = store_plans
        self._job_to_req = job_to_req
        self._job_ids = job_ids
        self.kv_cache_manager: Any = None  # vLLM's, once bound

    def plan(self, req_id: str, st: Any, upto: int) -> StoreJob | None:
        """One job of every tier's writes of ``st``'s blocks full by ``upto`` and not planned
        yet (with exclusive DRAM, DRAM's waits until HBM gives the block up: watched)."""
        keys = self._keys_of(st)
        upto = min(upto, len(keys))
        start = st.num_planned_blocks
        if upto <= start or self.kv_cache_manager is None:
            return None
        st.num_planned_blocks = upto
        new = keys[start:upto]
        parent = keys[start - 1] if start else None
        if self.events.enabled:
            self.events.note_meta(st.request, keys, start, upto)
        # what to store, per KV cache group: (runs of (keys, key before, chained)), and per row of the job
        # its key, engine block id (the first group's are read only if something is stored) and chain parent
        ids: list[int] = []
        if self.lanes.hybrid:
            units, new, ids, parents = self.lanes.store_units(st, start, upto,
                                                              self.kv_cache_manager.get_block_ids(req_id), self.runs)
        else:
            units = [(run, before, True) for run, before in self.runs(new, parent)]
            parents = [parent, *new[:-1]]
        watching = self.exclusive and self.write_backs.pool is not None  # (else written through, as without)
        if watching:
            self.write_backs.watch(self.kv_cache_manager.get_block_ids(req_id)[0][start:upto], new, parents)
        pin_ttl_s = 0.0  # an agent's blocks are soft-pinned in the remote store
        # cold blocks (their agent then waits long) go to the slow tiers with the lossy codec
        cold = self.cold.codec_for(request_tool_wait_s(st.params)) \
            if self.cold is not None else None
        plans = self._tier_plans(units, watching, cold)
        self.events.pump()
        if self.remote is not None and self.remote.open:
            write = self.remote.plan_write(new, cold)
            if write is not None:
                plans.append(write)
                pin_ttl_s = self.remote.settings.pin_ttl_s if st.agent is not None else 0.0
        if not plans:
            return None
        if not self.lanes.hybrid:
            ids = self.kv_cache_manager.get_block_ids(req_id)[0][start:upto]
        return self._job(req_id, st, new, ids, parents, plans, pin_ttl_s, cold)

    def runs(self, new: list[BlockKey], parent: BlockKey | None) -> list[tuple[list[BlockKey], BlockKey | None]]:
        """``new`` (a chain after ``parent``) as runs of keys that may be stored, each with
        the key before it: keys loaded from a lossy value are left out (counted)."""
        if not self.lossy.any_copies():
            return [(new, parent)]
        runs: list[tuple[list[BlockKey], BlockKey | None]] = []
        before = parent
        for key, ok in zip(new, self.lossy.storable(new)):
            if not ok:
                self.counters["store_skipped_lossy_blocks"] += 1
            elif runs and runs[-1][0][-1] == before:
                runs[-1][0].append(key)
            else:
                runs.append(([key], before))
            before = key
        return runs

    def _tier_plans(self, units: Units, watching: bool, cold: str | None) -> list[Write]:
        """Each tier's store plan of each run of ``units``; none for DRAM while ``watching``
        (it goes down when HBM evicts it); ``cold``: the slow tiers' lossy codec, if any."""
        plans: list[Write] = []
        for run, before, chained in units:
            for tier in self.manager.tier_names:
                if watching and tier == "dram":
                    continue  # it goes down when HBM evicts it
                plan = self.manager.prepare_store(tier, run, before, chain=chained)
                if plan is not None and plan.keys:
                    plans.append((plan.plan_id, plan.tier, plan.keys, plan.slots))
                    self._store_plans[plan.plan_id] = plan
                    if tier == "ssd" and cold:
                        self.lossy.wrote("ssd", plan.keys)
                        self.counters["store_cold_blocks"] += len(plan.keys)
        return plans

    def _job(self, req_id: str, st: Any, new: list[BlockKey], ids: Sequence[int], parents: list[BlockKey | None],
             plans: list[Write], pin_ttl_s: float, cold: str | None) -> StoreJob:
        """The job of ``plans``: the rows (of ``new``) some plan writes, each plan's write naming its rows."""
        index = {k: i for i, k in enumerate(new)}
        rows = sorted({index[k] for p in plans for k in p[2]})
        pos = {r: j for j, r in enumerate(rows)}
        writes = tuple(TierWrite(pid, tier, tuple(pos[index[k]] for k in ks), slots, pin_ttl_s if tier == "remote"
                                 else 0.0, (cold or "") if tier in ("ssd", "remote") else "")
                       for pid, tier, ks, slots in plans)
        job = StoreJob(
            job_id=next(self._job_ids), req_id=req_id,
            block_ids=tuple(ids[r] for r in rows),
            keys=tuple(new[r] for r in rows),
            parents=tuple(parents[r] for r in rows),
            writes=writes,
        )
        st.pending_jobs.add(job.job_id)
        self._job_to_req[job.job_id] = req_id
        return job
