"""SharedStore: masters and per-agent mirrors of shared segments, with fused restore.

Owns: the bytes of shared segments in every tier — master blocks in tensor
pools (``hbm`` / ``dram``) or in the SSD tier's LMDB (checksummed values),
mirror diffs in host memory or a diff LMDB (re-compressed at a higher zstd
level on SSD) — and wiring them to the :class:`~kvtier.shared.index.SharedIndex`
bookkeeping under one lock: put (first copy = master, others = mirrors
diffed against the master), collective fused restore, release, master
eviction with re-base or drop, and moves between tiers. Must not choose
victims (callers and policies do) and must never return bytes that did not
verify: a diff whose checksum, frame or rows are wrong, or an SSD master that
does not verify, makes the restore of that agent's segment a miss (``False``).

Agents declare shared rounds here through the store API (:meth:`put_segment`
with the segment's content key) or through the hint plane's
``SharedRoundStart``; either way a segment is addressed by its
position-independent :func:`~kvtier.shared.segments.segment_key`.

>>> import torch
>>> from kvtier.keys import Namespace
>>> from kvtier.layout import KVLayout
>>> layout = KVLayout(1, 1, 8, "bfloat16", 4)
>>> store = SharedStore(layout, Namespace("m", "bfloat16", "fused", 4), SharedConfig(dram_blocks=4))
>>> master = torch.arange(2 * layout.bytes_per_block, dtype=torch.int64).to(torch.uint8).view(2, -1)
>>> mirror = master.clone(); mirror[1, :16] ^= 1    # the second agent differs in one row
>>> seg = SegmentKey(42)
>>> store.put_segment(AgentId("a"), seg, list(master)).role, store.put_segment(AgentId("b"), seg, list(mirror)).role
('master', 'mirror')
>>> out = torch.zeros(4, layout.bytes_per_block, dtype=torch.uint8)
>>> store.restore_round([RestoreRequest(AgentId("b"), seg, (2, 3))], out)
[True]
>>> torch.equal(out[2:4], mirror)
True
>>> store.close()
"""

from __future__ import annotations

import os
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch
import xxhash

from ..errors import ConfigError, ProtocolError
from ..keys import Namespace
from ..layout import KVLayout
from ..tiers.pool import TensorPool, as_byte_tensor, resolve_device
from .diff import DIFF_MODES, DiffRows, DiffSpec, decode_diff, encode_diff, recompress
from .index import AgentId, MirrorInfo, SharedIndex
from .restore import Patch, dense_restore, fused_restore
from .segments import SegmentKey, segment_block_keys
from .values import DiffValues, LmdbDiffValues, MemoryDiffValues, diff_key

RestoreMode = Literal["fused", "dense"]


@dataclass(frozen=True, slots=True)
class SharedConfig:
    """Capacities and diff settings of a :class:`SharedStore`.

    ``*_blocks`` bound master blocks per tier (0 disables the tier; ``ssd``
    needs ``ssd_path``); ``*_diff_bytes`` bound mirror diff bytes per tier.
    ``row_bytes`` (default: one token's K or V of one layer) is the diff
    granularity. ``diff_mode`` ``lossy`` needs ``error_bound_abs`` > 0.
    ``verify_output`` also checks each restored mirror against the checksum
    of the block it must reproduce (one extra XXH3 pass; diffs are always
    verified before use).
    """

    dram_blocks: int = 0
    dram_diff_bytes: int = 1 << 30
    hbm_blocks: int = 0
    hbm_device: str = "auto"
    hbm_diff_bytes: int = 1 << 30
    ssd_blocks: int = 0
    ssd_diff_bytes: int = 4 << 30
    ssd_path: str | None = None
    ssd_map_size_bytes: int = 4 << 30
    diff_mode: str = "lossless"
    error_bound_abs: float = 0.0
    row_bytes: int | None = None
    dram_zstd_level: int = 1
    ssd_zstd_level: int = 9
    verify_output: bool = False

    def __post_init__(self) -> None:
        if self.diff_mode not in DIFF_MODES:
            raise ConfigError("shared.diff_mode", self.diff_mode, f"valid: {list(DIFF_MODES)}")
        if self.ssd_blocks and not self.ssd_path:
            raise ConfigError("shared.ssd_path", self.ssd_path, "the ssd tier needs a directory")
        if not (self.hbm_blocks or self.dram_blocks or self.ssd_blocks):
            raise ConfigError("shared.dram_blocks", self.dram_blocks, "enable at least one tier (capacity > 0)")


@dataclass(frozen=True, slots=True)
class PutResult:
    """What :meth:`SharedStore.put_segment` stored: ``role`` ``master`` (``stored_bytes`` =
    the blocks) or ``mirror`` (``stored_bytes`` = its diff value, ``num_diff_blocks`` of
    ``num_blocks`` differ from the master, ``num_diff_rows`` rows in all)."""

    role: str
    tier: str
    num_blocks: int
    num_diff_blocks: int
    num_diff_rows: int
    stored_bytes: int


@dataclass(frozen=True, slots=True)
class RestoreRequest:
    """Restore ``agent``'s copy of ``segment`` into destination slots ``dst_slots``
    (one per block of the segment)."""

    agent: AgentId
    segment: SegmentKey
    dst_slots: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class EvictResult:
    """What :meth:`SharedStore.evict_master` did: ``promoted`` mirror became the
    master (``None``: the segment was dropped), ``rediffed`` mirrors were re-diffed
    against it, ``dropped`` agents lost their copy (the old owner included)."""

    promoted: AgentId | None
    rediffed: tuple[AgentId, ...]
    dropped: tuple[AgentId, ...]


class SharedStore:
    """Shared segments of one (namespace, layout) across the enabled tiers. Thread-safe
    (one lock; restores run under it)."""

    def __init__(self, layout: KVLayout, namespace: Namespace, config: SharedConfig) -> None:
        self.layout, self.namespace, self.config = layout, namespace, config
        self.bytes_per_block = bpb = layout.bytes_per_block
        row_bytes = config.row_bytes or layout.num_kv_heads * layout.head_dim * layout.dtype_bytes
        if bpb % row_bytes:
            raise ConfigError("shared.row_bytes", row_bytes, f"must divide bytes_per_block={bpb}")
        self._specs = {
            tier: DiffSpec(layout.dtype, row_bytes, config.diff_mode, config.error_bound_abs,  # type: ignore[arg-type]
                           config.ssd_zstd_level if tier == "ssd" else config.dram_zstd_level)
            for tier in ("hbm", "dram", "ssd")
        }
        caps = {t: getattr(config, f"{t}_blocks") for t in ("hbm", "dram", "ssd") if getattr(config, f"{t}_blocks")}
        self.index = SharedIndex(caps, {t: getattr(config, f"{t}_diff_bytes") for t in caps})
        self._pools: dict[str, TensorPool] = {}
        self._values: dict[str, DiffValues] = {}
        self._ssd = None
        if config.hbm_blocks:
            self._pools["hbm"] = TensorPool(config.hbm_blocks, bpb, resolve_device(config.hbm_device))
            self._values["hbm"] = MemoryDiffValues()
        if config.dram_blocks:
            self._pools["dram"] = TensorPool(config.dram_blocks, bpb, torch.device("cpu"))
            self._values["dram"] = MemoryDiffValues()
        if config.ssd_blocks:
            from ..tiers.ssd import SSDTier

            assert config.ssd_path is not None
            self._ssd = SSDTier(os.path.join(config.ssd_path, "masters"), namespace, layout,
                                map_size_bytes=config.ssd_map_size_bytes, codec="auto", sync=False)
            self._values["ssd"] = LmdbDiffValues(os.path.join(config.ssd_path, "diffs"), config.ssd_map_size_bytes)
        self._lock = threading.RLock()
        self.counters: Counter[str] = Counter()

    # ------------------------------------------------------------------ put

    def put_segment(self, agent: AgentId, seg: SegmentKey, blocks: Sequence[object], tier: str = "dram"
                    ) -> PutResult | None:
        """Store ``agent``'s copy of segment ``seg`` (``blocks``: one ``bytes_per_block``
        buffer per block, in segment order).

        The first copy becomes the master in ``tier``; a later copy (any agent,
        any offset) becomes a mirror in the master's tier, diffed against the
        master — never against another mirror. Returns ``None`` when the tier
        has no room (master slots or diff budget); raises ``ProtocolError`` if
        ``agent`` already holds ``seg`` and ``ValueError`` for a wrong block count.
        """
        srcs = [self._check_block(b, i) for i, b in enumerate(blocks)]
        with self._lock:
            info = self.index.info(seg)
            if info is None:
                return self._put_master(agent, seg, srcs, tier)
            if info.num_blocks != len(srcs):
                raise ValueError(f"segment {seg:#x} has {info.num_blocks} blocks; got {len(srcs)}")
            if self.index.role(seg, agent) is not None:
                raise ProtocolError(f"agent {agent!r} already holds segment {seg:#x}; release it first")
            master = self._read_master(seg)
            if master is None:
                return None
            value = encode_diff(master.numpy(), torch.stack(srcs).numpy(), self._specs[info.tier])
            rows = decode_diff(value, master.numel())
            assert rows is not None
            num_diff_blocks = _num_diff_blocks(rows, self.bytes_per_block)
            if not self.index.add_mirror(seg, agent, num_diff_blocks, len(value)):
                self.counters["mirror_refused"] += 1
                return None
            if not self._values[info.tier].put(diff_key(seg, agent), value):
                self.index.release(seg, agent)
                return None
            self.counters["mirrors_stored"] += 1
            return PutResult("mirror", info.tier, info.num_blocks, num_diff_blocks, rows.num_rows, len(value))

    def _put_master(self, agent: AgentId, seg: SegmentKey, srcs: list[torch.Tensor], tier: str) -> PutResult | None:
        slots = self.index.add_master(seg, agent, tier, len(srcs))
        if slots is None:
            self.counters["master_refused"] += 1
            return None
        if tier == "ssd":
            keys = segment_block_keys(self.namespace, seg, len(srcs))
            items = [(k, s.numpy(), None) for k, s in zip(keys, srcs)]
            if self._live_ssd().put_many(items) != len(items):
                self.index.release(seg, agent)
                return None
        else:
            self._pools[tier].write(slots, srcs)
        self.counters["masters_stored"] += 1
        n = len(srcs)
        return PutResult("master", tier, n, n, 0, n * self.bytes_per_block)

    # ------------------------------------------------------------------ restore

    def restore_round(self, requests: Sequence[RestoreRequest], dst: torch.Tensor,
                      mode: RestoreMode = "fused", staging: torch.Tensor | None = None) -> list[bool]:
        """Collective restore: rebuild every requested (agent, segment) into ``dst``
        (uint8 ``[num_slots, bytes_per_block]``) at its ``dst_slots``, all in one batch.

        ``fused`` (default) copies masters straight into ``dst`` and patches the
        differing rows in place; ``dense`` rebuilds each block in ``staging``
        first (the reconstruct-then-copy baseline; ``staging`` is allocated when
        not given; ``[2 * blocks, bytes_per_block]``). Returns one bool per request: ``False`` is a miss (no copy,
        a diff or SSD master that does not verify); its slots then hold
        unspecified bytes. Destination slots must be distinct across requests.
        """
        if dst.dtype != torch.uint8 or dst.dim() != 2 or dst.shape[1] != self.bytes_per_block:
            raise ValueError(f"restore: dst must be uint8 [num_slots, {self.bytes_per_block}]")
        with self._lock:
            plan = self._plan_restore(requests)
            try:
                return self._run_restore(plan, requests, dst, mode, staging)
            finally:
                for req, ok in zip(requests, plan.pinned):
                    if ok:
                        self.index.unpin_reader(req.segment)

    def _plan_restore(self, requests: Sequence[RestoreRequest]) -> _RestorePlan:
        plan = _RestorePlan()
        seen: set[int] = set()
        for i, req in enumerate(requests):
            info = self.index.info(req.segment)
            role = self.index.role(req.segment, req.agent)
            if info is None or role is None or len(req.dst_slots) != info.num_blocks:
                if info is not None and role is not None:
                    raise ValueError(f"restore of {req.segment:#x}: {len(req.dst_slots)} slots for "
                                     f"{info.num_blocks} blocks")
                plan.pinned.append(False)
                plan.ok.append(False)
                continue
            if seen & set(req.dst_slots):
                raise ValueError("restore: destination slots overlap between requests")
            seen |= set(req.dst_slots)
            rows = None
            if role == "mirror":
                value = self._values[info.tier].get(diff_key(req.segment, req.agent))
                rows = decode_diff(value, info.num_blocks * self.bytes_per_block) if value is not None else None
                if rows is None:
                    self.counters["corrupt_diffs"] += 1
                    plan.pinned.append(False)
                    plan.ok.append(False)
                    continue
            self.index.pin_reader(req.segment)
            self.index.touch(req.segment)
            plan.pinned.append(True)
            plan.ok.append(True)
            if rows is not None:
                plan.patches.append(Patch(rows, req.dst_slots))
                plan.patch_request.append(i)
            if info.tier == "ssd":
                plan.ssd.append(i)
            else:
                pool = self._pools[info.tier]
                plan.dst_slots.extend(req.dst_slots)
                plan.srcs.extend(pool.view(s) for s in info.slots)
        return plan

    def _run_restore(self, plan: _RestorePlan, requests: Sequence[RestoreRequest], dst: torch.Tensor,
                     mode: RestoreMode, staging: torch.Tensor | None) -> list[bool]:
        ok = list(plan.ok)
        for i in plan.ssd:  # SSD masters decode (and verify) straight into their destination slots
            req = requests[i]
            keys = segment_block_keys(self.namespace, req.segment, len(req.dst_slots))
            if not all(self._live_ssd().get_many_into(keys, [dst[s].numpy() for s in req.dst_slots])):
                ok[i] = False
        patches = [p for p, i in zip(plan.patches, plan.patch_request) if ok[i]]
        if mode == "fused":
            fused_restore(dst, plan.dst_slots, plan.srcs, patches, self.bytes_per_block)
        elif mode == "dense":
            n = len(plan.dst_slots) + sum(len(requests[i].dst_slots) for i in plan.ssd)
            if staging is None or staging.shape[0] < 2 * n:
                staging = torch.empty(2 * n, self.bytes_per_block, dtype=torch.uint8)
            ssd_slots = [s for i in plan.ssd if ok[i] for s in requests[i].dst_slots]
            dense_restore(dst, [*plan.dst_slots, *ssd_slots], [*plan.srcs, *(dst[s] for s in ssd_slots)],
                          patches, self.bytes_per_block, staging)
        else:
            raise ConfigError("shared.restore_mode", mode, "valid: ['fused', 'dense']")
        if self.config.verify_output:
            for p, i in zip(plan.patches, plan.patch_request):
                if ok[i] and _checksum_slots(dst, p.dst_slots) != p.rows.header.target_checksum:
                    self.counters["restore_checksum_failures"] += 1
                    ok[i] = False
        self.counters["restores"] += sum(ok)
        self.counters["restore_misses"] += len(ok) - sum(ok)
        return ok

    # ------------------------------------------------------------------ release, evict, move

    def release(self, agent: AgentId, seg: SegmentKey) -> None:
        """``agent`` no longer needs its copy of ``seg``. A master stays alive while
        mirrors reference it (ref count); the segment's bytes go when none remain."""
        with self._lock:
            info = self.index.info(seg)
            if info is None:
                raise ProtocolError(f"segment {seg:#x} is not stored")
            result = self.index.release(seg, agent)
            self._forget(seg, info.tier, result.dropped_mirrors, result.freed, info.num_blocks)

    def evict_master(self, seg: SegmentKey, rebase: bool = True, prefer: AgentId | None = None) -> EvictResult:
        """Evict ``seg``'s master. With ``rebase`` and live mirrors, one mirror
        (``prefer`` if it is one, else the first stored) is promoted: its blocks
        are rebuilt and written over the master's, every other mirror is rebuilt
        from the old master and re-diffed against the new one (so no mirror ever
        references a mirror), and the old owner loses its copy. Otherwise the
        master and all its mirrors are dropped. A mirror whose diff does not
        verify is dropped. Never leaves a mirror without its master."""
        with self._lock:
            info = self.index.info(seg)
            if info is None:
                raise ProtocolError(f"segment {seg:#x} is not stored")
            old_owner = (info.owner,) if info.owner is not None else ()
            agents = [m.agent for m in info.mirrors]
            if not rebase or not agents:
                result = self.index.drop(seg)
                self._forget(seg, info.tier, result.dropped_mirrors, result.freed, info.num_blocks)
                return EvictResult(None, (), (*old_owner, *result.dropped_mirrors))
            master = self._read_master(seg)
            rebuilt = {a: self._rebuild(seg, a, master) for a in agents} if master is not None else {}
            alive = [a for a in agents if rebuilt.get(a) is not None]
            if not alive:
                result = self.index.drop(seg)
                self._forget(seg, info.tier, result.dropped_mirrors, result.freed, info.num_blocks)
                return EvictResult(None, (), (*old_owner, *result.dropped_mirrors))
            new = prefer if prefer in alive else alive[0]
            new_master = rebuilt[new]
            assert new_master is not None
            spec, values = self._specs[info.tier], self._values[info.tier]
            rediffed: dict[AgentId, MirrorInfo] = {}
            for a in alive:
                if a == new:
                    continue
                value = encode_diff(new_master.numpy(), rebuilt[a].numpy(), spec)  # type: ignore[union-attr]
                rows = decode_diff(value, new_master.numel())
                assert rows is not None
                values.put(diff_key(seg, a), value)
                rediffed[a] = MirrorInfo(a, _num_diff_blocks(rows, self.bytes_per_block), len(value))
            self._write_master(seg, info.tier, info.slots, new_master.view(info.num_blocks, -1))
            for a in (new, *(a for a in agents if a not in rediffed)):
                values.delete(diff_key(seg, a))
            self.index.promote(seg, new, rediffed)
            self.counters["rebases"] += 1
            dropped = tuple(a for a in agents if a != new and a not in rediffed)
            return EvictResult(new, tuple(rediffed), (*old_owner, *dropped))

    def move_segment(self, seg: SegmentKey, dst_tier: str) -> bool:
        """Move ``seg`` (master blocks and every mirror's diff) to ``dst_tier``; diffs are
        re-compressed at that tier's zstd level (higher on SSD). ``False`` when
        ``dst_tier`` has no room or the master does not verify; nothing changes then."""
        with self._lock:
            info = self.index.info(seg)
            if info is None:
                raise ProtocolError(f"segment {seg:#x} is not stored")
            master = self._read_master(seg)
            slots = self.index.prepare_move(seg, dst_tier) if master is not None else None
            if slots is None or master is None:
                return False
            src_values, dst_values = self._values[info.tier], self._values[dst_tier]
            sizes: dict[AgentId, int] = {}
            moved: list[bytes] = []
            ok = self._write_master(seg, dst_tier, slots, master.view(info.num_blocks, -1))
            for m in info.mirrors if ok else ():
                key = diff_key(seg, m.agent)
                value = src_values.get(key)
                value = recompress(value, self._specs[dst_tier].zstd_level) if value is not None else None
                if value is None or not dst_values.put(key, value):
                    ok = False
                    break
                moved.append(key)
                sizes[m.agent] = len(value)
            if not ok:
                for key in moved:
                    dst_values.delete(key)
                self._delete_master(seg, dst_tier, info.num_blocks)
                self.index.complete_move(seg, dst_tier, slots, False)
                return False
            for key in moved:
                src_values.delete(key)
            self._delete_master(seg, info.tier, info.num_blocks)
            self.index.complete_move(seg, dst_tier, slots, True, sizes)
            return True

    # ------------------------------------------------------------------ queries

    def stored_bytes(self) -> dict[str, int]:
        """``{"master_bytes": ..., "diff_bytes": ...}`` over every tier."""
        with self._lock:
            master = sum(self.index.used_blocks(t) for t in self.index.tier_names) * self.bytes_per_block
            diff = sum(self.index.used_diff_bytes(t) for t in self.index.tier_names)
            return {"master_bytes": master, "diff_bytes": diff}

    def check_invariants(self) -> None:
        """Index invariants, plus: every mirror has a diff value in its segment's tier."""
        with self._lock:
            self.index.check_invariants()
            for seg in self.index.segments():
                info = self.index.info(seg)
                assert info is not None
                for m in info.mirrors:
                    assert self._values[info.tier].get(diff_key(seg, m.agent)) is not None, "mirror without diff"

    def close(self) -> None:
        with self._lock:
            for values in self._values.values():
                values.close()
            if self._ssd is not None:
                self._ssd.close()

    def __enter__(self) -> SharedStore:  # noqa: PYI034 - matches TieredStore
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals

    def _check_block(self, buf: object, i: int) -> torch.Tensor:
        t = as_byte_tensor(buf)
        if t.numel() != self.bytes_per_block:
            raise ValueError(f"block {i} has {t.numel()} bytes; layout {self.layout.describe()} needs "
                             f"{self.bytes_per_block}")
        return t.cpu()

    def _live_ssd(self):
        if self._ssd is None:
            raise ConfigError("shared.ssd_blocks", 0, "the ssd tier is disabled")
        return self._ssd

    def _read_master(self, seg: SegmentKey) -> torch.Tensor | None:
        """The master's bytes as one uint8 tensor (a copy), or ``None`` if an SSD block fails."""
        info = self.index.info(seg)
        assert info is not None
        out = torch.empty(info.num_blocks, self.bytes_per_block, dtype=torch.uint8)
        if info.tier == "ssd":
            keys = segment_block_keys(self.namespace, seg, info.num_blocks)
            if not all(self._live_ssd().get_many_into(keys, [row.numpy() for row in out])):
                self.counters["corrupt_masters"] += 1
                return None
        else:
            self._pools[info.tier].read(info.slots, list(out))
        return out.view(-1)

    def _write_master(self, seg: SegmentKey, tier: str, slots: tuple[int, ...], blocks: torch.Tensor) -> bool:
        if tier == "ssd":
            keys = segment_block_keys(self.namespace, seg, blocks.shape[0])
            return self._live_ssd().put_many([(k, b.numpy(), None) for k, b in zip(keys, blocks)]) == len(keys)
        return all(self._pools[tier].write(slots, list(blocks)))

    def _delete_master(self, seg: SegmentKey, tier: str, num_blocks: int) -> None:
        if tier == "ssd":
            self._live_ssd().delete_many(segment_block_keys(self.namespace, seg, num_blocks))

    def _rebuild(self, seg: SegmentKey, agent: AgentId, master: torch.Tensor) -> torch.Tensor | None:
        """``agent``'s mirror bytes rebuilt from ``master`` (flat uint8), or ``None`` if its diff is bad."""
        info = self.index.info(seg)
        assert info is not None
        value = self._values[info.tier].get(diff_key(seg, agent))
        rows = decode_diff(value, master.numel()) if value is not None else None
        if rows is None:
            self.counters["corrupt_diffs"] += 1
            return None
        out = master.clone().view(info.num_blocks, -1)
        fused_restore(out, (), (), [Patch(rows, tuple(range(info.num_blocks)))], self.bytes_per_block)
        return out.view(-1)

    def _forget(self, seg: SegmentKey, tier: str, dropped: Sequence[AgentId], freed: bool, num_blocks: int) -> None:
        """Delete the bytes the index just let go: dropped mirrors' diffs, and the
        master's SSD values when the whole segment was freed (pool slots need nothing)."""
        for agent in dropped:
            self._values[tier].delete(diff_key(seg, agent))
        if freed:
            self._delete_master(seg, tier, num_blocks)


@dataclass(slots=True)
class _RestorePlan:
    """What one collective restore reads: per request ``ok`` / ``pinned``; pool
    masters as (``dst_slots``, ``srcs``) pairs; decoded ``patches`` and the request
    each belongs to; requests whose master is on SSD."""

    ok: list[bool] = field(default_factory=list)
    pinned: list[bool] = field(default_factory=list)
    dst_slots: list[int] = field(default_factory=list)
    srcs: list[torch.Tensor] = field(default_factory=list)
    patches: list[Patch] = field(default_factory=list)
    patch_request: list[int] = field(default_factory=list)
    ssd: list[int] = field(default_factory=list)


def _num_diff_blocks(rows: DiffRows, bytes_per_block: int) -> int:
    rpb = bytes_per_block // rows.header.row_bytes
    return int(np.unique(np.concatenate([rows.exact_rows, rows.lossy_rows]) // rpb).size)


def _checksum_slots(dst: torch.Tensor, slots: Sequence[int]) -> int:
    h = xxhash.xxh3_64()
    for s in slots:
        h.update(dst[s].cpu().numpy())
    return h.intdigest()
