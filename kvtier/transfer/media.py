"""Byte movers keyed by (source medium, destination medium): the copies of the data plane.

Owns: how the blocks of one transfer are copied between two media -- a tensor
pool (``hbm`` / ``dram``), the SSD tier, the remote tier, a caller's buffers,
rows of a host staging buffer -- one function per pair, each returning one
``ok`` per block, and the rules a copy keeps whoever calls it: a value decoded
from a lossy one is never written again (:class:`~kvtier.tiers.lossy.LossyCopies`),
a device tensor reaches a host-only medium through a host copy, a remote read
counts only its leading verified run, a slow tier's write succeeds for its
leading run written. Must not decide what moves or where (the manager's plans
and the policies do), complete a plan or take a lock (the caller does, around
these), or import an engine.

Both callers of the data plane move their bytes through these, on
:class:`~kvtier.transfer.mover.TransferEngine`: :class:`~kvtier.store.TieredStore`
(caller buffers and pools), and the vLLM connector's worker (staging rows: its
gather from and scatter into the engine's KV cache are engine-specific and stay
in the connector). The staging-row movers run on the worker's background
threads, so they use numpy and the tiers' own readers, never torch, which would
start an OpenMP team beside a CPU engine's forward.
"""

from __future__ import annotations

import functools
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Sequence

import numpy as np
import torch

from ..keys import BlockKey
from ..tiers.lossy import LossyCopies
from ..layout import KVLayout
from ..tiers.codec import copy_many
from ..tiers.pool import TensorPool, as_byte_tensor, as_byte_tensors, host_buffers

Copy = Callable[[], Sequence[bool]]
"""A copy ready to run (on a mover thread or inline): one ``ok`` per block."""


def caller_blocks(bufs: Sequence[Any], layout: KVLayout) -> list[torch.Tensor]:
    """The caller's buffers (tensors, ndarrays, bytes) as byte tensors of one block each;
    ``ValueError`` naming the first of another size. The checks run as C-speed loops:
    this runs once per block of every put and get."""
    ts = as_byte_tensors(bufs, layout.bytes_per_block)
    if ts is not None:
        return ts
    for i, buf in enumerate(bufs):  # name the first of the wrong size
        n = as_byte_tensor(buf).numel()
        if n != layout.bytes_per_block:
            raise ValueError(f"block {i} has {n} bytes; the layout ({layout.describe()}) needs "
                             f"{layout.bytes_per_block}")
    raise AssertionError("as_byte_tensors refused buffers of the layout's size")


def host_buffer(t: torch.Tensor) -> Any:
    """A buffer-protocol view of a tensor's bytes (copied to the host if on a device)."""
    if t.device.type != "cpu":
        t = t.cpu()
    return t.numpy()


def _host_views(ts: Sequence[torch.Tensor], nbytes: int) -> list[Any]:
    bufs = host_buffers(ts, nbytes)
    return bufs if bufs is not None else list(map(host_buffer, ts))


# ------------------------------------------------------------------ caller -> medium

def caller_to_pool(pool: TensorPool, slots: Sequence[int], srcs: list[torch.Tensor]) -> Copy:
    """The caller's ``srcs`` into ``pool``'s ``slots`` (a C-level partial: it runs once per put)."""
    return functools.partial(pool.write, slots, srcs)


def caller_to_ssd(ssd: Any, keys: Sequence[BlockKey], srcs: list[torch.Tensor],
                  parents: Sequence[BlockKey | None], nbytes: int) -> Copy:
    """The caller's ``srcs`` written to the SSD tier under ``keys`` (the leading run written is ok)."""
    def run() -> Sequence[bool]:  # srcs, held here, keep the buffers' tensors alive
        bufs = _host_views(srcs, nbytes)
        n = ssd.put_many(list(zip(keys, bufs, parents)))
        return [i < n for i in range(len(bufs))]

    return run


def caller_to_remote(remote: Any, keys: Sequence[BlockKey], srcs: list[torch.Tensor], parent: BlockKey | None,
                     counters: Counter[str]) -> Copy:
    """The caller's ``srcs`` written through to the remote tier (a failure is counted, never raised)."""
    def run() -> Sequence[bool]:
        chain = [parent, *keys[:-1]]
        n = remote.put_many([(k, host_buffer(t), p) for k, t, p in zip(keys, srcs, chain)])
        counters["remote_put_blocks"] += n
        counters["remote_put_failed_blocks"] += len(keys) - n
        return [i < n for i in range(len(keys))]

    return run


# ------------------------------------------------------------------ medium -> caller

def pool_to_caller(pool: TensorPool, slots: Sequence[int], dsts: list[torch.Tensor]) -> list[bool]:
    return list(map(bool, pool.read(slots, dsts)))


def ssd_to_caller(ssd: Any, keys: Sequence[BlockKey], dsts: list[torch.Tensor], nbytes: int) -> list[bool]:
    """SSD values of ``keys`` verified into the caller's ``dsts`` (through host copies for device tensors)."""
    bufs = host_buffers(dsts, nbytes)  # the caller holds dsts until we return
    if bufs is not None:
        return list(map(bool, ssd.get_many_into(keys, bufs)))
    hosts = [d if d.is_cpu else torch.empty_like(d, device="cpu") for d in dsts]
    res = ssd.get_many_into(keys, [h.numpy() for h in hosts])
    for host, dst in zip(hosts, dsts):
        if host is not dst:
            dst.copy_(host)
    return list(map(bool, res))


def remote_to_caller(remote: Any, keys: Sequence[BlockKey], dsts: list[torch.Tensor], nbytes: int) -> Copy:
    """Remote values of ``keys`` verified into ``dsts``; a block after a failed one is not copied."""
    def run() -> Sequence[bool]:
        bufs = host_buffers(dsts, nbytes)
        if bufs is not None:
            return remote.get_many_into(list(keys), bufs)
        hosts = [torch.empty(nbytes, dtype=torch.uint8) for _ in dsts]
        oks = remote.get_many_into(list(keys), [h.numpy() for h in hosts])
        n = oks.index(False) if False in oks else len(oks)
        for host, dst in zip(hosts[:n], dsts[:n]):
            dst.copy_(host)
        return oks

    return run


# ------------------------------------------------------------------ medium -> medium

def pool_to_pool(src: TensorPool, src_slots: Sequence[int], dst: TensorPool, dst_slots: Sequence[int]) -> Copy:
    return lambda: dst.write(dst_slots, [src.view(s) for s in src_slots])


def pool_to_ssd(pool: TensorPool, slots: Sequence[int], ssd: Any, keys: Sequence[BlockKey],
                parents: Sequence[BlockKey | None], lossy: LossyCopies, counters: Counter[str]) -> Copy:
    """A pool's blocks written down to SSD; a copy decoded from a lossy value is not
    (``demote_skipped_lossy_blocks``) and fails, so it stays where it is."""
    def run() -> Sequence[bool]:
        bufs = (pool.host_buffers(slots) if pool.device.type == "cpu"
                else [host_buffer(pool.view(s)) for s in slots])
        exact = lossy.storable(keys)
        items = [item for item, ok in zip(zip(keys, bufs, parents), exact) if ok]
        n = ssd.put_many(items) if items else 0
        if len(items) < len(exact):
            counters["demote_skipped_lossy_blocks"] += len(exact) - len(items)
        written = iter([i < n for i in range(len(items))])
        return [next(written) if ok else False for ok in exact]

    return run


def ssd_to_pool(ssd: Any, keys: Sequence[BlockKey], pool: TensorPool, slots: Sequence[int],
                lossy: LossyCopies | None) -> Copy:
    """SSD values verified into a pool's slots (through host staging for a device pool); the
    copies of lossy values are noted as decoded (``lossy`` ``None``: the caller notes them,
    as the connector's scheduler does for its worker)."""
    def run() -> Sequence[bool]:
        if lossy is not None:
            lossy.decoded(keys, ["ssd"] * len(keys))
        if pool.device.type == "cpu":
            return ssd.get_many_into(keys, pool.host_buffers(slots))
        staging = [torch.empty(pool.bytes_per_block, dtype=torch.uint8) for _ in keys]
        oks = ssd.get_many_into(keys, [b.numpy() for b in staging])
        pool.write(slots, staging)
        return oks

    return run


# ------------------------------------------------------------------ staging rows <-> medium
# A staging run is a ``[n, bytes_per_block]`` uint8 host array; ``positions`` are its rows.

def staging_to_pool(pool_rows: np.ndarray, slots: Sequence[int], staging: np.ndarray, positions: Sequence[int],
                    helper: ThreadPoolExecutor | None = None, threads: int = 1) -> list[bool]:
    """Staging rows ``positions`` into the slots of a host pool (``pool_rows``: its
    ``[slots, bytes_per_block]`` array); one copy per block, split over ``threads``."""
    copy_rows(pool_rows, slots, staging, positions, helper, threads)
    return [True] * len(slots)


def pool_to_staging(pool_rows: np.ndarray, slots: Sequence[int], staging: np.ndarray, positions: Sequence[int],
                    helper: ThreadPoolExecutor | None = None, threads: int = 1) -> list[bool]:
    """A host pool's ``slots`` into staging rows ``positions``."""
    copy_rows(staging, positions, pool_rows, slots, helper, threads)
    return [True] * len(slots)


def slow_to_staging(tier: Any, keys: Sequence[BlockKey], staging: np.ndarray, positions: Sequence[int]) -> list[bool]:
    """The SSD or remote tier's values of ``keys``, verified, into staging rows ``positions``."""
    return list(map(bool, tier.get_many_into(list(keys), [staging[i] for i in positions])))


def staging_to_slow(tier: Any, items: Sequence[tuple[BlockKey, Any, BlockKey | None]], codec: str | None = None,
                    pin_ttl_s: float | None = None, between: Callable[[], None] | None = None) -> list[bool]:
    """``(key, row, parent)`` items written to the SSD or remote tier (with a per-write
    codec, a soft pin on the remote tier, and ``between`` called between the SSD tier's
    write groups); the leading run written is ok."""
    kwargs: dict[str, Any] = {"codec": codec} if codec else {}
    if pin_ttl_s:
        kwargs["pin_ttl_s"] = pin_ttl_s
    if between is not None:
        kwargs["between"] = between
    n = tier.put_many(items, **kwargs)
    return [i < n for i in range(len(items))]


def copy_rows(dst: np.ndarray, dst_rows: Sequence[int], src: np.ndarray, src_rows: Sequence[int],
              helper: ThreadPoolExecutor | None = None, threads: int = 1) -> None:
    """``dst[dst_rows[i]] = src[src_rows[i]]``, one copy per block: a slice copy per
    run of adjacent rows on both sides (a fresh chain's usually are one run). Fancy
    indexing (``dst[a] = src[b]``) would copy every byte twice, through a temporary.
    A copy of ``SPLIT_COPY_MIN_BYTES`` or more is split into ``threads`` parts, all
    but one on the ``helper`` pool (numpy lets go of the GIL while it copies)."""
    runs = _runs(dst_rows, src_rows)
    if helper is None or threads < 2 or len(dst_rows) * dst.shape[1] < SPLIT_COPY_MIN_BYTES:
        _copy_pairs([(dst[d : d + n], src[s : s + n]) for d, s, n in runs])
        return
    if threads == 2 and copy_many([dst[d : d + n] for d, _, n in runs], [src[s : s + n] for _, s, n in runs]):
        return  # split with the C copy's own second thread, which is awake when a burst of copies comes
    *others, mine = _split(dst, src, runs, len(dst_rows), threads)
    futures: list[Future[None]] = []
    try:
        for part in others:
            try:
                futures.append(helper.submit(_copy_pairs, part))
            except RuntimeError:  # the helper is shutting down: copy that part here
                _copy_pairs(part)
        _copy_pairs(mine)
    finally:
        for f in futures:
            f.result()  # every part is done (or its error raised) before the rows are used


# bench/connector_path.py on 2 cores, DRAM store / load vs memcpy, one run each on a quiet
# machine: with copies of 32 MiB or more split (the earlier bound, set on a busy day when
# 16 MiB copies gained nothing), 256 KiB blocks ran at 0.69x / 0.57x and 1 MiB at
# 0.61x / 0.53x (their 16-block jobs, 4 and 16 MiB, stayed on one thread); split from
# 2 MiB through the helper pool, 0.80-0.96x / 0.75-0.85x and 1.00-1.17x / 0.90-0.97x over
# 8 runs; through copy_many's awake thread (at copy_threads 2), 1.04-1.52x / 1.00-1.26x
# over 4 runs at every block size
SPLIT_COPY_MIN_BYTES = 2 << 20


def _runs(dst_rows: Sequence[int], src_rows: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(dst start, src start, length)`` of each maximal run adjacent on both sides."""
    runs: list[tuple[int, int, int]] = []
    for d, s in zip(dst_rows, src_rows):
        if runs and runs[-1][0] + runs[-1][2] == d and runs[-1][1] + runs[-1][2] == s:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((d, s, 1))
    return runs


def _split(dst: np.ndarray, src: np.ndarray, runs: list[tuple[int, int, int]], num_rows: int,
           k: int) -> list[list[tuple[np.ndarray, np.ndarray]]]:
    """The copy of ``runs`` as ``k`` lists of (dst view, src view) of about equal
    bytes: by rows, or by bytes when fewer rows than parts. Every view is a
    slice, never a copy, so writing it writes ``dst``."""
    if num_rows < k:  # cut each row's bytes instead
        cuts = [dst.shape[1] * i // k for i in range(k + 1)]
        return [[(dst[d + r][a:b], src[s + r][a:b]) for d, s, n in runs for r in range(n)]
                for a, b in zip(cuts, cuts[1:])]
    bounds = [num_rows * i // k for i in range(k + 1)]  # row offsets where each part starts
    parts: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in range(k)]
    offset = 0
    for d, s, n in runs:
        for p in range(k):  # the overlap of rows [offset, offset + n) with part p
            lo, hi = max(offset, bounds[p]), min(offset + n, bounds[p + 1])
            if lo < hi:
                parts[p].append((dst[d + lo - offset : d + hi - offset], src[s + lo - offset : s + hi - offset]))
        offset += n
    return parts


def _copy_pairs(pairs: list[tuple[np.ndarray, np.ndarray]]) -> None:
    for d, s in pairs:
        d[...] = s
