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
contiguous). Must not import vLLM, decide which blocks move, or do I/O.

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

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

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


class BlockIO:
    """Gather and scatter whole blocks of registered KV caches.

    ``kv_caches`` maps layer names to a tensor (``fused``) or a tuple of K and
    V tensors (``split``); all layers must use the same arrangement.
    """

    def __init__(self, kv_caches: Mapping[str, KVCache], num_blocks: int) -> None:
        if not kv_caches:
            raise ValueError("no KV caches registered")
        kinds = {isinstance(v, (tuple, list)) for v in kv_caches.values()}
        if len(kinds) != 1:
            raise ValueError("KV caches mix single tensors and (K, V) tuples across layers")
        self.arrangement = "split" if kinds.pop() else "fused"
        self.num_blocks = num_blocks
        parts: list[_Part] = []
        offset = 0
        for name, cache in kv_caches.items():
            tensors = list(cache) if isinstance(cache, (tuple, list)) else [cache]
            for t in tensors:
                dim = _block_dim(t, num_blocks, name)
                nbytes = t.numel() // num_blocks * t.element_size()
                parts.append(_Part(t, dim, nbytes, offset))
                offset += nbytes
        self._parts = parts
        self.num_layers = len(kv_caches)
        self.bytes_per_block = offset
        self.device = parts[0].tensor.device

    def gather(self, block_ids: Sequence[int], out: torch.Tensor | None = None,
               non_blocking: bool = False) -> torch.Tensor:
        """Rows (``uint8 [len(block_ids), bytes_per_block]``, on the cache's device
        unless ``out`` is given) holding the bytes of ``block_ids``. Into host
        ``out`` the copies go layer by layer (no device buffer of all the rows),
        queued on the current stream when ``non_blocking`` (``out`` pinned)."""
        ids = torch.as_tensor(list(block_ids), dtype=torch.long, device=self.device)
        rows = out if out is not None else torch.empty(
            (len(block_ids), self.bytes_per_block), dtype=torch.uint8, device=self.device
        )
        for p in self._parts:
            blocks = p.tensor.index_select(p.block_dim, ids).movedim(p.block_dim, 0).contiguous()
            rows[:, p.offset : p.offset + p.nbytes].copy_(blocks.view(len(block_ids), -1).view(torch.uint8),
                                                          non_blocking=non_blocking)
        return rows

    def copy_out(self, block_ids: Sequence[int], out: torch.Tensor) -> Any:
        """Copy the bytes of ``block_ids`` into host rows ``out``; return an event
        to wait on before reading them (``None`` on the CPU, where they are
        ready at once).

        What the worker does for a store (``wait_for_save``, ``out`` a run of
        its staging ring) and what ``bench/gpu_datapath.py`` measures: per
        layer, a gather on the device and a copy into ``out`` queued on the
        engine's current stream (not blocking when ``out`` is pinned), then an
        event recorded after them.
        """
        self.gather(block_ids, out=out, non_blocking=out.is_pinned())
        return device_event(self.device)

    def scatter(self, block_ids: Sequence[int], rows: torch.Tensor) -> Any:
        """Write ``rows[i]`` (``bytes_per_block`` bytes each) into block ``block_ids[i]``;
        return an event after which ``rows`` may be reused (``None`` on the CPU:
        at once). From pinned host rows the copy to the device is queued on the
        current stream, so the engine's thread does not wait for it."""
        n = len(block_ids)
        if rows.shape != (n, self.bytes_per_block):
            raise ValueError(f"rows have shape {tuple(rows.shape)}, expected ({n}, {self.bytes_per_block})")
        ids = torch.as_tensor(list(block_ids), dtype=torch.long, device=self.device)
        rows = rows.to(self.device, non_blocking=rows.is_pinned())  # pinned host rows: queued, not waited for
        for p in self._parts:
            shape = list(p.tensor.shape)
            del shape[p.block_dim]
            chunk = rows[:, p.offset : p.offset + p.nbytes].contiguous().view(p.tensor.dtype)
            blocks = chunk.view(n, *shape).movedim(0, p.block_dim)
            p.tensor.index_copy_(p.block_dim, ids, blocks)
        return device_event(self.device)


def device_event(device: torch.device) -> Any:
    """An event recorded on the device's current stream (``None`` on the CPU)."""
    if device.type == "cuda":
        event = torch.cuda.Event()
        event.record()
        return event
    if device.type == "npu":  # pragma: no cover - needs Ascend hardware
        event = torch.npu.Event()  # type: ignore[attr-defined]
        event.record()
        return event
    return None
