"""Copy whole KV blocks between an engine's paged KV cache and flat byte rows.

Owns: finding the block dimension of each per-layer cache tensor and moving
the bytes of chosen blocks into / out of ``uint8`` rows of
``bytes_per_block`` bytes (the unit kvtier stores). Two arrangements:

* ``fused`` (vLLM): one tensor per layer, whatever its physical layout
  (``[num_blocks, heads, block_size, 2*head_dim]`` on the CPU backend,
  ``[2, num_blocks, ...]`` on older GPU backends): the block dimension is the
  one whose size is ``num_blocks``.
* ``split`` (vLLM-Ascend): a tuple ``(K, V)`` of tensors per layer, each
  ``[num_blocks, block_size, heads, head_dim]``.

A block's row is the concatenation, layer by layer in registration order, of
each tensor's slice at that block (block dimension moved to the front, made
contiguous). Layers of a hybrid model's KV cache groups (vLLM's hybrid KV
cache manager) alias the same tensors, a block id belonging to one group at
a time: a tensor registered again under another layer's name is one part, so
a block's row holds whichever group's layers own that block. Must not import vLLM, decide which blocks move, or do I/O.

Streams. On an accelerator the copies run on a stream of their own (torch's
device-agnostic ``torch.Stream``: CUDA, or an NPU through torch_npu), so they
overlap the engine's compute instead of queueing behind it. Events order them,
and the engine's thread never waits on the host: a store's copies start after
the engine's queued work (the forward that wrote the blocks) and return an
event that the worker's copy thread waits on before it reads the host rows; a
load's copies start after the engine's queued work (blocks just handed to a
request may still be read by it) and the engine's stream waits on their event
before its next kernel, so the next forward reads the loaded blocks. With
``side_stream=False``, or where the backend gives no stream, the copies queue
on the engine's current stream, as before. On the CPU there are no streams.

>>> import torch
>>> caches = {"l0": torch.arange(4 * 3 * 2, dtype=torch.float32).view(4, 3, 2)}
>>> io = BlockIO(caches, num_blocks=4)
>>> io.bytes_per_block, io.arrangement
(24, 'fused')
>>> rows = io.gather([2, 0])
>>> io.scatter([1], rows[:1]); caches["l0"][1].tolist() == caches["l0"][2].tolist()
True
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvtier.tiers.codec import copy_spans

log = logging.getLogger(__name__)

KVCache = torch.Tensor | tuple[torch.Tensor, ...] | list[torch.Tensor]


@dataclass(frozen=True, slots=True)
class _Part:
    """One cache tensor and where its blocks live."""

    tensor: torch.Tensor
    block_dim: int
    nbytes: int  # bytes of one block of this tensor
    offset: int  # where those bytes start in a block row


def _block_dim(t: torch.Tensor, num_blocks: int, name: str) -> int:
    if t.dim() >= 1 and t.shape[0] == num_blocks:
        return 0
    if t.dim() >= 2 and t.shape[0] == 2 and t.shape[1] == num_blocks:
        return 1
    dims = [d for d, size in enumerate(t.shape) if size == num_blocks]
    if len(dims) != 1:
        raise ValueError(
            f"KV cache of layer {name!r} has shape {tuple(t.shape)}: cannot find its block dimension "
            f"(num_blocks={num_blocks})"
        )
    return dims[0]


DEVICE_STAGING_BYTES = 64 << 20


class BlockIO:
    """Gather and scatter whole blocks of registered KV caches.

    ``kv_caches`` maps layer names to a tensor (``fused``) or a tuple of K and
    V tensors (``split``); all layers must use the same arrangement.
    ``side_stream``: copy on a stream of its own on an accelerator (see Streams).

    Device staging. Between an accelerator and host rows the bytes pass
    through one fixed device buffer of ``device_staging_bytes`` (rounded down
    to whole blocks, at least one), allocated here, so that every transfer
    over the link is one contiguous copy per chunk of blocks. A host row is
    block-major (all layers of one block) while a cache is layer-major, and a
    copy into or out of a column slice of pinned rows makes torch stage it
    through pageable memory, which waits on the host. Per chunk, kernels on
    the device gather the blocks' layers into the buffer (or spread them out
    of it), and one copy moves the chunk. The buffer is accelerator memory
    outside what vLLM profiles: keep it within the headroom that
    ``gpu_memory_utilization`` leaves. On the CPU (``chunked`` false by
    default) the copies go straight between the cache and the rows. Calls
    come from one thread (the engine's), and all copies of one ``BlockIO`` are
    queued on one stream, so the buffer is reused in order.
    """

    def __init__(self, kv_caches: Mapping[str, KVCache], num_blocks: int, side_stream: bool = True,
                 device_staging_bytes: int = DEVICE_STAGING_BYTES, chunked: bool | None = None) -> None:
        if not kv_caches:
            raise ValueError("no KV caches registered")
        kinds = {isinstance(v, (tuple, list)) for v in kv_caches.values()}
        if len(kinds) != 1:
            raise ValueError("KV caches mix single tensors and (K, V) tuples across layers")
        self.arrangement = "split" if kinds.pop() else "fused"
        self.num_blocks = num_blocks
        parts: list[_Part] = []
        offset = 0
        seen: set[tuple[Any, ...]] = set()
        for name, cache in kv_caches.items():
            tensors = list(cache) if isinstance(cache, (tuple, list)) else [cache]
            for t in tensors:
                view = (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)
                if view in seen:  # a layer of another KV cache group over the same bytes (hybrid models)
                    continue
                seen.add(view)
                dim = _block_dim(t, num_blocks, name)
                nbytes = t.numel() // num_blocks * t.element_size()
                parts.append(_Part(t, dim, nbytes, offset))
                offset += nbytes
        self.parts = parts  # per layer (and group): its tensor, block dimension, bytes a block and offset
        self.num_layers = len(kv_caches)
        self.bytes_per_block = offset
        self.device = parts[0].tensor.device
        self.stream: Any = make_side_stream(self.device) if side_stream else None
        chunked = self.device.type != "cpu" if chunked is None else chunked
        self.chunk_blocks = max(1, device_staging_bytes // offset)
        self._staging = (torch.empty((self.chunk_blocks, offset), dtype=torch.uint8, device=self.device)
                         if chunked else None)
        self._spans = _HostSpans.of(parts, num_blocks) if self.device.type == "cpu" else None

    @property
    def straight(self) -> bool:
        """Whether host copies take one pass (:class:`_HostSpans`): a CPU cache of contiguous
        tensors and kvtier's C module. Otherwise torch's gather / scatter (2-3 passes)."""
        return self._spans is not None

    def gather_rows(self, block_ids: Sequence[int], dst: np.ndarray, rows: Sequence[int], split: bool = False) -> None:
        """CPU caches: the bytes of ``block_ids[i]`` into ``dst[rows[i]]`` (``dst`` a host
        ``uint8 [R, bytes_per_block]`` array such as the DRAM pool's rows), in one pass
        where :attr:`straight`. ``split``: share a large copy with a second thread. The
        one-pass copy is C, not torch, so any thread may call it."""
        if self._spans is not None:
            self._spans.copy(block_ids, dst, rows, to_rows=True, split=split)
            return
        torch.from_numpy(dst)[torch.tensor(list(rows), dtype=torch.long)] = self.gather(block_ids)

    def scatter_rows(self, block_ids: Sequence[int], src: np.ndarray, rows: Sequence[int], split: bool = False) -> None:
        """CPU caches: ``src[rows[i]]`` into block ``block_ids[i]`` (one pass where :attr:`straight`)."""
        if self._spans is not None:
            self._spans.copy(block_ids, src, rows, to_rows=False, split=split)
            return
        self._scatter(block_ids, torch.from_numpy(src[list(rows)]))

    def landing(self, block_ids: Sequence[int]) -> tuple[list[np.ndarray], np.ndarray] | None:
        """CPU caches where :attr:`straight`: (the cache tensors as flat bytes, the table of
        where a row's bytes land in block ``block_ids[i]``), for a tier that copies a value
        straight into the engine's blocks (:meth:`kvtier.tiers.ssd.SSDTier.scatter_many`);
        ``None`` otherwise."""
        if self._spans is None:
            return None
        return self._spans.bufs, self._spans.landing(block_ids)

    @property
    def device_staging_bytes(self) -> int:
        """Bytes of the device staging buffer (0 on the straight, CPU path)."""
        return 0 if self._staging is None else self._staging.numel()

    def gather(self, block_ids: Sequence[int], out: torch.Tensor | None = None,
               non_blocking: bool = False) -> torch.Tensor:
        """Rows (``uint8 [len(block_ids), bytes_per_block]``, on the cache's device
        unless ``out`` is given) holding the bytes of ``block_ids``, copied on
        the current stream: chunk by chunk through the device staging buffer
        (never a device buffer of all the rows), not waited for when
        ``non_blocking`` (``out`` pinned)."""
        ids = self._ids(block_ids)
        n = len(block_ids)
        rows = out if out is not None else torch.empty((n, self.bytes_per_block), dtype=torch.uint8,
                                                       device=self.device)
        if self._staging is None:
            self._gather_into(rows, ids, non_blocking)
            return rows
        for i in range(0, n, self.chunk_blocks):
            m = min(self.chunk_blocks, n - i)
            self._gather_into(self._staging[:m], ids[i : i + m], False)
            rows[i : i + m].copy_(self._staging[:m], non_blocking=non_blocking)  # one contiguous copy
        return rows

    def copy_out(self, block_ids: Sequence[int], out: torch.Tensor, engine_waits: bool = False) -> Any:
        """Copy the bytes of ``block_ids`` into host rows ``out``; return an event
        to wait on before reading them (``None`` on the CPU, where they are
        ready at once).

        What the worker does for a store (``wait_for_save``, ``out`` a run of
        its staging ring) and what ``bench/gpu_datapath.py`` measures:
        :meth:`gather` into ``out`` (not blocking when ``out`` is pinned), on
        the side stream after the engine's queued work (or on the engine's
        stream), then an event recorded after it. ``engine_waits``: the engine's
        next work overwrites the blocks (a write-back before the forward), so on
        the side stream the engine's stream waits for the copy.
        """
        if self.stream is None:
            self.gather(block_ids, out=out, non_blocking=out.is_pinned())
            return device_event(self.device)
        engine = torch.accelerator.current_stream(self.device)
        self.stream.wait_stream(engine)  # the forward that wrote them
        with self.stream:
            self.gather(block_ids, out=out, non_blocking=out.is_pinned())
            done = self.stream.record_event()
        if engine_waits:
            engine.wait_event(done)
        return done

    def scatter(self, block_ids: Sequence[int], rows: torch.Tensor) -> Any:
        """Write ``rows[i]`` (``bytes_per_block`` bytes each) into block ``block_ids[i]``;
        return an event after which ``rows`` may be reused (``None`` on the CPU:
        at once). From pinned host rows the copy to the device is queued (on the
        side stream after the engine's queued work, the engine's stream then
        waiting for it; or on the engine's stream), so the engine's thread does
        not wait for it."""
        n = len(block_ids)
        if rows.shape != (n, self.bytes_per_block):
            raise ValueError(f"rows have shape {tuple(rows.shape)}, expected ({n}, {self.bytes_per_block})")
        if self.stream is None:
            self._scatter(block_ids, rows)
            return device_event(self.device)
        engine = torch.accelerator.current_stream(self.device)
        self.stream.wait_stream(engine)  # the engine's queued work may still read these blocks' old bytes
        with self.stream:
            self._scatter(block_ids, rows)
            done = self.stream.record_event()
        engine.wait_event(done)  # the next forward reads the loaded bytes
        return done

    def _scatter(self, block_ids: Sequence[int], rows: torch.Tensor) -> None:
        ids = self._ids(block_ids)
        pinned = rows.device.type == "cpu" and rows.is_pinned()
        if self._staging is None:
            self._scatter_from(rows.to(self.device, non_blocking=pinned), ids)
            return
        for i in range(0, len(block_ids), self.chunk_blocks):
            m = min(self.chunk_blocks, len(block_ids) - i)
            self._staging[:m].copy_(rows[i : i + m], non_blocking=pinned)  # one contiguous copy
            self._scatter_from(self._staging[:m], ids[i : i + m])

    def _gather_into(self, rows: torch.Tensor, ids: torch.Tensor, non_blocking: bool) -> None:
        """Each layer's bytes of blocks ``ids`` into its columns of ``rows``."""
        n = len(ids)
        if self._spans is not None and rows.device.type == "cpu" and rows.is_contiguous():
            self._spans.copy(ids.tolist(), rows.numpy(), range(n), to_rows=True, split=False)
            return
        for p in self.parts:
            blocks = p.tensor.index_select(p.block_dim, ids).movedim(p.block_dim, 0).contiguous()
            rows[:, p.offset : p.offset + p.nbytes].copy_(blocks.view(n, -1).view(torch.uint8),
                                                          non_blocking=non_blocking)

    def _scatter_from(self, rows: torch.Tensor, ids: torch.Tensor) -> None:
        """Each layer's columns of ``rows`` (on the cache's device) into blocks ``ids``."""
        n = len(ids)
        if self._spans is not None and rows.device.type == "cpu" and rows.is_contiguous():
            self._spans.copy(ids.tolist(), rows.numpy(), range(n), to_rows=False, split=False)
            return
        for p in self.parts:
            shape = list(p.tensor.shape)
            del shape[p.block_dim]
            chunk = rows[:, p.offset : p.offset + p.nbytes].contiguous().view(p.tensor.dtype)
            p.tensor.index_copy_(p.block_dim, ids, chunk.view(n, *shape).movedim(0, p.block_dim))

    def _ids(self, block_ids: Sequence[int]) -> torch.Tensor:
        """Block ids as a tensor on the cache's device; from pinned memory without a
        wait on the host (a plain copy from pageable memory would synchronize the
        stream, so the engine's thread would wait for its queued forward)."""
        ids = torch.tensor(list(block_ids), dtype=torch.long)
        if self.device.type == "cpu":
            return ids
        return ids.pin_memory().to(self.device, non_blocking=True)


class _HostSpans:
    """The one-pass host copy between CPU cache tensors and block rows.

    A block of a contiguous tensor whose block dimension is ``d`` is ``outer``
    (the product of the dimensions before ``d``: 1, or 2 for ``[2, num_blocks, ...]``)
    contiguous chunks of ``inner`` bytes; in a block row they follow each other at
    the part's offset. A copy is then a table of spans (one per chunk, block and
    layer), built with numpy for all layers of one chunk shape at once and run by
    :func:`kvtier.tiers.codec.copy_spans` in C with the GIL released: every byte
    crosses memory once, with no temporary (torch's ``index_select`` / ``movedim`` /
    ``index_copy_`` path took 2-3 passes). Built only for a CPU cache of contiguous
    tensors where the C module is present (:meth:`of` returns ``None`` otherwise).

    Right after a torch op, a copy shared with the second thread runs at about half
    speed on 2 cores: torch's OpenMP threads still spin and take the other core
    (measured: 0.5-0.7x memcpy, against 1.0-1.2x with ``OMP_WAIT_POLICY=PASSIVE``).
    Copying long runs with torch instead (its team shares the copy) measured no
    better: a strided copy into row columns ran at about 0.7x a contiguous one.
    """

    def __init__(self, parts: Sequence[_Part], bufs: list[np.ndarray],
                 groups: list[tuple[int, int, np.ndarray, np.ndarray]], num_blocks: int, row_bytes: int) -> None:
        self.parts = parts  # per layer (and group): its tensor, block dimension, bytes a block and offset
        self.bufs = bufs  # each part's tensor as flat bytes (views: they keep no copy)
        self.groups = groups  # (outer, inner bytes, part indices, their offsets in a row)
        self.num_blocks = num_blocks
        self.row_bytes = row_bytes

    @classmethod
    def of(cls, parts: Sequence[_Part], num_blocks: int) -> _HostSpans | None:
        if not all(p.tensor.is_contiguous() and p.tensor.device.type == "cpu" for p in parts):
            return None
        probe = np.zeros((1, 5), dtype=np.int64)
        if not copy_spans([bytearray(0)], [b""], probe, False):  # no C module: torch's path
            return None
        by_shape: dict[tuple[int, int], list[int]] = {}
        for i, p in enumerate(parts):
            shape = p.tensor.shape
            outer = int(np.prod(shape[:p.block_dim], dtype=np.int64))
            by_shape.setdefault((outer, p.nbytes // outer), []).append(i)
        groups = [(outer, inner, np.array(idx, dtype=np.int64), np.array([parts[i].offset for i in idx], dtype=np.int64))
                  for (outer, inner), idx in by_shape.items()]
        bufs = [p.tensor.reshape(-1).view(torch.uint8).numpy() for p in parts]
        return cls(parts, bufs, groups, num_blocks, sum(p.nbytes for p in parts))

    def copy(self, block_ids: Sequence[int], rows_buf: np.ndarray, rows: Sequence[int], *, to_rows: bool,
             split: bool) -> None:
        """Blocks ``block_ids`` into rows ``rows`` of ``rows_buf`` (``to_rows``) or back."""
        if rows_buf.ndim != 2 or rows_buf.shape[1] != self.row_bytes or not rows_buf.flags.c_contiguous:
            raise ValueError(f"rows have shape {rows_buf.shape} (C-contiguous: {rows_buf.flags.c_contiguous}), "
                             f"expected C-contiguous (*, {self.row_bytes})")
        ids = np.asarray(block_ids, dtype=np.int64)
        at = np.asarray(rows, dtype=np.int64)
        if len(ids) != len(at):
            raise ValueError(f"{len(ids)} blocks but {len(at)} rows")
        if not len(ids):
            return
        part, in_cache, in_rows, length = self._spans(ids, at)
        table = np.empty((len(part), 5), dtype=np.int64)
        table[:, 4] = length
        if to_rows:  # dst: the rows (buffer 0); src: the part's tensor
            table[:, 0], table[:, 1], table[:, 2], table[:, 3] = 0, in_rows, part, in_cache
        else:
            table[:, 0], table[:, 1], table[:, 2], table[:, 3] = part, in_cache, 0, in_rows
        flat = rows_buf.reshape(-1)
        if to_rows:
            copy_spans([flat], self.bufs, table, split)
        else:
            copy_spans(self.bufs, [flat], table, split)

    def landing(self, block_ids: Sequence[int]) -> np.ndarray:
        """Where the bytes of a row land when it is scattered into ``block_ids`` (row ``i`` into
        block ``block_ids[i]``): an ``int64 [m, 4]`` table of (row, part, offset in the part's
        tensor, length), grouped by row and, within a row, in row order, so a row's spans tile
        it from offset 0 (:func:`kvtier.tiers.codec.scatter_raw_batch`'s table, with the
        parts' tensors, :attr:`bufs`, as its buffers)."""
        ids = np.asarray(block_ids, dtype=np.int64)
        part, in_cache, in_rows, length = self._spans(ids, np.arange(len(ids), dtype=np.int64))
        order = np.argsort(in_rows, kind="stable")  # rows are laid out one after another: row, then row order
        length = length[order]
        order, length = order[length > 0], length[length > 0]  # (an empty part's span would name the next row)
        table = np.empty((len(order), 4), dtype=np.int64)
        table[:, 0] = in_rows[order] // self.row_bytes
        table[:, 1], table[:, 2], table[:, 3] = part[order], in_cache[order], length
        return table

    def _spans(self, ids: np.ndarray, at: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Every chunk of blocks ``ids`` and where it sits in rows ``at``: (part index, offset
        in the part's tensor, offset in the rows, length), one entry per chunk, block and layer."""
        parts, in_caches, in_rows, lengths = [], [], [], []
        for outer, inner, idx, offsets in self.groups:
            j = np.arange(outer, dtype=np.int64)[:, None]
            cache_off = ((j * self.num_blocks + ids) * inner).ravel()  # chunk j of each block
            row_off = (at * self.row_bytes + j * inner).ravel()
            parts.append(np.repeat(idx, cache_off.size))
            in_caches.append(np.tile(cache_off, len(idx)))
            in_rows.append((row_off[None, :] + offsets[:, None]).ravel())
            lengths.append(np.full(len(idx) * cache_off.size, inner, dtype=np.int64))
        return np.concatenate(parts), np.concatenate(in_caches), np.concatenate(in_rows), np.concatenate(lengths)


def device_event(device: torch.device) -> Any:
    """An event recorded on the device's current stream (``None`` on the CPU)."""
    if device.type == "cpu":
        return None
    return torch.accelerator.current_stream(device).record_event()


def make_side_stream(device: torch.device) -> Any:
    """A new stream on ``device`` for kvtier's copies; ``None`` on the CPU, or
    (logged) where the backend cannot make one: copies then use the engine's stream."""
    if device.type == "cpu":
        return None
    try:
        return torch.Stream(device=device)
    except (RuntimeError, TypeError, ValueError) as exc:  # pragma: no cover - a backend without streams
        log.warning("kvtier: no side stream on %s (%s); copies share the engine's stream", device, exc)
        return None
