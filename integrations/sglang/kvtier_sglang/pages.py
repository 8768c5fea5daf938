"""Host-pool pages as byte views: the zero-copy half of the SGLang backend.

Owns: turning an SGLang host KV pool (``MHATokenToKVPoolHost``,
``MLATokenToKVPoolHost`` or anything with the same attributes) into

* a :class:`~kvtier.layout.KVLayout` whose ``bytes_per_block`` is one page, and
* for given ``host_indices``, the byte regions of each page inside the pool's
  own ``kv_buffer`` (``get_page_buffer_meta`` pointers resolved to tensor
  views, bounds-checked; no raw-pointer writes).

A page's value is its regions concatenated in ascending address order. For
every layout SGLang has (``layer_first``, ``page_first``,
``page_first_direct``, ``page_head``) that is exactly the byte order of
``get_data_page(index, flat=True)``, so pages written by the zero-copy path and
by the generic path are interchangeable. A page made of one contiguous region
(MLA ``page_first``) is used in place; other pages are gathered into / scattered
from a staging block (one memcpy per region). Must not touch kvtier's tiers.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvtier.layout import DTYPE_TO_BYTES, KVLayout


@dataclass(frozen=True, slots=True)
class PoolGeometry:
    """What kvtier needs to know about a host pool: the page layout and the
    pool's memory layout name (part of the key namespace: pages of
    ``layer_first`` and ``page_first`` pools hold the same KV in different byte
    orders and must never match)."""

    layout: KVLayout
    pool_layout: str


def pool_geometry(pool: Any) -> PoolGeometry:
    """Layout of one page of ``pool``; raises ``ValueError`` naming the pool
    attribute that is missing or unsupported."""
    for attr in ("page_size", "layer_num", "dtype", "layout"):
        if not hasattr(pool, attr):
            raise ValueError(f"host pool {type(pool).__name__} has no attribute {attr!r}")
    dtype = str(pool.dtype).removeprefix("torch.")
    if dtype not in DTYPE_TO_BYTES:
        raise ValueError(f"host pool dtype {pool.dtype} is not supported; supported: {sorted(DTYPE_TO_BYTES)}")
    if hasattr(pool, "kv_lora_rank"):  # MLA: one latent per token and layer
        width = int(pool.kv_lora_rank) + int(getattr(pool, "qk_rope_head_dim", 0))
        layout = KVLayout(int(pool.layer_num), 1, width, dtype, int(pool.page_size), arrangement="mla")
    else:
        v_dim = getattr(pool, "v_head_dim", pool.head_dim)
        if v_dim != pool.head_dim:
            raise ValueError(
                f"host pool {type(pool).__name__}: head_dim={pool.head_dim} != v_head_dim={v_dim}; "
                "kvtier layouts need equal K and V widths"
            )
        layout = KVLayout(int(pool.layer_num), int(pool.head_num), int(pool.head_dim), dtype, int(pool.page_size))
    return PoolGeometry(layout, str(pool.layout))


class PagePointers:
    """Resolves ``get_page_buffer_meta`` pointers to views of the pool's tensors.

    Built once per pool (``register_mem_pool_host``); thread-safe afterwards
    (read-only). O(log buffers) per region.
    """

    def __init__(self, pool: Any, bytes_per_page: int) -> None:
        if not hasattr(pool, "get_page_buffer_meta"):
            raise ValueError(f"host pool {type(pool).__name__} has no get_page_buffer_meta(); the zero-copy "
                             "interface (extra_config interface_v1) needs it")
        buffers = pool.kv_buffer if isinstance(pool.kv_buffer, (list, tuple)) else [pool.kv_buffer]
        regions = []
        for buf in buffers:
            if not isinstance(buf, torch.Tensor) or buf.device.type != "cpu" or not buf.is_contiguous():
                raise ValueError("host pool kv_buffer must be contiguous CPU tensors for zero-copy page access")
            flat = buf.reshape(-1).view(torch.uint8)
            regions.append((flat.data_ptr(), flat))
        regions.sort(key=lambda r: r[0])
        self._starts = [r[0] for r in regions]
        self._views = [r[1] for r in regions]
        self._pool = pool
        self.bytes_per_page = bytes_per_page

    def pages(self, host_indices: Any, num_pages: int) -> list[list[torch.Tensor]]:
        """Per page, its regions (uint8 views into the pool), address-ordered and
        with adjacent regions merged. Raises ``ValueError`` when the pool's
        metadata does not describe ``num_pages`` pages of ``bytes_per_page``."""
        ptrs, sizes = self._pool.get_page_buffer_meta(host_indices)
        if num_pages <= 0 or len(ptrs) != len(sizes) or len(ptrs) % num_pages:
            raise ValueError(f"get_page_buffer_meta gave {len(ptrs)} regions for {num_pages} pages")
        per_page = len(ptrs) // num_pages
        out = []
        for p in range(num_pages):
            spans = sorted(zip(ptrs[p * per_page:(p + 1) * per_page], sizes[p * per_page:(p + 1) * per_page]))
            total = sum(size for _, size in spans)
            if total != self.bytes_per_page:
                raise ValueError(
                    f"page {p} has {total} bytes in the host pool; the kvtier layout needs {self.bytes_per_page} "
                    "(pool geometry and layout disagree)"
                )
            out.append([self._view(ptr, size) for ptr, size in _merge(spans)])
        return out

    def _view(self, ptr: int, size: int) -> torch.Tensor:
        i = bisect.bisect_right(self._starts, ptr) - 1
        if i >= 0:
            view = self._views[i]
            offset = ptr - self._starts[i]
            if offset + size <= view.numel():
                return view[offset:offset + size]
        raise ValueError(f"host pool region at {ptr:#x} (+{size} bytes) lies outside the pool's kv_buffer")


def _merge(spans: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[list[int]] = []
    for ptr, size in spans:
        if merged and merged[-1][0] + merged[-1][1] == ptr:
            merged[-1][1] += size
        else:
            merged.append([ptr, size])
    return [(p, s) for p, s in merged]


def gather(regions: Sequence[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """Copy ``regions`` back to back into ``out`` (a flat uint8 block); returns ``out``."""
    offset = 0
    for region in regions:
        out[offset:offset + region.numel()].copy_(region)
        offset += region.numel()
    return out


def scatter(block: torch.Tensor, regions: Sequence[torch.Tensor]) -> None:
    """Inverse of :func:`gather`: copy ``block`` out into ``regions``."""
    offset = 0
    for region in regions:
        region.copy_(block[offset:offset + region.numel()])
        offset += region.numel()
