"""The rotation-quantizer codecs rq4 / rq3 (issue 24): C loops against the numpy
reference, error bounds, the rotation's worth on outlier channels, the value
format around them (checksums, bad headers, bad sub-headers), layout refusal."""

from __future__ import annotations

import doctest
import math
import struct
from pathlib import Path

import numpy as np
import pytest

import kvtier.tiers.codec as codec_mod
import kvtier.tiers.rq as rq
from kvtier.config import load_config
from kvtier.errors import ConfigError
from kvtier.keys import BlockKey, Namespace
from kvtier.layout import KVLayout
from kvtier.tiers.codec import (
    _CHECK,
    _FIELDS,
    HEADER_BYTES,
    DecodeOutcome,
    ValueContext,
    checksum,
    decode_outcome,
    encode,
    read_header,
)
from kvtier.tiers.ssd import SSDTier

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype="bfloat16", block_size=16)
NS = Namespace("tiny", "bfloat16", "fused", 16)
CTX = ValueContext.of(NS, LAYOUT)
K = BlockKey(0x1234_5678_9ABC)


def test_doctest() -> None:
    assert doctest.testmod(rq).failed == 0


def gaussian_kv(n: int, d: int, seed: int, outliers: int = 0) -> np.ndarray:
    """Vectors of mixed norms; ``outliers`` channels 20x larger (the shape of real keys)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, d)).astype(np.float32) * rng.uniform(0.2, 5, (n, 1)).astype(np.float32)
    x[:, :outliers] *= 20
    return x


def as_dtype(x: np.ndarray, dtype: str) -> tuple[bytes, np.ndarray]:
    """(raw bytes in ``dtype``, the float32 values those bytes hold)."""
    if dtype == "bfloat16":
        raw = rq.bf16_bits(x).tobytes()
    else:
        raw = x.astype(rq._NP_DTYPES[dtype]).tobytes()
    return raw, rq.to_f32(memoryview(raw), dtype, x.shape[1]).copy()


def roundtrip(raw: bytes, dtype: str, d: int, bits: int, seed: int = 5) -> np.ndarray:
    payload = rq.encode_payload(raw, dtype, d, bits, seed)
    out = bytearray(len(raw))
    rq.decode_payload(payload, bits, out)
    return rq.to_f32(memoryview(out), dtype, d)


def rel_mse(a: np.ndarray, b: np.ndarray) -> float:
    return float(((a - b) ** 2).sum() / (b**2).sum())


@pytest.mark.skipif(not rq.native(), reason="the C loops were not built")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("bits", [4, 3])
@pytest.mark.parametrize("d", [16, 64, 128, 256])
def test_c_loops_match_the_numpy_reference(dtype: str, bits: int, d: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Decoding gives the same bytes bit for bit; encoding the same codes except
    where a sum of squares rounds differently (none here)."""
    raw, _ = as_dtype(gaussian_kv(300, d, seed=d + bits, outliers=2), dtype)
    native = rq.encode_payload(raw, dtype, d, bits, seed=99)
    with monkeypatch.context() as m:
        m.setattr(rq, "_rq", None)
        reference = rq.encode_payload(raw, dtype, d, bits, seed=99)
        out_ref = bytearray(len(raw))
        rq.decode_payload(native, bits, out_ref)
    assert np.mean(np.frombuffer(native, np.uint8) == np.frombuffer(reference, np.uint8)) > 0.999
    out = bytearray(len(raw))
    rq.decode_payload(native, bits, out)
    assert out == out_ref


def test_lloyd_max_levels_are_the_gaussian_fixed_point() -> None:
    """Each level is the mean of N(0, 1) between its decision bounds (to 1e-5)."""
    pdf = lambda x: math.exp(-x * x / 2) / math.sqrt(2 * math.pi)  # noqa: E731
    cdf = lambda x: 0.5 * (1 + math.erf(x / math.sqrt(2)))  # noqa: E731
    for bits, levels in rq.LEVELS.items():
        assert len(levels) == 2**bits and np.all(np.diff(levels) > 0)
        bounds = [-math.inf, *((levels[:-1] + levels[1:]) / 2).tolist(), math.inf]
        for i, level in enumerate(levels):
            lo, hi = bounds[i], bounds[i + 1]
            mean = ((pdf(lo) if lo > -math.inf else 0) - (pdf(hi) if hi < math.inf else 0)) / (cdf(hi) - cdf(lo))
            assert abs(mean - level) < 1e-5


@pytest.mark.parametrize("bits, bound", [(4, 0.0115), (3, 0.037)])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_error_is_the_quantizers_distortion(bits: int, bound: float, dtype: str) -> None:
    """Relative MSE near the Lloyd-Max distortion of N(0, 1) (0.0095, 0.0345), and
    attention scores of random queries stay close."""
    x = gaussian_kv(2048, 128, seed=bits, outliers=4)
    raw, exact = as_dtype(x, dtype)
    got = roundtrip(raw, dtype, 128, bits)
    assert rel_mse(got, exact) < bound
    cos = (got * exact).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(exact, axis=1)
    assert cos.min() > (0.98 if bits == 4 else 0.95)


def test_the_rotation_matters_on_outlier_channel_keys() -> None:
    """Without the rotation (the same per-vector scale and codebook on the raw
    coordinates), keys with outlier channels lose >= 2x more: the issue's bar."""
    x = gaussian_kv(2048, 128, seed=3, outliers=4)
    for bits in (4, 3):
        rotated = rel_mse(rq.reference_roundtrip(x, bits, seed=11), x)
        plain = rel_mse(rq.reference_roundtrip(x, bits, seed=11, rotate=False), x)
        assert plain >= 2 * rotated, (bits, plain, rotated)


def test_sizes() -> None:
    raw, _ = as_dtype(gaussian_kv(64, 128, seed=1), "bfloat16")
    assert len(raw) / len(rq.encode_payload(raw, "bfloat16", 128, 4, 0)) > 3.8
    assert len(raw) / len(rq.encode_payload(raw, "bfloat16", 128, 3, 0)) > 5.0


def test_zero_vectors_decode_to_zero() -> None:
    raw = bytes(LAYOUT.bytes_per_block)
    got = roundtrip(raw, "bfloat16", 64, 4)
    assert not got.any()


# ---------------------------------------------------------------- inside the value format


def block(seed: int = 0, layout: KVLayout = LAYOUT) -> bytes:
    x = gaussian_kv(layout.bytes_per_block // (layout.head_dim * 2), layout.head_dim, seed, outliers=1)
    return as_dtype(x, "bfloat16")[0]


@pytest.mark.parametrize("codec", ["rq4", "rq3"])
def test_value_round_trip_is_lossy_and_labelled(codec: str) -> None:
    raw = block()
    value = encode(raw, CTX, codec=codec, key=K)
    header = read_header(value)
    assert header.codec == codec and header.lossy and header.raw_len == len(raw)
    out = bytearray(len(raw))
    assert decode_outcome(value, out, CTX, key=K) is DecodeOutcome.OK
    exact = rq.to_f32(memoryview(raw), "bfloat16", 64)
    assert 0 < rel_mse(rq.to_f32(memoryview(out), "bfloat16", 64), exact) < 0.04
    assert decode_outcome(value, out, CTX, key=BlockKey(1)) is DecodeOutcome.KEY_MISMATCH
    assert not read_header(encode(raw, CTX, codec="raw", key=K)).lossy


def test_a_block_that_is_not_finite_is_stored_exact() -> None:
    raw = bytearray(block())
    raw[2:4] = struct.pack("<H", 0x7F80)  # bf16 +inf
    value = encode(bytes(raw), CTX, codec="rq4", key=K)
    assert read_header(value).codec == "raw"
    out = bytearray(len(raw))
    assert decode_outcome(value, out, CTX, key=K) is DecodeOutcome.OK and out == raw


def _resign(value: bytes, **fields: int) -> bytes:
    """``value`` with header fields replaced and the header checksum recomputed."""
    names = ["magic", "version", "codec", "flags", "key", "ns", "lh", "parent", "stored_at", "raw_len",
             "payload_len", "plane0_len", "raw_sum"]
    vals = dict(zip(names, _FIELDS.unpack_from(value)))
    vals.update(fields)
    head = _FIELDS.pack(*vals.values())
    return head + _CHECK.pack(checksum(head)) + value[HEADER_BYTES:]


def _with_payload(value: bytes, payload: bytes) -> bytes:
    """``value`` carrying ``payload``, every checksum made valid again."""
    return _resign(value[:HEADER_BYTES] + payload, payload_len=len(payload), raw_sum=checksum(payload))


def test_bad_values_are_misses_never_crashes() -> None:
    raw = block(1)
    value = encode(raw, CTX, codec="rq4", key=K)
    out = bytearray(len(raw))
    # a flipped payload byte: the checksum over the compressed bytes catches it
    flipped = bytearray(value)
    flipped[HEADER_BYTES + 100] ^= 0x10
    assert decode_outcome(bytes(flipped), out, CTX, key=K) is DecodeOutcome.CHECKSUM_FAILURE
    # truncated
    assert decode_outcome(value[:-1], out, CTX, key=K) is DecodeOutcome.DECODE_FAILURE
    # a header naming a codec this reader does not know
    assert decode_outcome(_resign(value, codec=9), out, CTX, key=K) is DecodeOutcome.DECODE_FAILURE
    # sub-headers that lie, with every checksum valid: unknown bit width, bits of the other codec,
    # unknown dtype, head_dim out of range, flags set, wrong vector count, short codes
    payload = value[HEADER_BYTES:]
    bits, dcode, log2d, flags, seed, n, codes_len = rq._SUB.unpack_from(payload)
    for fields in ((5, dcode, log2d, flags, seed, n, codes_len), (3, dcode, log2d, flags, seed, n, codes_len),
                   (bits, 9, log2d, flags, seed, n, codes_len), (bits, dcode, 2, flags, seed, n, codes_len),
                   (bits, dcode, 40, flags, seed, n, codes_len), (bits, dcode, log2d, 1, seed, n, codes_len),
                   (bits, dcode, log2d, flags, seed, n + 1, codes_len),
                   (bits, dcode, log2d, flags, seed, n, codes_len - 1)):
        bad = _with_payload(value, rq._SUB.pack(*fields) + payload[rq.SUB_HEADER_BYTES:])
        assert decode_outcome(bad, out, CTX, key=K) is DecodeOutcome.DECODE_FAILURE, fields
    assert decode_outcome(_with_payload(value, payload[:-3]), out, CTX, key=K) is DecodeOutcome.DECODE_FAILURE
    assert decode_outcome(value, out, CTX, key=K) is DecodeOutcome.OK  # the original still decodes


@pytest.mark.parametrize("codec", ["rq4", "rq3"])
def test_ssd_tier_stores_and_reads_rq_values(tmp_path: Path, codec: str) -> None:
    keys = [BlockKey(i) for i in range(1, 9)]
    blocks = {k: block(int(k)) for k in keys}
    with SSDTier(tmp_path / "ssd", NS, LAYOUT, codec=codec) as tier:
        assert tier.put_many([(k, blocks[k], None) for k in keys]) == len(keys)
        outs = [np.empty(LAYOUT.bytes_per_block, dtype=np.uint8) for _ in keys]
        assert tier.get_many_into(keys, outs) == [True] * len(keys)
        for k, out in zip(keys, outs):
            exact = rq.to_f32(memoryview(blocks[k]), "bfloat16", 64)
            assert rel_mse(rq.to_f32(memoryview(out), "bfloat16", 64), exact) < 0.04
        stored = sum(e.stored_len for e in tier.scan())
        assert stored < len(keys) * LAYOUT.bytes_per_block / (3.5 if codec == "rq4" else 4.5)
        assert {e.codec for e in tier.scan()} == {codec}


@pytest.mark.parametrize(
    "layout, why",
    [
        (KVLayout(4, 1, 288, "bfloat16", 16, arrangement="mla"), "MLA latent width 288"),  # not measured
        (KVLayout(4, 1, 576, "int8", 16, arrangement="mla"), "dtype"),
        (KVLayout(2, 2, 64, "int8", 16), "dtype"),
        (KVLayout(2, 2, 96, "bfloat16", 16), "power of two"),
        (KVLayout(2, 2, 8, "bfloat16", 16), "power of two"),
    ],
)
def test_layouts_the_quantizer_cannot_store_are_refused_at_start(tmp_path: Path, layout: KVLayout, why: str) -> None:
    ns = Namespace("m", layout.dtype, layout.arrangement, layout.block_size)
    with pytest.raises(ConfigError, match=f"tiers.ssd.codec.*{why}"):
        SSDTier(tmp_path / "ssd", ns, layout, codec="rq4")
    with pytest.raises(ConfigError, match=f"tiers.ssd.codec.*{why}"):
        load_config(env={}, overrides={
            "layout": {"num_layers": layout.num_layers, "num_kv_heads": layout.num_kv_heads,
                       "head_dim": layout.head_dim, "dtype": layout.dtype, "block_size": layout.block_size,
                       "arrangement": layout.arrangement},
            "tiers": {"ssd": {"enabled": True, "codec": "rq4", "path": str(tmp_path / "ssd2")}}})
    # the same layout with a lossless codec is fine
    SSDTier(tmp_path / "ok", ns, layout, codec="zstd").close()


@pytest.mark.parametrize("codec", ["rq4", "rq3"])
def test_mla_latents_of_512_plus_64_are_stored_with_the_rope_part_apart(tmp_path: Path, codec: str) -> None:
    """Accepted since issue 40 (bench/codec_mla_results.py, tests/test_bench_codecs_mla.py): a
    latent is 9 vectors of 64; a rope part 50x the nope part's scale costs the nope part nothing."""
    layout = KVLayout(2, 1, 576, "bfloat16", 16, arrangement="mla")
    ns = Namespace("deepseek", "bfloat16", "mla", 16)
    assert rq.layout_problem(layout) is None
    rng = np.random.default_rng(4)
    keys = [BlockKey(i) for i in range(1, 5)]
    latents = {}
    for k in keys:
        x = rng.standard_normal((2, 16, 576)).astype(np.float32)
        x[..., 512:] *= 50
        latents[k] = x
    with SSDTier(tmp_path / "ssd", ns, layout, codec=codec) as tier:
        assert tier.put_many([(k, rq.bf16_bits(latents[k]).view(np.uint8).reshape(-1), None) for k in keys]) == 4
        outs = [np.empty(layout.bytes_per_block, dtype=np.uint8) for _ in keys]
        assert tier.get_many_into(keys, outs) == [True] * len(keys)
        bound = 0.0115 if codec == "rq4" else 0.037
        for k, out in zip(keys, outs):
            got = rq.to_f32(memoryview(out), "bfloat16", 576).reshape(2, 16, 576)
            for part in (slice(0, 512), slice(512, None)):
                assert rel_mse(got[..., part], latents[k][..., part]) < bound
        assert {e.codec for e in tier.scan()} == {codec}
        stored = sum(e.stored_len for e in tier.scan())
        assert stored < len(keys) * layout.bytes_per_block / (3.6 if codec == "rq4" else 4.7)


def test_encoding_needs_the_layouts_dtype_and_head_dim() -> None:
    bare = ValueContext(CTX.namespace_digest, CTX.layout_hash, 2)
    with pytest.raises(ValueError, match="head_dim"):
        encode(block(), bare, codec="rq4", key=K)
    value = encode(block(), CTX, codec="rq4", key=K)
    out = bytearray(LAYOUT.bytes_per_block)
    assert decode_outcome(value, out, bare, key=K) is DecodeOutcome.OK  # the payload describes itself


def test_codec_module_lists_the_lossy_codecs() -> None:
    assert codec_mod.LOSSY_CODECS == {"rq4", "rq3"}
    assert {"rq4", "rq3"} <= set(codec_mod.WRITE_CODECS)


@pytest.mark.parametrize("codec", ["rq4", "raw"])
def test_tiered_store_never_compresses_a_block_twice(tmp_path: Path, codec: str) -> None:
    """A DRAM copy prefetched from a lossy SSD value is not demoted to SSD again
    (it stays in DRAM, counted); with an exact codec the same demotion happens."""
    import torch

    from kvtier.store import TieredStore

    cfg = load_config(env={}, overrides={
        "layout": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 64, "block_size": 16},
        "tiers": {"hbm": {"enabled": False}, "dram": {"capacity_blocks": 8},
                  "ssd": {"enabled": True, "path": str(tmp_path / "ssd"), "codec": codec}},
        "put_tier": "dram", "write_through": False})
    with TieredStore(cfg) as store:
        keys = store.keys_for(list(range(2 * 16)))
        blocks = [torch.frombuffer(bytearray(block(i, store.layout)), dtype=torch.uint8) for i in range(2)]
        assert store.put(keys, blocks) == 2
        assert store.demote(keys, "dram", "ssd") == 2  # the one encoding
        assert store.prefetch(keys, "dram").result() == 2  # DRAM now holds decoded copies
        store.manager.remove(keys, "ssd")
        moved = store.demote(keys, "dram", "ssd")
        if codec == "rq4":
            assert moved == 0 and store.counters["demote_skipped_lossy_blocks"] == 2
            assert store.manager.tiers_of(keys[0]) == ("dram",)
        else:
            assert moved == 2 and store.counters["demote_skipped_lossy_blocks"] == 0
