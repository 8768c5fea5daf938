"""TieredStore: the user-facing KV store over HBM / DRAM / SSD.

Owns: wiring a :class:`~kvtier.manager.TierManager` (metadata) to the real
bytes (tensor pools, the LMDB tier) through the asynchronous
:class:`~kvtier.transfer.TransferEngine`, under one lock. It turns manager
plans into transfer jobs, completes them, deletes SSD values the manager
evicted, re-indexes an SSD directory on a warm restart, and keeps hit and
miss counters. With ``tiers.remote`` on, a store several engines share
(:class:`~kvtier.tiers.remote.MooncakeTier`) comes after every local tier:
each put is written through to it, a get reads the blocks past the local
hits from it (and promotes them into the put tier), and
:meth:`TieredStore.readable_prefix` counts them. It is not a tier of the
manager: the store evicts on its own. Must not make policy decisions (the manager's policies do)
and must never return bytes that did not verify: a failed load is a miss.

Deadlines. ``get(..., timeout_s=)`` never blocks its caller much past the
deadline: SSD reads then run on the mover into private staging buffers and
are copied into the caller's buffers only when they finished in time (a late
read is a counted miss; its blocks stay readable for later calls), and
promotion into DRAM runs asynchronously. ``prefetch(..., timeout_s=)``
discards a move that lands after its deadline, and any prefetch still in
flight when a ``get`` of its keys starts is discarded too (counted
``prefetch_late_blocks``): a late prefetch never races the request it was
meant for. A failed or late write to SSD is deleted from the LMDB directory,
so no restart can index it.

Miss explanations: with ``logging.DEBUG`` on ``kvtier.store``, every ``get``
that misses logs which block missed and why (:meth:`TieredStore.explain_miss`:
never stored, evicted from a tier, failed verification, moved, in flight).

>>> from kvtier.config import load_config
>>> store = TieredStore(load_config(env={}, overrides={
...     "layout": {"num_layers": 1, "num_kv_heads": 1, "head_dim": 8, "block_size": 4},
...     "tiers": {"hbm": {"enabled": False}}, "put_tier": "dram"}))
>>> keys = store.keys_for(list(range(8)))
>>> import torch
>>> blocks = [torch.full((store.layout.bytes_per_block,), i, dtype=torch.uint8) for i in range(2)]
>>> store.put(keys, blocks)
2
>>> outs = [torch.empty(store.layout.bytes_per_block, dtype=torch.uint8) for _ in range(2)]
>>> store.get(keys, outs), int(outs[1][0])
(2, 1)
>>> store.close()
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from collections import Counter, deque
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable, Sequence

import torch

from .config import KVTierConfig, load_config
from .events import BlockRemoved, Event, StoreFailed
from .keys import BlockKey, chain_keys
from .misses import MissLog, MissReason
from .manager import TIER_ORDER, LoadPlan, MovePlan, PrefixHit, StorePlan, TierManager, TierSpec
from .tiers.pool import TensorPool, accelerator_device, resolve_device
from .tiers.codec import LOSSY_CODECS
from .tiers.lossy import LossyCopies
from .transfer import TransferEngine, TransferJob, media
from .transfer.prefetch import PrefetchLedger

log = logging.getLogger(__name__)

__all__ = ["MissReason", "TieredStore", "reindex_ssd"]  # MissReason: kvtier.misses


class TieredStore:
    """Put, get, prefetch and pin KV blocks across the enabled tiers.

    Thread-safe: every method may be called from any thread. ``put`` and
    ``get`` are synchronous (they return once the bytes are stored or
    loaded); ``put_async`` and ``prefetch`` return futures.
    """

    MAX_EVENTS = 65536  # events kept for take_events() when nobody drains them
    MAX_REMEMBERED_REMOVALS = 65536  # (key -> last removal) kept to explain misses

    def __init__(self, config: KVTierConfig | None = None, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = cfg = config or load_config()
        self.layout = cfg.layout.to_layout()
        self.namespace = cfg.namespace.to_namespace(self.layout)
        bpb = self.layout.bytes_per_block
        specs: list[TierSpec] = []
        self._pools: dict[str, TensorPool] = {}
        self._ssd: Any = None
        self._remote: Any = None
        if cfg.remote.enabled:  # first: a store that cannot be reached fails before anything is opened
            from .tiers.remote import MooncakeTier

            self._remote = MooncakeTier.from_config(self.namespace, self.layout, cfg.remote)
        if cfg.hbm.enabled:
            specs.append(TierSpec("hbm", cfg.hbm.capacity_blocks, cfg.hbm.policy))
            self._pools["hbm"] = TensorPool(cfg.hbm.capacity_blocks, bpb, resolve_device(cfg.hbm.device))
        if cfg.dram.enabled:
            specs.append(TierSpec("dram", cfg.dram.capacity_blocks, cfg.dram.policy))
            pin = cfg.dram.pin_memory if isinstance(cfg.dram.pin_memory, bool) else True
            self._pools["dram"] = TensorPool(cfg.dram.capacity_blocks, bpb, torch.device("cpu"), pin_memory=pin)
        if cfg.ssd.enabled:
            from .tiers.ssd import SSDTier

            specs.append(TierSpec("ssd", cfg.ssd.capacity_blocks, cfg.ssd.policy))
            self._ssd = SSDTier(
                cfg.ssd.resolved_path(),
                self.namespace,
                self.layout,
                map_size_bytes=cfg.ssd.map_size_bytes,
                codec=cfg.ssd.codec,
                zstd_level=cfg.ssd.zstd_level,
                sync=cfg.ssd.sync,
                read_threads=cfg.ssd.read_threads,
                write_threads=cfg.ssd.write_threads,
            )
        # removals and failures are always recorded (SSD deletes, removal counts,
        # explain_miss); the per-block stored/loaded events only for a KV-event feed
        self.manager = TierManager(specs, pin_budget_blocks=cfg.pin_budget_blocks, clock=clock,
                                   record_block_events=cfg.kv_events)
        self._lock = threading.RLock()
        self._mover = TransferEngine(cfg.mover_threads, device=accelerator_device())
        # recent events for take_events(); the oldest go once MAX_EVENTS are kept
        self._events: deque[Event] = deque(maxlen=self.MAX_EVENTS)
        self.counters: Counter[str] = Counter()
        self.removals: Counter[tuple[str, str]] = Counter()  # (tier, reason) -> blocks
        self.offloads: Counter[tuple[str, str, str]] = Counter()  # (src, dst, reason) -> blocks
        self._misses = MissLog(self.MAX_REMEMBERED_REMOVALS, lambda tier: str(getattr(cfg, tier).policy),
                               self._ssd_failure_counts)
        self._prefetches = PrefetchLedger(self.counters)
        # copies in DRAM / HBM decoded from a lossy SSD value (tiers.ssd.codec rq4 / rq3): never written to SSD
        # again (a block is compressed at most once; a demotion of one fails and it stays where it is)
        self._lossy = LossyCopies(("ssd",) if cfg.ssd.enabled and cfg.ssd.codec in LOSSY_CODECS else ())
        # the tiers every put writes: the put tier, then (write-through) the others
        self._put_targets = (cfg.put_tier,) + (
            tuple(t for t in self.manager.tier_names if t != cfg.put_tier) if cfg.write_through else ()
        )
        if self._ssd is not None:
            self._reindex_ssd()

    @property
    def mover(self) -> TransferEngine:
        """The transfer engine (its ``links`` stats, ``fault_hook`` for fault tests)."""
        return self._mover

    # ------------------------------------------------------------------ keys

    def keys_for(self, token_ids: Sequence[int], parent: BlockKey | None = None) -> list[BlockKey]:
        """Chained keys of the full blocks of ``token_ids`` in this store's namespace."""
        return chain_keys(self.namespace, token_ids, parent)

    # ------------------------------------------------------------------ put

    def put(self, keys: Sequence[BlockKey], blocks: Sequence[Any], parent: BlockKey | None = None) -> int:
        """Store ``blocks[i]`` (``bytes_per_block`` bytes each: tensor, ndarray or bytes)
        under the chain ``keys``. Returns how many of ``keys`` are now readable
        in the put tier (stored now or already present)."""
        # the caller waits anyway: each tier's job runs on this thread (no thread
        # hand-off, no futures), and completes its plan before the next one starts
        stored_all = False  # every key stored into the put tier now: no need to look them up again
        for plan, srcs in self._prepare_puts(keys, blocks, parent):
            n = len(plan.keys)
            oks = self._mover.run_inline(_PUT_LINKS[plan.tier], n, n * self.layout.bytes_per_block,
                                         self._store_fn(plan, srcs))
            self._done_store(plan, oks)
            if plan.tier == self.config.put_tier:
                stored_all = len(plan.keys) == len(keys) and all(oks)
        if self._remote is not None and keys:
            srcs = media.caller_blocks(blocks, self.layout)
            self._mover.run_inline("put->remote", len(keys), len(keys) * self.layout.bytes_per_block,
                                   media.caller_to_remote(self._remote, keys, srcs, parent, self.counters))
        if stored_all:
            return len(keys)
        with self._lock:
            return len(self.manager.present(keys, self.config.put_tier))

    def put_async(self, keys: Sequence[BlockKey], blocks: Sequence[Any], parent: BlockKey | None = None) -> Future[int]:
        """Like :meth:`put`, on the mover's threads; the future resolves when every
        tier's write finished. The caller must keep ``blocks`` unchanged until then."""
        futures = [self._mover.submit(self._store_job(p, srcs)) for p, srcs in self._prepare_puts(keys, blocks, parent)]
        if self._remote is not None and keys:
            srcs = media.caller_blocks(blocks, self.layout)
            put = media.caller_to_remote(self._remote, keys, srcs, parent, self.counters)
            futures.append(self._mover.submit(self._job("put->remote", len(keys), put, lambda oks: None)))
        done: Future[int] = Future()

        def finish(_: object = None) -> None:
            if all(f.done() for f in futures) and not done.done():
                with self._lock:
                    n = len(self.manager.present(keys, self.config.put_tier))
                done.set_result(n)

        for f in futures:
            f.add_done_callback(finish)
        if not futures:
            finish()
        return done

    def _prepare_puts(
        self, keys: Sequence[BlockKey], blocks: Sequence[Any], parent: BlockKey | None
    ) -> list[tuple[StorePlan, list[torch.Tensor]]]:
        """Check ``blocks`` and reserve room for ``keys`` in every target tier (under
        the lock); returns each plan with the source buffer of each of its keys.
        The copies then run outside the lock; completion re-takes it."""
        if len(keys) != len(blocks):
            raise ValueError(f"put: {len(keys)} keys but {len(blocks)} blocks")
        srcs = media.caller_blocks(blocks, self.layout)
        plans: list[StorePlan] = []
        with self._lock:
            for tier in self._put_targets:
                plan = self.manager.prepare_store(tier, keys, parent)
                self._pump_events()
                if plan is not None and plan.keys:
                    plans.append(plan)
        if len(plans) == 1 and len(plans[0].keys) == len(keys):  # one tier, no key skipped (most puts)
            return [(plans[0], srcs)]
        if all(len(p.keys) == len(keys) for p in plans):  # no key skipped: plan.keys == keys
            return [(p, srcs) for p in plans]
        by_key = dict(zip(keys, srcs))
        return [(p, [by_key[k] for k in p.keys]) for p in plans]

    # ------------------------------------------------------------------ get

    def contains_prefix(self, keys: Sequence[BlockKey]) -> PrefixHit:
        """Longest readable prefix of ``keys`` in the local tiers and the fastest tier of each block."""
        with self._lock:
            return self.manager.lookup(keys)

    def readable_prefix(self, keys: Sequence[BlockKey]) -> int:
        """How many leading ``keys`` a :meth:`get` could load now: the local tiers'
        run, continued by the remote tier's (asked over the network; a value may
        still fail to verify there, and then it is a miss)."""
        with self._lock:
            n = self.manager.lookup(keys).num_blocks
        if self._remote is None or n == len(keys):
            return n
        found = self._remote.contains_many(list(keys[n:]))
        return n + (found.index(False) if False in found else len(found))

    def get(
        self, keys: Sequence[BlockKey], outs: Sequence[Any], *, promote: bool = True, timeout_s: float | None = None
    ) -> int:
        """Load the longest readable prefix of ``keys`` into the caller's buffers
        ``outs`` (one per key). Returns the number of leading blocks that loaded
        and verified; buffers past that number hold nothing meaningful. With
        ``promote``, blocks read from SSD are also copied into DRAM.

        ``timeout_s``: return within about that long even when SSD I/O is slow
        (see the module docstring); blocks not read in time are misses
        (``get_deadline_missed_blocks``) and stay readable for later calls.
        Prefetches of ``keys`` still in flight are discarded (they are late)."""
        if len(outs) < len(keys):
            raise ValueError(f"get: {len(keys)} keys but {len(outs)} output buffers")
        if timeout_s is not None and not timeout_s >= 0:
            raise ValueError(f"get: timeout_s={timeout_s!r} must be >= 0 or None")
        deadline = None if timeout_s is None else time.perf_counter() + timeout_s
        dsts = media.caller_blocks(outs[: len(keys)], self.layout)
        with self._lock:
            self._prefetches.overtaken(keys)
            plan = self.manager.prepare_load(keys)
        self.counters["get_blocks_requested"] += len(keys)
        if plan is None and self._remote is None:
            self.counters["get_blocks_missed"] += len(keys)
            self._log_miss(keys, 0)
            return 0
        if plan is None:
            oks = []
            plan = LoadPlan(0, (), (), ())
        elif deadline is None:
            oks = self._read(plan, dsts)
            with self._lock:
                self.manager.complete_load(plan, oks)
                self._pump_events()
        else:
            oks = self._read_by(plan, dsts, deadline)
        n = oks.index(False) if False in oks else len(oks)
        tiers_read = plan.tiers[:n]
        if self._remote is not None and n < len(keys) and (deadline is None or time.perf_counter() < deadline):
            got = self._read_remote(keys[n:], dsts[n:])
            tiers_read += ("remote",) * got
            n += got
        if n and tiers_read.count(tiers_read[0]) == n:  # one tier (the common case): no Counter
            self.counters[f"hit_blocks_{tiers_read[0]}"] += n
        else:
            for tier, count in Counter(tiers_read).items():
                self.counters[f"hit_blocks_{tier}"] += count
        self._note_reads(plan.keys[:n], tiers_read)
        self.counters["get_blocks_missed"] += len(keys) - n
        if n < len(keys):
            self._log_miss(keys, n)
        if promote:
            self._promote_read(keys[:n], dsts, tiers_read, wait=deadline is None)
        return n

    def _promote_read(self, keys: Sequence[BlockKey], dsts: list[torch.Tensor], tiers_read: Sequence[str],
                      wait: bool) -> None:
        """Copy the blocks a get read from SSD or the remote tier (from the first of them on)
        into DRAM, from the caller's buffers: before returning when ``wait``, else
        asynchronously from a private copy (the caller owns ``dsts`` once the get returns)."""
        slow = [t for t in ("ssd", "remote") if t in tiers_read]
        if not slow or "dram" not in self.manager.tier_names:
            return
        first = min(tiers_read.index(t) for t in slow)
        parent = keys[first - 1] if first else self.manager.parent_of(keys[0])
        with self._lock:
            up = self.manager.prepare_store("dram", list(keys[first:]), parent)
            self._pump_events()
        if up is not None and up.keys:
            idx = {k: i for i, k in enumerate(keys)}
            if wait:
                self._submit_store(up, [dsts[idx[k]] for k in up.keys], inline=True).result()
            else:
                self._submit_store(up, [dsts[idx[k]].clone() for k in up.keys], inline=False)

    def explain_miss(self, keys: Sequence[BlockKey], index: int | None = None) -> MissReason | None:
        """Why block ``index`` of ``keys`` (default: the first not readable now) is
        not served, or ``None`` when every block is readable (:mod:`kvtier.misses`)."""
        with self._lock:
            return self._misses.explain(self.manager, keys, index)

    # -------------------------------------------------------------- prefetch

    def prefetch(self, keys: Sequence[BlockKey], tier: str = "dram", *, timeout_s: float | None = None) -> Future[int]:
        """Promote the readable prefix of ``keys`` into ``tier`` (from slower tiers),
        asynchronously. The future gives the number of blocks now in ``tier``.

        A move that completes more than ``timeout_s`` after this call, or after
        a :meth:`get` of its keys started, is discarded: its blocks do not
        become readable in ``tier`` (they stay readable where they were) and are
        counted in ``prefetch_late_blocks``; moves in time count in
        ``prefetch_on_time_blocks``, then in ``prefetch_used_blocks`` when a get
        reads them from ``tier`` or ``prefetch_wasted_blocks`` when they leave
        ``tier`` unread."""
        if timeout_s is not None and not timeout_s >= 0:
            raise ValueError(f"prefetch: timeout_s={timeout_s!r} must be >= 0 or None")
        deadline = None if timeout_s is None else time.perf_counter() + timeout_s
        futures: list[Future[Sequence[bool]]] = []
        with self._lock:
            target = self.manager.tier_names.index(tier)
            hit = self.manager.lookup(keys)
            for src in self.manager.tier_names[target + 1 :]:
                chunk = [k for k, t in zip(keys, hit.tiers) if t == src]
                plan = self.manager.prepare_move(chunk, src, tier, keep_source=True) if chunk else None
                self._pump_events()
                if plan is not None:
                    self._prefetches.started(plan.keys, plan.plan_id)
                    futures.append(self._submit_move(plan, inline=False, deadline=deadline, prefetch=True))
        done: Future[int] = Future()

        def finish(_: object = None) -> None:
            if all(f.done() for f in futures) and not done.done():
                with self._lock:
                    done.set_result(sum(self.manager.contains(k, tier) for k in keys))

        for f in futures:
            f.add_done_callback(finish)
        if not futures:
            finish()
        return done

    def demote(self, keys: Sequence[BlockKey], src: str, dst: str, *, reason: str = "caller") -> int:
        """Move readable ``keys`` from ``src`` down to ``dst`` (dropping the ``src``
        copy), synchronously. Returns the number moved. ``reason`` (the offload
        decision's cause, e.g. ``tool_call``, ``pressure``) labels the
        ``offloads`` counter."""
        with self._lock:
            plan = self.manager.prepare_move(keys, src, dst, keep_source=False)
            self._pump_events()
        if plan is None:
            return 0
        moved = list(self._submit_move(plan, inline=True).result()).count(True)
        self.offloads[(src, dst, reason)] += moved
        return moved

    # ------------------------------------------------------------------ pins

    def pin(self, keys: Sequence[BlockKey], ttl_s: float | None = None) -> int | None:
        """Pin ``keys`` for ``ttl_s`` (default ``default_pin_ttl_s``); ``None`` if over budget."""
        with self._lock:
            n = self.manager.pin(keys, ttl_s or self.config.default_pin_ttl_s)
            self._pump_events()
            return n

    def unpin(self, keys: Sequence[BlockKey]) -> None:
        with self._lock:
            self.manager.unpin(keys)
            self._pump_events()

    # ------------------------------------------------------------ stats, events

    def stats(self) -> dict[str, Any]:
        """Per-tier capacity and use, hit/miss counters, transfer links, SSD and remote counters."""
        with self._lock:
            m = self.manager
            out: dict[str, Any] = {
                "tiers": {
                    t: {"capacity_blocks": m.capacity_blocks(t), "used_blocks": m.used_blocks(t),
                        "ready_blocks": m.ready_blocks(t)}
                    for t in m.tier_names
                },
                "counters": dict(self.counters),
                "pinned_blocks": m.num_pinned(),
                "links": {k: dataclasses.asdict(v) for k, v in self._mover.links.items()},
                "failed_jobs": self._mover.failed_jobs,
                "timed_out_jobs": self._mover.timed_out_jobs,
                "removals": {f"{t}:{r}": n for (t, r), n in sorted(self.removals.items())},
                "offloads": {f"{s}->{d}:{r}": n for (s, d, r), n in sorted(self.offloads.items())},
            }
            if self._ssd is not None:
                out["ssd"] = dict(self._ssd.stats)
                out["ssd_last_error"] = self._ssd.last_error
            if self._remote is not None:  # the store client's outcomes: put/get blocks, misses by cause, errors
                out["remote"] = dict(self._remote.counters)
            return out

    def take_events(self) -> list[Event]:
        """Manager events since the last call: removals, failed stores, moves and
        pins always; ``BlockStored`` / ``BlockLoaded`` (one per block) only with
        the ``kv_events`` setting on, as a KV-event publisher needs."""
        with self._lock:
            self._pump_events()
            events = list(self._events)
            self._events.clear()
            return events

    def check_invariants(self) -> None:
        with self._lock:
            self.manager.check_invariants()

    def close(self) -> None:
        self._mover.close()
        if self._ssd is not None:
            self._ssd.close()
        if self._remote is not None:
            self._remote.close()

    def __enter__(self) -> "TieredStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ internals

    def _submit_store(self, plan: StorePlan, srcs: list[torch.Tensor], inline: bool) -> Future[Sequence[bool]]:
        return self._dispatch(self._store_job(plan, srcs), inline)

    def _store_job(self, plan: StorePlan, srcs: list[torch.Tensor]) -> TransferJob:
        """The job writing ``srcs`` (one per key of ``plan``) into its tier; it completes ``plan``."""
        return self._job(_PUT_LINKS[plan.tier], len(plan.keys), self._store_fn(plan, srcs),
                         functools.partial(self._done_store, plan))

    def _store_fn(self, plan: StorePlan, srcs: list[torch.Tensor]) -> Callable[[], Sequence[bool]]:
        """The write of ``srcs`` (one per key of ``plan``) into its tier; one ``ok`` per key."""
        if plan.tier != "ssd":
            return media.caller_to_pool(self._pools[plan.tier], plan.slots, srcs)
        parents = [self.manager.parent_of(k) for k in plan.keys]
        return media.caller_to_ssd(self._ssd, plan.keys, srcs, parents, self.layout.bytes_per_block)

    def _submit_move(
        self, plan: MovePlan, inline: bool, deadline: float | None = None, prefetch: bool = False
    ) -> Future[Sequence[bool]]:
        src, dst = plan.src, plan.dst
        if dst == "ssd":
            parents = [self.manager.parent_of(k) for k in plan.keys]
            run = media.pool_to_ssd(self._pools[src], plan.src_slots, self._ssd, plan.keys, parents, self._lossy,
                                    self.counters)
        elif src == "ssd":
            run = media.ssd_to_pool(self._ssd, plan.keys, self._pools[dst], plan.dst_slots, self._lossy)
        else:
            run = media.pool_to_pool(self._pools[src], plan.src_slots, self._pools[dst], plan.dst_slots)
        job = self._job(f"{src}->{dst}", len(plan.keys), run, lambda oks: self._done_move(plan, oks, prefetch, deadline))
        job.deadline = deadline
        return self._dispatch(job, inline)

    def _dispatch(self, job: TransferJob, inline: bool) -> Future[Sequence[bool]]:
        """Run ``job`` on the caller's thread (a caller that waits anyway saves the
        thread hand-off) or on the mover's threads."""
        if not inline:
            return self._mover.submit(job)
        done: Future[Sequence[bool]] = Future()
        done.set_result(self._mover.run_sync(job))
        return done

    def _read_by(self, plan: LoadPlan, dsts: list[torch.Tensor], deadline: float) -> list[bool]:
        """:meth:`_read` bounded by ``deadline``: memory tiers are read inline; SSD
        blocks on the mover into staging buffers, copied out only if in time.
        Completes ``plan`` (from the mover's thread when SSD is involved)."""
        ssd_idx = [i for i, t in enumerate(plan.tiers) if t == "ssd"]
        mem_plan = [i for i, t in enumerate(plan.tiers) if t != "ssd"]
        oks = [False] * len(plan.keys)
        if mem_plan:
            sub = LoadPlan(plan.plan_id, tuple(plan.keys[i] for i in mem_plan), tuple(plan.tiers[i] for i in mem_plan),
                           tuple(plan.slots[i] for i in mem_plan))
            for i, ok in zip(mem_plan, self._read(sub, [dsts[i] for i in mem_plan])):
                oks[i] = ok
        if not ssd_idx:
            with self._lock:
                self.manager.complete_load(plan, oks)
                self._pump_events()
            return oks
        staging = [torch.empty(self.layout.bytes_per_block, dtype=torch.uint8) for _ in ssd_idx]
        mem_oks = list(oks)

        def run() -> Sequence[bool]:
            return self._ssd.get_many_into([plan.keys[i] for i in ssd_idx], [b.numpy() for b in staging])

        def done(ssd_oks: Sequence[bool]) -> None:
            all_oks = list(mem_oks)
            for i, ok in zip(ssd_idx, ssd_oks):
                all_oks[i] = bool(ok)
            with self._lock:
                self.manager.complete_load(plan, all_oks)
                self._pump_events()

        future = self._mover.submit(self._job("ssd->caller", len(ssd_idx), run, done))
        try:
            ssd_oks = future.result(timeout=max(0.0, deadline - time.perf_counter()))
        except FutureTimeout:
            self.counters["get_deadline_missed_blocks"] += len(ssd_idx)
            return oks
        for i, ok, buf in zip(ssd_idx, ssd_oks, staging):
            if ok:
                dsts[i].copy_(buf)
            oks[i] = bool(ok)
        return oks

    def _read(self, plan: LoadPlan, dsts: list[torch.Tensor]) -> list[bool]:
        """Read every block of ``plan`` into ``dsts[i]``; one ``ok`` per block."""
        tiers = plan.tiers
        if tiers.count(tiers[0]) == len(tiers):  # one tier (the common case): no regrouping
            return self._read_tier(tiers[0], plan.keys, plan.slots, dsts[: len(tiers)])
        oks = [False] * len(plan.keys)
        groups: dict[str, list[int]] = {}
        for i, tier in enumerate(tiers):
            groups.setdefault(tier, []).append(i)
        for tier, idx in groups.items():
            res = self._read_tier(tier, [plan.keys[i] for i in idx], [plan.slots[i] for i in idx],
                                  [dsts[i] for i in idx])
            for i, ok in zip(idx, res):
                oks[i] = ok
        return oks

    def _read_remote(self, keys: Sequence[BlockKey], dsts: list[torch.Tensor]) -> int:
        """Read ``keys`` from the remote tier into ``dsts``; the leading run that verified."""
        oks = self._mover.run_inline("remote->caller", len(keys), len(keys) * self.layout.bytes_per_block,
                                     media.remote_to_caller(self._remote, keys, dsts, self.layout.bytes_per_block))
        return oks.index(False) if False in oks else len(oks)

    def _read_tier(
        self, tier: str, keys: Sequence[BlockKey], slots: Sequence[int], dsts: list[torch.Tensor]
    ) -> list[bool]:
        if tier != "ssd":
            return media.pool_to_caller(self._pools[tier], slots, dsts)
        return media.ssd_to_caller(self._ssd, keys, dsts, self.layout.bytes_per_block)

    def _job(self, link: str, n: int, run: Callable[[], Sequence[bool]], on_done) -> TransferJob:
        return TransferJob(link, n, n * self.layout.bytes_per_block, run, on_done)

    def _done_store(self, plan: StorePlan, oks: Sequence[bool]) -> None:
        with self._lock:
            self.manager.complete_store(plan, True if all(oks) else list(oks))
            self._pump_events()

    def _done_move(
        self, plan: MovePlan, oks: Sequence[bool], prefetch: bool = False, deadline: float | None = None
    ) -> None:
        with self._lock:
            oks = list(oks)
            if prefetch:
                late = deadline is not None and time.perf_counter() > deadline
                oks = self._prefetches.settle(plan.plan_id, plan.keys, plan.dst, oks, late)
            self.manager.complete_move(plan, oks)
            self._pump_events()

    def _note_reads(self, keys: Sequence[BlockKey], tiers: Sequence[str]) -> None:
        if self._prefetches.any_landed():
            with self._lock:
                self._prefetches.read(keys, tiers)

    def _log_miss(self, keys: Sequence[BlockKey], index: int) -> None:
        if log.isEnabledFor(logging.DEBUG):
            why = self.explain_miss(keys, index)
            if why is not None:
                log.debug("kvtier get: %d of %d blocks served; block %d (key %#034x) missed: %s (%s)",
                          index, len(keys), index, why.key, why.reason, why.detail)

    def _ssd_failure_counts(self) -> str:
        st = self._ssd.stats if self._ssd is not None else {}
        return ", ".join(f"{k}={st.get(k, 0)}" for k in ("checksum_failures", "decode_failures", "mismatches",
                                                         "key_mismatches"))

    def _pump_events(self) -> None:
        """Drain manager events; delete SSD values the manager dropped or whose store
        failed (in order); count removals and remember the last one per key."""
        events = self.manager.take_events()
        if not events:
            return
        kinds = set(map(type, events))  # most batches are all BlockStored / BlockLoaded: no loop below
        if BlockRemoved in kinds:
            for e in events:
                if isinstance(e, BlockRemoved):
                    self.removals[(e.tier, e.reason)] += 1
                    self._misses.removed(e.key, e.tier, e.reason)
                    self._prefetches.removed(e.key, e.tier)
                    if self._lossy.is_copy(e.key) and not any(t != "ssd" for t in self.manager.tiers_of(e.key)):
                        self._lossy.forget_copy(e.key)  # no decoded copy is left
        if self._ssd is not None and (BlockRemoved in kinds or StoreFailed in kinds):
            gone = [e.key for e in events if isinstance(e, (BlockRemoved, StoreFailed)) and e.tier == "ssd"]
            if gone:
                self._ssd.delete_many(gone)
        self._events.extend(events)

    def _reindex_ssd(self) -> None:
        """Warm restart (see :func:`reindex_ssd`)."""
        count, purged = reindex_ssd(self._ssd, self.manager)
        self._pump_events()
        self.counters["ssd_purged_unreadable_values"] = purged
        self.counters["ssd_reindexed_blocks"] = count


def reindex_ssd(ssd: Any, manager: TierManager) -> tuple[int, int]:
    """Warm restart of an SSD tier: the one re-index, used by :class:`TieredStore`
    and by the vLLM connector's scheduler.

    Deletes the values no reader can ever use (:meth:`SSDTier.purge_unreadable
    <kvtier.tiers.ssd.SSDTier.purge_unreadable>`), then indexes in ``manager``'s
    ``ssd`` tier every readable value of this namespace and layout, with its
    parent link, until the tier's capacity (the rest stays on disk,
    unindexed); values of other namespaces are left alone. Reads headers only.
    Returns ``(indexed, purged)``; the manager's events are the caller's.
    """
    purged = ssd.purge_unreadable()
    count = 0
    for entry in ssd.scan():
        plan = manager.prepare_store("ssd", [entry.key], entry.parent)
        if plan is None:
            break  # capacity reached
        manager.complete_store(plan, True)
        count += 1
    return count, purged


_PUT_LINKS = {t: f"put->{t}" for t in TIER_ORDER}  # mover link names, made once
