"""Byte movers keyed by (source medium, destination medium): the copies of the data plane.

Owns: how the blocks of one transfer are copied between two media -- a tensor
pool (``hbm`` / ``dram``), the SSD tier, the remote tier, a caller's buffers --
one function per pair, each returning one ``ok`` per block, and the rules a copy
keeps whoever calls it: a value decoded from a lossy one is never written again
(:class:`~kvtier.tiers.lossy.LossyCopies`), a device tensor reaches a host-only
medium through a host copy, a remote read counts only its leading verified run.
Must not decide what moves or where (the manager's plans and the policies do),
complete a plan or take a lock (the caller does, around these), or import an
engine. :class:`~kvtier.store.TieredStore` moves its bytes through these; the vLLM
worker's gather and scatter are engine-specific and stay in the connector.
"""

from __future__ import annotations

import functools
from collections import Counter
from typing import Any, Callable, Sequence

import torch

from ..keys import BlockKey
from ..tiers.lossy import LossyCopies
from ..layout import KVLayout
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
                lossy: LossyCopies) -> Copy:
    """SSD values verified into a pool's slots (through host staging for a device pool); the
    copies of lossy values are noted as decoded."""
    def run() -> Sequence[bool]:
        lossy.decoded(keys, ["ssd"] * len(keys))
        if pool.device.type == "cpu":
            return ssd.get_many_into(keys, pool.host_buffers(slots))
        staging = [torch.empty(pool.bytes_per_block, dtype=torch.uint8) for _ in keys]
        oks = ssd.get_many_into(keys, [b.numpy() for b in staging])
        pool.write(slots, staging)
        return oks

    return run
