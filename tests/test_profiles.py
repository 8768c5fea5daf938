"""Hardware/model profiles and the engine cost model: hand-computed figures,
consistency between the cost functions, and override files."""

from __future__ import annotations

import doctest
import math
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.errors import ConfigError
from kvtier.replay import profiles
from kvtier.replay.profiles import (
    DEFAULT_PROFILE,
    HARDWARE,
    LINKS,
    MODELS,
    HardwareProfile,
    ModelProfile,
    Profile,
    get_profile,
    load_profile_overrides,
    parse_profile,
    profile_names,
    profile_table,
)

H100_8B = get_profile("h100-80gb", "llama-3.1-8b")


def test_module_doctests_and_doc_table_are_current() -> None:
    assert doctest.testmod(profiles).failed == 0
    assert profile_table() in profiles.__doc__


# ---- model figures


@pytest.mark.parametrize(
    ("model", "kv_bytes_per_token"),
    [
        ("llama-3.1-8b", 131072),  # 32 layers * 8 KV heads * 128 dim * 2 (K, V) * 2 bytes
        ("qwen2.5-14b", 196608),  # 48 layers * 8 KV heads * 128 dim * 2 (K, V) * 2 bytes
        ("llama-3.1-70b", 327680),  # 80 layers * 8 KV heads * 128 dim * 2 (K, V) * 2 bytes
        ("deepseek-r1", 70272),  # 61 layers * 576 latent (512 kv_lora_rank + 64 rope) * 2 bytes, one tensor
        ("gemma-3-27b", 507904),  # 62 layers * 16 KV heads * 128 dim * 2 (K, V) * 2 bytes (every layer)
    ],
)
def test_kv_bytes_per_token(model: str, kv_bytes_per_token: int) -> None:
    assert MODELS[model].kv_bytes_per_token == kv_bytes_per_token
    # 16-token block of the 8B model: 16 * 131072 = 2 MiB, as kvtier.config's default layout
    assert get_profile("h100-80gb", model).kv_bytes_per_block(16) == 16 * kv_bytes_per_token


def test_model_kv_layout_and_fp8_kv_override() -> None:
    layout = MODELS["deepseek-r1"].kv_layout(64)
    assert (layout.arrangement, layout.num_kv_heads, layout.head_dim) == ("mla", 1, 576)
    assert layout.bytes_per_block == 64 * 70272
    # FP8 KV halves the 8B model's bytes per token: 131072 / 2 = 65536
    fp8 = H100_8B.with_overrides({"model": {"kv_dtype": "float8_e4m3fn"}})
    assert fp8.model.kv_bytes_per_token == 65536


def test_model_parameter_counts_match_their_config_derivation() -> None:
    # Llama-3.1-8B: per layer 4096*4096*2 (q, o) + 4096*1024*2 (k, v) + 3*4096*14336 (mlp) + 2*4096 (norms)
    per_layer = 4096 * 4096 * 2 + 4096 * 1024 * 2 + 3 * 4096 * 14336 + 2 * 4096
    assert per_layer == 218_112_000
    assert MODELS["llama-3.1-8b"].num_params == 32 * per_layer + 2 * 128256 * 4096 + 4096
    # DeepSeek-R1 active share of the routed experts: 58 MoE layers * 8 of 256 experts
    r1 = MODELS["deepseek-r1"]
    assert r1.expert_params == 58 * 256 * 3 * 7168 * 2048
    assert r1.num_params - r1.expert_params + r1.expert_params * 8 / 256 == pytest.approx(37.4e9, rel=0.01)
    # Gemma-3-27B: per layer 5376*4096*2 (q, o) + 5376*2048*2 (k, v) + 2*128 (q/k norms)
    # + 3*5376*21504 (gated MLP) + 4*5376 (norms); tied 262208-token embedding; final norm
    per_layer = 5376 * 4096 * 2 + 5376 * 2048 * 2 + 2 * 128 + 3 * 5376 * 21504 + 4 * 5376
    assert per_layer == 412_898_560
    gemma = MODELS["gemma-3-27b"]
    assert gemma.num_active_params == 62 * per_layer + 262208 * 5376 + 5376
    assert (gemma.num_sliding_layers, gemma.sliding_window_tokens) == (52, 1024)
    assert gemma.sliding_kv_bytes_per_token == 52 * 16 * 128 * 2 * 2


# ---- capacity


def test_hbm_kv_capacity_of_8b_on_one_h100() -> None:
    # 81559 MiB = 85,520,809,984 B; * 0.9 = 76,968,728,985.6; - 2 GiB reserve (2,147,483,648)
    # - 16,060,522,496 B of BF16 weights = 58,760,722,841.6 B; / 2,097,152 B per 16-token block = 28019.3
    assert H100_8B.hbm_kv_capacity_blocks(16) == 28019
    # a lower utilization leaves fewer blocks; a larger block holds proportionally fewer
    assert H100_8B.hbm_kv_capacity_blocks(16, 0.5) < 28019
    assert H100_8B.hbm_kv_capacity_blocks(64) == 58_760_722_841 // (64 * 131072)


def test_weights_that_do_not_fit_raise_naming_num_chips() -> None:
    # DeepSeek-R1 weights are 672.85 GB; 8 H100 give 8 * (76.97 - 4.29) = 581 GB < 672.85
    r1_on_8 = get_profile("h100-80gb", "deepseek-r1", num_chips=8)
    with pytest.raises(ConfigError, match="num_chips=8.*use more chips") as info:
        r1_on_8.hbm_kv_capacity_blocks(64)
    assert info.value.setting == "num_chips"
    # without num_chips the default 8 is doubled to 16, which fits
    assert get_profile("h100-80gb", "deepseek-r1").num_chips == 16
    assert get_profile("b200", "deepseek-r1").num_chips == 8
    assert get_profile("ascend-910b", "deepseek-r1").num_chips == 16
    assert get_profile("ascend-910c", "deepseek-r1").num_chips == 8


def test_kv_copies_under_tensor_parallelism() -> None:
    # MLA keeps the whole latent on every TP rank: 8 copies on 8 B200s
    r1 = get_profile("b200", "deepseek-r1")
    assert r1.kv_copies == 8
    assert r1.with_overrides({"attention_dp": True}).kv_copies == 1
    dp_blocks = r1.with_overrides({"attention_dp": True}).hbm_kv_capacity_blocks(64)
    assert dp_blocks // 8 <= r1.hbm_kv_capacity_blocks(64) <= dp_blocks // 8 + 1
    # GQA with 8 KV heads: TP=4 shards them (1 copy), TP=16 duplicates each head twice
    assert get_profile("h100-80gb", "llama-3.1-70b").kv_copies == 1
    assert get_profile("h100-80gb", "llama-3.1-70b", 16).kv_copies == 2


# ---- cost model


def test_decode_step_of_8b_on_one_h100_is_a_few_ms() -> None:
    # memory-bound: (16,060,522,496 B weights + 1 token * 131072 B KV written)
    # / (3.35e12 B/s * 0.75 MBU = 2.5125e12) = 6.3922 ms; compute is 16 GFLOP / 445 TFLOP/s = 36 us
    t = H100_8B.decode_step_time_s(1, 0)
    assert t == pytest.approx((16_060_522_496 + 131_072) / 2.5125e12, rel=1e-12)
    assert 3e-3 <= t <= 15e-3
    # 64 sequences of 4096 cached tokens read 64*4096*131072 = 34.4 GB of KV on top of the weights
    assert H100_8B.decode_step_time_s(64, 64 * 4096) == pytest.approx(
        (16_060_522_496 + (64 * 4096 + 64) * 131_072) / 2.5125e12, rel=1e-12
    )


def test_prefill_of_8k_tokens_of_8b_on_one_h100() -> None:
    # linear: 2 * 8,030,261,248 * 8192 = 131,567,800,287,232 FLOP
    # attention: 4 * 32 layers * 4096 * 8192 * (0 + 8192 / 2) = 17,592,186,044,416 FLOP
    # / (989e12 * 0.45 MFU = 445.05e12 FLOP/s) = 0.33515 s
    t = H100_8B.prefill_time_s(8192, 0)
    assert t == pytest.approx((131_567_800_287_232 + 17_592_186_044_416) / 445.05e12, rel=1e-12)
    assert 0.2 <= t <= 1.5
    # the same 8192 tokens after 8192 cached ones cost more (attention over the context)
    assert H100_8B.prefill_time_s(8192, 8192) > t
    # one token is floored by reading the weights once: the batch-1 decode time
    assert H100_8B.prefill_time_s(1, 0) == H100_8B.decode_step_time_s(1, 0)
    assert H100_8B.recompute_time_s(8192, 0) == t


def test_step_time_is_consistent_with_prefill_and_decode() -> None:
    for spec in profile_names():
        p = parse_profile(spec)
        overhead = p.hardware.step_overhead_s
        assert p.step_time_s(2048, 3000, 0, 0) == p.prefill_time_s(2048, 3000) + overhead
        assert p.step_time_s(0, 0, 32, 50_000) == p.decode_step_time_s(32, 50_000) + overhead
        assert p.step_time_chunks_s([(2048, 3000)], 32, 50_000) == p.step_time_s(2048, 3000, 32, 50_000)
        assert p.step_time_s(0, 0, 0, 0) == p.step_time_chunks_s([], 0, 0) == 0.0
        # batching a chunk with decodes never costs more than running them as two steps
        mixed = p.step_time_s(512, 1000, 32, 50_000)
        assert max(p.step_time_s(512, 1000, 0, 0), p.step_time_s(0, 0, 32, 50_000)) <= mixed
        assert mixed <= p.step_time_s(512, 1000, 0, 0) + p.step_time_s(0, 0, 32, 50_000)


def test_tensor_parallel_steps_pay_collective_latency() -> None:
    # 70B on 4 H100: 2 all-reduces * 80 layers * 10 us = 1.6 ms on top of the roofline
    p = get_profile("h100-80gb", "llama-3.1-70b")
    roofline_s = (2 * 70_553_706_496 + 327_680) / (4 * 3.35e12 * 0.75)
    assert p.decode_step_time_s(1, 0) == pytest.approx(roofline_s + 1.6e-3, rel=1e-12)


def test_moe_decode_reads_only_the_experts_its_tokens_touch() -> None:
    r1 = get_profile("b200", "deepseek-r1")
    m = r1.model
    expert_bytes = m.weight_bytes * m.expert_params / m.num_params
    comm_s = 2 * 61 * 10e-6
    bytes_per_s = 8 * 8.0e12 * 0.70
    # one token touches 8 of 256 experts per layer: 1 - (1 - 8/256)^1 = 1/32 of the expert bytes
    one = (m.weight_bytes - expert_bytes + expert_bytes / 32 + 8 * 70272) / bytes_per_s + comm_s
    assert r1.decode_step_time_s(1, 0) == pytest.approx(one, rel=1e-12)
    # a large batch touches nearly all of them: memory time approaches all weights
    assert r1.decode_step_time_s(512, 0) > 0.99 * m.weight_bytes / bytes_per_s
    assert r1.decode_step_time_s(1, 0) - comm_s < 0.1 * m.weight_bytes / bytes_per_s


def test_transfer_times() -> None:
    gib = 1 << 30
    # host link: 10 us + 2^30 B / 50e9 B/s = 21.48 ms on one H100; 4 chips move 4x as fast
    assert H100_8B.transfer_time_s(gib, "dram->hbm") == 10e-6 + gib / 50e9
    assert get_profile("h100-80gb", "llama-3.1-70b").transfer_time_s(gib, "hbm->dram") == 10e-6 + gib / 200e9
    # local NVMe: 100 us + 2^30 / 7e9 to read, / 5e9 to write
    assert H100_8B.transfer_time_s(gib, "ssd->dram") == 100e-6 + gib / 7e9
    assert H100_8B.transfer_time_s(gib, "dram->ssd") == 100e-6 + gib / 5e9
    # 16 chips span 2 nodes: two SSDs, each holding the KV heads of its node's ranks; TP=16 over
    # 8 KV heads puts each head on 2 ranks, so 8 host links carry distinct bytes
    llama_16 = get_profile("h100-80gb", "llama-3.1-70b", 16)
    assert llama_16.transfer_time_s(gib, "ssd->dram") == 100e-6 + gib / 14e9
    assert llama_16.transfer_time_s(gib, "dram->hbm") == 10e-6 + gib / (8 * 50e9)
    # MLA: all 16 ranks hold the whole latent, so each loads all of it over its own link (one
    # link's bandwidth, not 16) and each node reads its own copy from its own SSD
    r1 = get_profile("h100-80gb", "deepseek-r1")
    assert r1.transfer_time_s(gib, "dram->hbm") == 10e-6 + gib / 50e9
    assert r1.transfer_time_s(gib, "ssd->dram") == 100e-6 + gib / 7e9
    # data-parallel attention keeps one copy: every chip's link carries its own requests' blocks
    assert r1.with_overrides({"attention_dp": True}).transfer_time_s(gib, "dram->hbm") == 10e-6 + gib / (16 * 50e9)
    assert H100_8B.transfer_time_s(0, "ssd->dram") == 0.0
    with pytest.raises(ConfigError, match="valid: hbm->dram, dram->hbm, dram->ssd, ssd->dram"):
        H100_8B.transfer_time_s(1, "hbm->ssd")
    with pytest.raises(ConfigError, match="num_bytes"):
        H100_8B.transfer_time_s(-1, "dram->hbm")


@settings(max_examples=200, deadline=None)
@given(
    spec=st.sampled_from(profile_names()),
    link=st.sampled_from(LINKS),
    a=st.integers(0, 1 << 40),
    b=st.integers(0, 1 << 40),
)
def test_transfer_time_is_monotone_in_bytes(spec: str, link: str, a: int, b: int) -> None:
    p = parse_profile(spec)
    lo, hi = min(a, b), max(a, b)
    assert p.transfer_time_s(lo, link) <= p.transfer_time_s(hi, link)


_COUNTS = st.integers(0, 200_000)


@settings(max_examples=200, deadline=None)
@given(
    spec=st.sampled_from(profile_names()),
    args=st.tuples(st.integers(0, 16384), _COUNTS, st.integers(0, 512), st.integers(0, 2_000_000)),
    which=st.integers(0, 3),
    extra=st.integers(1, 10_000),
)
def test_step_time_is_monotone_in_every_argument(
    spec: str, args: tuple[int, int, int, int], which: int, extra: int
) -> None:
    p = parse_profile(spec)
    more = list(args)
    more[which] += extra
    assert p.step_time_s(*args) <= p.step_time_s(*more)


# ---- names and lookup


def test_profile_names_and_parse() -> None:
    names = profile_names()
    assert len(names) == len(HARDWARE) * len(MODELS) >= 16
    assert DEFAULT_PROFILE in names
    assert {"h100-80gb", "b200", "ascend-910b", "ascend-910c"} <= set(HARDWARE)
    p = parse_profile("ascend-910c:llama-3.1-70b:2")
    assert (p.hardware.name, p.model.name, p.num_chips) == ("ascend-910c", "llama-3.1-70b", 2)
    assert parse_profile(p.spec) == p
    assert parse_profile(DEFAULT_PROFILE) == H100_8B


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("h200:llama-3.1-8b", r"unknown hardware profile.*valid: ascend-910b, ascend-910c, b200, h100-80gb"),
        ("h100-80gb:llama-3-8b", r"unknown model profile \(did you mean 'llama-3.1-8b'\?\); valid: deepseek-r1"),
        ("h100-80gb:llama-3.1-8b:two", "chips 'two' must be a positive integer"),
        ("h100-80gb:llama-3.1-8b:0", "num_chips=0: must be a positive integer"),
        ("h100-80gb", "expected 'hardware:model"),
        ("a:b:1:2", "expected 'hardware:model"),
    ],
)
def test_bad_profile_specs(spec: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        parse_profile(spec)


# ---- overrides


def test_with_overrides_changes_only_what_it_names() -> None:
    p = H100_8B.with_overrides({"hardware": {"hbm_bw_bytes_s": "4.0e12"}, "num_chips": 2})
    assert p.hardware.hbm_bw_bytes_s == 4.0e12 and p.num_chips == 2
    assert p.hardware.peak_flops == H100_8B.hardware.peak_flops and p.model == H100_8B.model
    assert H100_8B.with_overrides({}) == H100_8B
    assert H100_8B.with_overrides(H100_8B.to_overrides()) == H100_8B


@pytest.mark.parametrize(
    ("overrides", "setting", "match"),
    [
        ({"hardware": {"hbm_bw": 4e12}}, "hardware.hbm_bw", r"did you mean 'hbm_bw_bytes_s'"),
        ({"model": {"layers": 4}}, "model.layers", r"unknown key.*valid keys of model:"),
        ({"chips": 4}, "chips", r"did you mean 'num_chips'"),
        ({"hardware": {"mfu_prefill": 1.5}}, "hardware.mfu_prefill", r"\(0, 1\]"),
        ({"hardware": {"peak_flops": "fast"}}, "hardware.peak_flops", "must be a number"),
        ({"hardware": {"peak_flops": True}}, "hardware.peak_flops", "must be a number"),
        ({"hardware": {"hbm_bw_bytes_s": -1}}, "hardware.hbm_bw_bytes_s", "must be > 0"),
        ({"model": {"num_layers": 2.5}}, "model.num_layers", "must be an integer"),
        ({"model": {"kv_dtype": "fp7"}}, "model.kv_dtype", "unknown dtype"),
        ({"model": {"num_active_params": 10**12}}, "model.num_active_params", "<= model.num_params"),
        ({"num_chips": 0}, "num_chips", "positive integer"),
        ({"attention_dp": "yes"}, "attention_dp", "true or false"),
        ({"hardware": [1]}, "hardware", "must be a mapping"),
    ],
)
def test_bad_overrides_name_the_key(overrides: dict, setting: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match) as info:
        H100_8B.with_overrides(overrides)
    assert info.value.setting == setting


def test_override_file_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "profile.yaml"
    # PyYAML reads 7.7e12 (no sign in the exponent) as a string: accepted as a number
    path.write_text(
        "base: b200:llama-3.1-70b\n"
        "num_chips: 2\n"
        "hardware: {hbm_bw_bytes_s: 7.7e12, mbu_decode: 0.8}\n"
        "model: {kv_dtype: float8_e4m3fn}\n"
    )
    p = load_profile_overrides(path)
    base = get_profile("b200", "llama-3.1-70b")
    assert p.num_chips == 2 and p.hardware.hbm_bw_bytes_s == 7.7e12 and p.hardware.mbu_decode == 0.8
    assert p.model.kv_bytes_per_token == 327680 // 2
    assert p.hardware.peak_flops == base.hardware.peak_flops and p.model.weight_bytes == base.model.weight_bytes
    # every profile survives a full dump to YAML and back
    for spec in profile_names():
        q = parse_profile(spec)
        path.write_text(yaml.safe_dump(q.to_overrides()))
        assert load_profile_overrides(path, base="b200:qwen2.5-14b") == q
    # without `base` the file applies to the base argument, else to DEFAULT_PROFILE
    path.write_text("num_chips: 4\n")
    assert load_profile_overrides(path) == H100_8B.with_overrides({"num_chips": 4})
    assert load_profile_overrides(path, base=base).hardware.name == "b200"
    path.write_text("")
    assert load_profile_overrides(path) == H100_8B


@pytest.mark.parametrize(
    ("text", "setting", "match"),
    [
        ("hardware:\n  hbm_bw_bytes: 4.0e+12\n", "hardware.hbm_bw_bytes", "did you mean 'hbm_bw_bytes_s'"),
        ("model:\n  num_layers: -3\n", "model.num_layers", "positive integer"),
        ("bases: b200:llama-3.1-8b\n", "bases", "did you mean 'base'"),
        ("base: tpu:llama-3.1-8b\n", "hardware", "unknown hardware profile"),
        ("- 1\n- 2\n", "profile file", "top level must be a mapping"),
        ("hardware: {a: [\n", "profile file", "invalid YAML"),
    ],
)
def test_bad_override_file_names_file_and_key(tmp_path: Path, text: str, setting: str, match: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=match) as info:
        load_profile_overrides(path)
    assert info.value.setting == setting
    assert str(path) in str(info.value)


def test_missing_override_file() -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_profile_overrides("/nonexistent/profile.yaml")


def test_values_are_frozen_and_validated() -> None:
    with pytest.raises(AttributeError):
        H100_8B.num_chips = 2  # type: ignore[misc]
    with pytest.raises(ConfigError, match="hardware.chips_per_node"):
        HardwareProfile(**{**H100_8B.to_overrides()["hardware"], "chips_per_node": 0})
    with pytest.raises(ConfigError, match="model.kv_arrangement"):
        ModelProfile(**{**H100_8B.to_overrides()["model"], "kv_arrangement": "paged"})
    with pytest.raises(ConfigError, match="model.num_kv_heads"):  # MLA stores one latent
        ModelProfile(**{**H100_8B.to_overrides()["model"], "kv_arrangement": "mla"})
    assert isinstance(hash(H100_8B), int)
    assert math.isfinite(Profile(HARDWARE["b200"], MODELS["qwen2.5-14b"], 3).step_time_s(1, 2, 3, 4))
