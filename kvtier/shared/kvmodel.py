"""A small causal transformer that produces real KV for shared-context measurements.

Owns: a seeded, randomly initialised decoder (RMSNorm, grouped-query attention
with RoPE, SiLU MLP) and two ways of filling an agent's KV cache for a
sequence ``private history + shared segments``:

* :meth:`TinyKVModel.prefill` — exact: every token computed in context.
* :meth:`TinyKVModel.blend` — position-independent reuse as CacheBlend and
  EPIC do it: each shared segment's KV is taken from its master copy, and a
  chosen fraction of its positions (the first block of the segment and the
  blocks with the highest layer-1 KV deviation; or single tokens with
  ``granularity="token"``) is recomputed in this agent's context through
  every layer. Recomputed positions attend to this agent's private history
  and to the reused KV of earlier segments, so the mirror differs from the
  master exactly where such an engine would make it differ.

Positions: the KV of a segment is kept in the *segment frame* (K rotated by
RoPE at positions ``0..n-1`` inside the segment), so it is position
independent; attention rotates it by the segment's offset in the agent's
sequence on the fly (RoPE rotations compose exactly). Stored KV is bf16 (or
the chosen dtype); compute is float32. Used by ``kvtier bench shared`` and
tests; must not be imported by ``import kvtier`` (torch-heavy, measurement only).

>>> m = TinyKVModel(ModelSpec(num_layers=2, hidden_size=64, num_heads=2, num_kv_heads=1, head_dim=32))
>>> seg = torch.arange(16)
>>> exact = m.prefill(torch.arange(100, 116), [seg])
>>> exact[0].shape  # [layers, 2 (K, V), tokens, kv heads, head dim]
torch.Size([2, 2, 16, 1, 32])
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from ..errors import ConfigError

Granularity = Literal["block", "token"]


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Shape of the model (defaults: 4 layers, 4 KV heads of 64, bf16 KV)."""

    num_layers: int = 4
    hidden_size: int = 256
    num_heads: int = 4
    num_kv_heads: int = 4
    head_dim: int = 64
    ffn_size: int = 512
    vocab_size: int = 4096
    rope_theta: float = 10000.0
    kv_dtype: str = "bfloat16"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ConfigError("model.num_kv_heads", self.num_kv_heads, f"must divide num_heads={self.num_heads}")
        if self.head_dim % 2:
            raise ConfigError("model.head_dim", self.head_dim, "RoPE needs an even head dim")
        if self.kv_dtype not in ("bfloat16", "float16", "float32"):
            raise ConfigError("model.kv_dtype", self.kv_dtype, "valid: bfloat16, float16, float32")


@dataclass(frozen=True, slots=True)
class BlendStats:
    """What :meth:`TinyKVModel.blend` recomputed: positions per segment and the
    resulting fraction of all shared positions."""

    recomputed_tokens: tuple[int, ...]
    segment_tokens: tuple[int, ...]

    @property
    def recomputed_fraction(self) -> float:
        return sum(self.recomputed_tokens) / max(1, sum(self.segment_tokens))


class TinyKVModel:
    """Seeded random-weight decoder; see the module docstring."""

    def __init__(self, spec: ModelSpec | None = None) -> None:
        self.spec = s = spec or ModelSpec()
        g = torch.Generator().manual_seed(s.seed)

        def w(rows: int, cols: int) -> torch.Tensor:
            return torch.randn(rows, cols, generator=g) / math.sqrt(cols)

        self.embed = torch.randn(s.vocab_size, s.hidden_size, generator=g)
        q_dim, kv_dim = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        self.layers = [
            {"wq": w(q_dim, s.hidden_size), "wk": w(kv_dim, s.hidden_size), "wv": w(kv_dim, s.hidden_size),
             "wo": w(s.hidden_size, q_dim), "w1": w(s.ffn_size, s.hidden_size), "w3": w(s.ffn_size, s.hidden_size),
             "w2": w(s.hidden_size, s.ffn_size)}
            for _ in range(s.num_layers)
        ]
        half = s.head_dim // 2
        self.inv_freq = 1.0 / (s.rope_theta ** (torch.arange(half, dtype=torch.float64) / half))
        self.kv_dtype = getattr(torch, s.kv_dtype)

    # ------------------------------------------------------------ public

    def prefill(self, private: torch.Tensor, segments: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Exact KV of ``private + segments``: one ``[layers, 2, n, kv_heads, head_dim]``
        tensor (segment frame, KV dtype) per segment."""
        kv, _ = self._run(private, segments, reuse=None, active=None)
        return kv

    def blend(self, private: torch.Tensor, segments: Sequence[torch.Tensor], masters: Sequence[torch.Tensor],
              fraction: float = 0.15, block_size: int = 16, granularity: Granularity = "block",
              ) -> tuple[list[torch.Tensor], BlendStats]:
        """KV of ``private + segments`` reusing ``masters[i]`` (segment-frame KV of
        segment ``i``) and recomputing about ``fraction`` of each segment's positions.

        Block granularity recomputes ``max(1, round(fraction * blocks))`` whole
        blocks per segment: the first, then the highest-deviation ones. Token
        granularity recomputes ``max(1, round(fraction * tokens))`` tokens: the
        first ``block_size // 4``, then the highest-deviation ones. Deviation is
        the L2 distance between this agent's layer-1 K/V of a token and the
        master's (as CacheBlend selects its tokens).
        """
        if not 0.0 <= fraction <= 1.0:
            raise ConfigError("shared.recompute_fraction", fraction, "must be in [0, 1]")
        if granularity not in ("block", "token"):
            raise ConfigError("shared.recompute_granularity", granularity, "valid: block, token")
        deviation = self._layer1_deviation(private, segments, masters)
        active = [self._select(d, fraction, block_size, granularity) for d in deviation]
        kv, _ = self._run(private, segments, reuse=masters, active=active)
        stats = BlendStats(tuple(int(a.sum()) for a in active), tuple(len(s) for s in segments))
        return kv, stats

    # ------------------------------------------------------------ internals

    def _select(self, deviation: torch.Tensor, fraction: float, block_size: int, granularity: Granularity
                ) -> torch.Tensor:
        n = deviation.numel()
        mask = torch.zeros(n, dtype=torch.bool)
        if fraction == 0.0:
            return mask
        if granularity == "block":
            num_blocks = -(-n // block_size)
            per_block = F.pad(deviation, (0, num_blocks * block_size - n)).view(num_blocks, block_size).mean(1)
            per_block[0] = math.inf  # the first block of a segment is always recomputed (EPIC)
            chosen = torch.topk(per_block, max(1, round(fraction * num_blocks))).indices
            for b in chosen.tolist():
                mask[b * block_size: (b + 1) * block_size] = True
            return mask
        dev = deviation.clone()
        dev[: max(1, block_size // 4)] = math.inf
        mask[torch.topk(dev, max(1, round(fraction * n))).indices] = True
        return mask

    def _layer1_deviation(self, private: torch.Tensor, segments: Sequence[torch.Tensor],
                          masters: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Per segment token: |K1 - K1_master| + |V1 - V1_master| after an exact layer 0."""
        if self.spec.num_layers < 2:
            return [torch.zeros(len(s)) for s in segments]
        tokens, offsets = self._layout(private, segments)
        h = self.embed[tokens]
        pos = torch.arange(len(tokens))
        k0, v0 = self._kv_abs(self.layers[0], h, pos)
        h1 = h + self._attend_mlp(self.layers[0], h, pos, k0, v0, pos)
        k1, v1 = self._kv_pre(self.layers[1], h1)
        out = []
        for (start, n), seg in zip(offsets, masters):
            local = torch.arange(n)
            k_rel = self._rope(k1[start:start + n], local)
            dk = (k_rel - seg[1, 0].float()).flatten(1).norm(dim=1)
            dv = (v1[start:start + n] - seg[1, 1].float()).flatten(1).norm(dim=1)
            out.append(dk + dv)
        return out

    def _run(self, private: torch.Tensor, segments: Sequence[torch.Tensor], reuse: Sequence[torch.Tensor] | None,
             active: Sequence[torch.Tensor] | None) -> tuple[list[torch.Tensor], torch.Tensor]:
        tokens, offsets = self._layout(private, segments)
        num_tokens = len(tokens)
        act = torch.ones(num_tokens, dtype=torch.bool)
        if active is not None:
            for (start, n), a in zip(offsets, active):
                act[start:start + n] = a
        act_idx = torch.nonzero(act).squeeze(1)
        pos = torch.arange(num_tokens)
        h = self.embed[tokens[act_idx]]
        stored = [torch.empty(self.spec.num_layers, 2, n, self.spec.num_kv_heads, self.spec.head_dim,
                              dtype=self.kv_dtype) for _, n in offsets]
        for li, layer in enumerate(self.layers):
            k_pre, v_new = self._kv_pre(layer, h)
            k_abs = torch.empty(num_tokens, self.spec.num_kv_heads, self.spec.head_dim)
            v_abs = torch.empty_like(k_abs)
            k_abs[act_idx] = self._rope(k_pre, act_idx)
            v_abs[act_idx] = v_new
            for si, (start, n) in enumerate(offsets):
                a = act[start:start + n]
                local = torch.arange(n)
                fresh_k = torch.empty(n, self.spec.num_kv_heads, self.spec.head_dim)
                fresh_v = torch.empty_like(fresh_k)
                sel = torch.nonzero(a).squeeze(1)
                where = torch.searchsorted(act_idx, start + sel)
                fresh_k[sel] = self._rope(k_pre[where], sel)
                fresh_v[sel] = v_new[where]
                if reuse is not None:
                    keep = ~a
                    fresh_k[keep] = reuse[si][li, 0][keep].float()
                    fresh_v[keep] = reuse[si][li, 1][keep].float()
                    k_abs[start + local[keep]] = self._rope(fresh_k[keep], torch.full((int(keep.sum()),), start))
                    v_abs[start + local[keep]] = fresh_v[keep]
                stored[si][li, 0] = fresh_k.to(self.kv_dtype)
                stored[si][li, 1] = fresh_v.to(self.kv_dtype)
            h = h + self._attend_mlp(layer, h, act_idx, k_abs, v_abs, pos)
        return stored, h

    def _layout(self, private: torch.Tensor, segments: Sequence[torch.Tensor]
                ) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        offsets, start = [], len(private)
        for s in segments:
            offsets.append((start, len(s)))
            start += len(s)
        return torch.cat([private, *segments]).long(), offsets

    def _kv_pre(self, layer: dict[str, torch.Tensor], h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = _rms(h)
        s = self.spec
        return ((x @ layer["wk"].T).view(-1, s.num_kv_heads, s.head_dim),
                (x @ layer["wv"].T).view(-1, s.num_kv_heads, s.head_dim))

    def _kv_abs(self, layer: dict[str, torch.Tensor], h: torch.Tensor, pos: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self._kv_pre(layer, h)
        return self._rope(k, pos), v

    def _attend_mlp(self, layer: dict[str, torch.Tensor], h: torch.Tensor, q_pos: torch.Tensor,
                    k_abs: torch.Tensor, v_abs: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """Attention of the rows of ``h`` (at ``q_pos``) over all keys, causal by position, plus the MLP."""
        s = self.spec
        x = _rms(h)
        q = self._rope((x @ layer["wq"].T).view(-1, s.num_heads, s.head_dim), q_pos)
        rep = s.num_heads // s.num_kv_heads
        k = k_abs.repeat_interleave(rep, dim=1).transpose(0, 1)
        v = v_abs.repeat_interleave(rep, dim=1).transpose(0, 1)
        scores = (q.transpose(0, 1) @ k.transpose(1, 2)) * (1.0 / math.sqrt(s.head_dim))
        scores.masked_fill_(k_pos[None, None, :] > q_pos[None, :, None], -math.inf)
        att = torch.softmax(scores, dim=-1) @ v
        h2 = h + att.transpose(0, 1).reshape(len(h), -1) @ layer["wo"].T
        y = _rms(h2)
        return h2 - h + (F.silu(y @ layer["w1"].T) * (y @ layer["w3"].T)) @ layer["w2"].T

    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` ``[n, heads, dim]`` by RoPE at positions ``pos`` (float64 angles)."""
        ang = pos.double()[:, None] * self.inv_freq[None, :]
        cos, sin = ang.cos().float()[:, None, :], ang.sin().float()[:, None, :]
        x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def to_blocks(kv: torch.Tensor, block_size: int) -> torch.Tensor:
    """Segment KV ``[layers, 2, n, heads, dim]`` as engine blocks: uint8
    ``[n / block_size, bytes_per_block]``, each block laid out ``[layers][K, V][block_size][heads][dim]``
    (the per-block bytes of vLLM's fused per-layer cache)."""
    layers, two, n, heads, dim = kv.shape
    if n % block_size:
        raise ConfigError("shared.segment_tokens", n, f"must be a multiple of block_size={block_size}")
    blocks = kv.view(layers, two, n // block_size, block_size, heads, dim).permute(2, 0, 1, 3, 4, 5)
    return blocks.contiguous().view(n // block_size, -1).view(torch.uint8)
