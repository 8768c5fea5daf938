"""TieredStore: the user-facing KV store over HBM / DRAM / SSD.

Owns: wiring a :class:`~kvtier.manager.TierManager` (metadata) to the real
bytes (tensor pools, the LMDB tier) through the asynchronous
:class:`~kvtier.transfer.TransferEngine`, under one lock. It turns manager
plans into transfer jobs, completes them, deletes SSD values the manager
evicted, re-indexes an SSD directory on a warm restart, and keeps hit and
miss counters. Must not make policy decisions (the manager's policies do)
and must never return bytes that did not verify: a failed load is a miss.

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
import threading
import time
from collections import Counter, deque
from concurrent.futures import Future
from typing import Any, Callable, Sequence

import torch

from .config import KVTierConfig, load_config
from .events import BlockRemoved, Event
from .keys import BlockKey, chain_keys
from .manager import LoadPlan, MovePlan, PrefixHit, StorePlan, TierManager, TierSpec
from .tiers.pool import TensorPool, accelerator_device, as_byte_tensor, resolve_device
from .transfer import TransferEngine, TransferJob


class TieredStore:
    """Put, get, prefetch and pin KV blocks across the enabled tiers.

    Thread-safe: every method may be called from any thread. ``put`` and
    ``get`` are synchronous (they return once the bytes are stored or
    loaded); ``put_async`` and ``prefetch`` return futures.
    """

    MAX_EVENTS = 65536  # events kept for take_events() when nobody drains them

    def __init__(self, config: KVTierConfig | None = None, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = cfg = config or load_config()
        self.layout = cfg.layout.to_layout()
        self.namespace = cfg.namespace.to_namespace(self.layout)
        bpb = self.layout.bytes_per_block
        specs: list[TierSpec] = []
        self._pools: dict[str, TensorPool] = {}
        self._ssd: Any = None
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
            )
        self.manager = TierManager(specs, pin_budget_blocks=cfg.pin_budget_blocks, clock=clock)
        self._lock = threading.RLock()
        self._mover = TransferEngine(cfg.mover_threads, device=accelerator_device())
        # recent events for take_events(); the oldest go once MAX_EVENTS are kept
        self._events: deque[Event] = deque(maxlen=self.MAX_EVENTS)
        self.counters: Counter[str] = Counter()
        if self._ssd is not None:
            self._reindex_ssd()

    # ------------------------------------------------------------------ keys

    def keys_for(self, token_ids: Sequence[int], parent: BlockKey | None = None) -> list[BlockKey]:
        """Chained keys of the full blocks of ``token_ids`` in this store's namespace."""
        return chain_keys(self.namespace, token_ids, parent)

    # ------------------------------------------------------------------ put

    def put(self, keys: Sequence[BlockKey], blocks: Sequence[Any], parent: BlockKey | None = None) -> int:
        """Store ``blocks[i]`` (``bytes_per_block`` bytes each: tensor, ndarray or bytes)
        under the chain ``keys``. Returns how many of ``keys`` are now readable
        in the put tier (stored now or already present)."""
        return self._put(keys, blocks, parent, inline=True).result()

    def put_async(self, keys: Sequence[BlockKey], blocks: Sequence[Any], parent: BlockKey | None = None) -> Future[int]:
        """Like :meth:`put`, on the mover's threads; the future resolves when every
        tier's write finished. The caller must keep ``blocks`` unchanged until then."""
        return self._put(keys, blocks, parent, inline=False)

    def _put(self, keys: Sequence[BlockKey], blocks: Sequence[Any], parent: BlockKey | None, inline: bool) -> Future[int]:
        if len(keys) != len(blocks):
            raise ValueError(f"put: {len(keys)} keys but {len(blocks)} blocks")
        srcs = [self._check_block(b, i) for i, b in enumerate(blocks)]
        targets = [self.config.put_tier]
        if self.config.write_through:
            targets += [t for t in self.manager.tier_names if t != self.config.put_tier]
        by_key = dict(zip(keys, srcs))
        plans: list[StorePlan] = []
        with self._lock:
            for tier in targets:
                plan = self.manager.prepare_store(tier, keys, parent)
                self._pump_events()
                if plan is not None and plan.keys:
                    plans.append(plan)
        # copies run outside the lock; completion re-takes it
        futures = [self._submit_store(p, [by_key[k] for k in p.keys], inline) for p in plans]
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

    # ------------------------------------------------------------------ get

    def contains_prefix(self, keys: Sequence[BlockKey]) -> PrefixHit:
        """Longest readable prefix of ``keys`` and the fastest tier of each block."""
        with self._lock:
            return self.manager.lookup(keys)

    def get(self, keys: Sequence[BlockKey], outs: Sequence[Any], *, promote: bool = True) -> int:
        """Load the longest readable prefix of ``keys`` into the caller's buffers
        ``outs`` (one per key). Returns the number of leading blocks that loaded
        and verified; buffers past that number hold nothing meaningful. With
        ``promote``, blocks read from SSD are also copied into DRAM."""
        if len(outs) < len(keys):
            raise ValueError(f"get: {len(keys)} keys but {len(outs)} output buffers")
        dsts = [self._check_block(o, i, writable=True) for i, o in enumerate(outs[: len(keys)])]
        with self._lock:
            plan = self.manager.prepare_load(keys)
        self.counters["get_blocks_requested"] += len(keys)
        if plan is None:
            self.counters["get_blocks_missed"] += len(keys)
            return 0
        oks = self._read(plan, dsts)
        with self._lock:
            self.manager.complete_load(plan, oks)
            self._pump_events()
        n = oks.index(False) if False in oks else len(oks)
        for tier, count in Counter(plan.tiers[:n]).items():
            self.counters[f"hit_blocks_{tier}"] += count
        self.counters["get_blocks_missed"] += len(keys) - n
        from_ssd = [i for i in range(n) if plan.tiers[i] == "ssd"]
        if promote and from_ssd and "dram" in self.manager.tier_names:
            first = from_ssd[0]
            parent = keys[first - 1] if first else self.manager.parent_of(keys[0])
            sub = list(keys[first:n])
            with self._lock:
                up = self.manager.prepare_store("dram", sub, parent)
                self._pump_events()
            if up is not None and up.keys:
                idx = {k: i for i, k in enumerate(keys)}
                self._submit_store(up, [dsts[idx[k]] for k in up.keys], inline=True).result()
        return n

    # -------------------------------------------------------------- prefetch

    def prefetch(self, keys: Sequence[BlockKey], tier: str = "dram") -> Future[int]:
        """Promote the readable prefix of ``keys`` into ``tier`` (from slower tiers),
        asynchronously. The future gives the number of blocks now in ``tier``."""
        futures: list[Future[Sequence[bool]]] = []
        with self._lock:
            target = self.manager.tier_names.index(tier)
            hit = self.manager.lookup(keys)
            for src in self.manager.tier_names[target + 1 :]:
                chunk = [k for k, t in zip(keys, hit.tiers) if t == src]
                plan = self.manager.prepare_move(chunk, src, tier, keep_source=True) if chunk else None
                self._pump_events()
                if plan is not None:
                    futures.append(self._submit_move(plan, inline=False))
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

    def demote(self, keys: Sequence[BlockKey], src: str, dst: str) -> int:
        """Move readable ``keys`` from ``src`` down to ``dst`` (dropping the ``src``
        copy), synchronously. Returns the number moved."""
        with self._lock:
            plan = self.manager.prepare_move(keys, src, dst, keep_source=False)
            self._pump_events()
        if plan is None:
            return 0
        return list(self._submit_move(plan, inline=True).result()).count(True)

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
        """Per-tier capacity and use, hit/miss counters, transfer links, SSD counters."""
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
            }
            if self._ssd is not None:
                out["ssd"] = dict(self._ssd.stats)
            return out

    def take_events(self) -> list[Event]:
        """Manager events since the last call (stores, removals, loads, pins)."""
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

    def __enter__(self) -> "TieredStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ internals

    def _check_block(self, buf: Any, i: int, writable: bool = False) -> torch.Tensor:
        t = as_byte_tensor(buf)
        if t.numel() != self.layout.bytes_per_block:
            raise ValueError(
                f"block {i} has {t.numel()} bytes; the layout ({self.layout.describe()}) needs "
                f"{self.layout.bytes_per_block}"
            )
        return t

    def _submit_store(self, plan: StorePlan, srcs: list[torch.Tensor], inline: bool) -> Future[Sequence[bool]]:
        tier = plan.tier
        if tier == "ssd":
            parents = [self.manager.parent_of(k) for k in plan.keys]

            def run() -> Sequence[bool]:
                items = [(k, _host_buffer(s), p) for k, s, p in zip(plan.keys, srcs, parents)]
                n = self._ssd.put_many(items)
                return [i < n for i in range(len(items))]
        else:
            pool = self._pools[tier]

            def run() -> Sequence[bool]:
                return pool.write(plan.slots, srcs)

        job = self._job(f"put->{tier}", len(plan.keys), run, lambda oks: self._done_store(plan, oks))
        return self._dispatch(job, inline)

    def _submit_move(self, plan: MovePlan, inline: bool) -> Future[Sequence[bool]]:
        src, dst = plan.src, plan.dst
        if dst == "ssd":
            pool = self._pools[src]
            parents = [self.manager.parent_of(k) for k in plan.keys]

            def run() -> Sequence[bool]:
                items = [(k, _host_buffer(pool.view(s)), p) for k, s, p in zip(plan.keys, plan.src_slots, parents)]
                n = self._ssd.put_many(items)
                return [i < n for i in range(len(items))]
        elif src == "ssd":
            pool = self._pools[dst]

            def run() -> Sequence[bool]:
                if pool.device.type == "cpu":
                    return self._ssd.get_many_into(plan.keys, [pool.view(s).numpy() for s in plan.dst_slots])
                staging = [torch.empty(pool.bytes_per_block, dtype=torch.uint8) for _ in plan.keys]
                oks = self._ssd.get_many_into(plan.keys, [b.numpy() for b in staging])
                pool.write(plan.dst_slots, staging)
                return oks
        else:
            spool, dpool = self._pools[src], self._pools[dst]

            def run() -> Sequence[bool]:
                return dpool.write(plan.dst_slots, [spool.view(s) for s in plan.src_slots])

        job = self._job(f"{src}->{dst}", len(plan.keys), run, lambda oks: self._done_move(plan, oks))
        return self._dispatch(job, inline)

    def _dispatch(self, job: TransferJob, inline: bool) -> Future[Sequence[bool]]:
        """Run ``job`` on the caller's thread (a caller that waits anyway saves the
        thread hand-off) or on the mover's threads."""
        if not inline:
            return self._mover.submit(job)
        done: Future[Sequence[bool]] = Future()
        done.set_result(self._mover.run_sync(job))
        return done

    def _read(self, plan: LoadPlan, dsts: list[torch.Tensor]) -> list[bool]:
        oks = [False] * len(plan.keys)
        groups: dict[str, list[int]] = {}
        for i, tier in enumerate(plan.tiers):
            groups.setdefault(tier, []).append(i)
        for tier, idx in groups.items():
            if tier == "ssd":
                hosts = [dsts[i] if dsts[i].device.type == "cpu" else torch.empty_like(dsts[i], device="cpu")
                         for i in idx]
                res = self._ssd.get_many_into([plan.keys[i] for i in idx], [h.numpy() for h in hosts])
                for host, i in zip(hosts, idx):
                    if host is not dsts[i]:
                        dsts[i].copy_(host)
            else:
                res = self._pools[tier].read([plan.slots[i] for i in idx], [dsts[i] for i in idx])
            for i, ok in zip(idx, res):
                oks[i] = bool(ok)
        return oks

    def _job(self, link: str, n: int, run: Callable[[], Sequence[bool]], on_done) -> TransferJob:
        return TransferJob(link, n, n * self.layout.bytes_per_block, run, on_done)

    def _done_store(self, plan: StorePlan, oks: Sequence[bool]) -> None:
        with self._lock:
            self.manager.complete_store(plan, list(oks))
            self._pump_events()

    def _done_move(self, plan: MovePlan, oks: Sequence[bool]) -> None:
        with self._lock:
            self.manager.complete_move(plan, list(oks))
            self._pump_events()

    def _pump_events(self) -> None:
        """Drain manager events; delete SSD values the manager dropped (in order)."""
        events = self.manager.take_events()
        if not events:
            return
        if self._ssd is not None:
            gone = [e.key for e in events if isinstance(e, BlockRemoved) and e.tier == "ssd"]
            if gone:
                self._ssd.delete_many(gone)
        self._events.extend(events)

    def _reindex_ssd(self) -> None:
        """Warm restart: index every value already in the SSD directory."""
        count = 0
        for entry in self._ssd.scan():
            key, parent = entry[0], entry[1]
            plan = self.manager.prepare_store("ssd", [key], parent)
            if plan is None:
                break  # capacity reached; the rest stays on disk unindexed
            self.manager.complete_store(plan, True)
            count += 1
        self._pump_events()
        self.counters["ssd_reindexed_blocks"] = count


def _host_buffer(t: torch.Tensor) -> Any:
    """A buffer-protocol view of a tensor's bytes (copied to host if on a device)."""
    if t.device.type != "cpu":
        t = t.cpu()
    return t.numpy()


