"""Bytes per token of each model family, end to end through the replay: the MLA
latent of DeepSeek-R1 and the sliding window of Gemma 3 size the blocks, the
HBM capacity, the bytes on the links and their transfer times."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from kvtier.cli import build_parser, main
from kvtier.errors import ConfigError
from kvtier.replay import default_workload
from kvtier.replay.cli import build_spec
from kvtier.replay.model import Agent, Request, Session, Workload
from kvtier.replay.profiles import HARDWARE, MODELS, Profile, get_profile
from kvtier.replay.run import ReplaySpec, run_point
from kvtier.replay.sim import SimConfig, Simulator
from kvtier.placement import make_placement

_MIB, _GIB = 1 << 20, 1 << 30
BLOCK = 64  # the embedded workload's block size

# DeepSeek-R1 config.json: 61 layers; MLA caches kv_lora_rank 512 + qk_rope_head_dim 64 per token per
# layer, one BF16 tensor. Treated as 128 heads of K (192) and V (128), it would be 61 * 128 * 320 * 2.
R1_LATENT_BYTES_PER_TOKEN = 61 * (512 + 64) * 2  # 70,272
R1_HEADS_BYTES_PER_TOKEN = 61 * 128 * (192 + 128) * 2  # 4,997,120: what the replay must not use

# Gemma-3-27B: 62 layers of 16 KV heads x 128, K and V, BF16; 10 global layers, 52 with a 1024-token window
GEMMA_LAYER_BYTES_PER_TOKEN = 16 * 128 * 2 * 2  # 8,192
GEMMA_FULL_BYTES_PER_TOKEN = 10 * GEMMA_LAYER_BYTES_PER_TOKEN  # 81,920
GEMMA_SLIDING_BYTES_PER_TOKEN = 52 * GEMMA_LAYER_BYTES_PER_TOKEN  # 425,984


def _r(i: int, ids: tuple[int, ...]) -> Request:
    return Request(i, BLOCK * len(ids), 1, ids, 0.0, "start", "end_turn", 0.0)


def _workload(*sessions: tuple[tuple[int, ...], ...]) -> Workload:
    return Workload("w", BLOCK, tuple(
        Session(f"s{n}", (Agent("root", None, "main", tuple(_r(i, ids) for i, ids in enumerate(reqs))),))
        for n, reqs in enumerate(sessions)), False)


# ---- MLA


def test_mla_sizes_blocks_capacity_and_transfers_from_the_latent_end_to_end() -> None:
    args = build_parser().parse_args(["replay", "--profile", "h100-80gb:deepseek-r1", "--sessions", "2", "--quiet"])
    spec = build_spec(args)
    p = spec.profile
    assert (p.num_chips, p.kv_copies) == (16, 16)  # 16 H100s, every TP rank holding the whole latent
    bpb = p.kv_bytes_per_block(BLOCK)
    assert bpb == BLOCK * R1_LATENT_BYTES_PER_TOKEN == 4_497_408
    assert bpb != BLOCK * R1_HEADS_BYTES_PER_TOKEN
    # HBM: 16 * (81559 MiB * 0.9 - 4 GiB reserve) - 672,853,358,080 B of weights = 489,926,828,953.6 B,
    # over 16 copies of each 4,497,408 B block = 6808.5 blocks (with heads x head_dim: 95)
    free = 16 * (81559 * _MIB * 0.9 - 4 * _GIB) - (671_000_000_000 + 1_853_358_080)
    full = int(free // (16 * BLOCK * R1_LATENT_BYTES_PER_TOKEN))
    assert full == 6808 and int(free // (16 * BLOCK * R1_HEADS_BYTES_PER_TOKEN)) == 95
    assert spec.hbm_blocks == tuple(max(1, int(full * f)) for f in (0.6, 0.8, 1.0, 1.5))

    # a replay with DRAM traffic: every byte on a link is a whole number of latent blocks
    w = default_workload(seed=0, num_sessions=2, max_requests_per_agent=6)
    spec = ReplaySpec(workload=w, profile=p, policies=("lru-dram",), hbm_fractions=(0.3,), concs=(2,))
    row = run_point(spec, "lru-dram", 2, spec.capacities()[0])
    moved = row["bytes_moved_per_link"]
    assert moved.get("hbm->dram", 0) > 0
    assert all(n % bpb == 0 for n in moved.values()), moved
    # and a transfer takes its latent bytes over ONE host link: each rank loads the whole latent
    sim = Simulator(w, SimConfig(hbm_blocks=1000, dram_blocks=1000), make_placement("lru-dram"), p)
    assert sim.bytes_per_block == bpb
    assert sim.mover.path_s("dram", "hbm", 10) == pytest.approx(10e-6 + 10 * bpb / 50e9, rel=1e-12)


# ---- sliding window: which blocks keep the window


def test_window_share_keeps_the_window_before_every_reuse_point() -> None:
    # two sessions share blocks 1-2, then go apart: 2 is a reuse point (a branch), as is the
    # last block of every request (6, 8 and 9); a 2-block window keeps 1, 2, 5, 6, 7, 8, 9
    w = _workload(((1, 2, 3, 4, 5, 6), (1, 2, 3, 4, 5, 6, 7, 8)), ((1, 2, 9),))
    assert w.window_share(2 * BLOCK) == 7 / 9
    assert w.window_share(2 * BLOCK - 1) == 7 / 9  # a part of a block keeps the whole block
    assert w.window_share(BLOCK) == 4 / 9  # only the reuse points: 2, 6, 8, 9
    assert w.window_share(8 * BLOCK) == 1.0  # the window covers every chain
    assert _workload(((),)).window_share(BLOCK) == 1.0  # no blocks
    with pytest.raises(ValueError, match="window_tokens"):
        w.window_share(0)


def test_a_full_attention_model_is_unchanged_by_fitting() -> None:
    w = default_workload(seed=0, num_sessions=2, max_requests_per_agent=6)
    for name in ("llama-3.1-8b", "deepseek-r1"):
        p = get_profile("h100-80gb", name)
        assert p.fitted_to(w) is p and p.window_share is None
        assert ReplaySpec(workload=w, profile=p).profile is p


# ---- sliding window: how much less a hybrid stores


def test_gemma3_stores_fewer_bytes_than_the_same_model_as_full_attention() -> None:
    gemma = MODELS["gemma-3-27b"]
    as_full = replace(gemma, name="gemma-3-27b-full", num_sliding_layers=0, sliding_window_tokens=0)
    assert gemma.kv_bytes_per_token == as_full.kv_bytes_per_token == 62 * GEMMA_LAYER_BYTES_PER_TOKEN
    assert gemma.sliding_kv_bytes_per_token == GEMMA_SLIDING_BYTES_PER_TOKEN

    # one context of 32k tokens, reusable at its end: 32768 * 81,920 + 1024 * 425,984 = 3,120,562,176 B
    # against 32768 * 507,904 = 16,642,998,272 B as full attention: 5.33x less
    assert gemma.kv_bytes_for_context(32768) == 3_120_562_176
    assert as_full.kv_bytes_for_context(32768) == 16_642_998_272
    assert as_full.kv_bytes_for_context(32768) / gemma.kv_bytes_for_context(32768) == pytest.approx(5.333, abs=1e-3)
    # within the window nothing is saved
    assert gemma.kv_bytes_for_context(1000) == as_full.kv_bytes_for_context(1000)

    # the replay: the embedded workload keeps the window on 12.0% of its blocks (2 sessions), so a
    # block is 64 * (81,920 + 0.1198 * 425,984) = 8,508,000 B instead of 64 * 507,904 = 32,505,856 B
    w = default_workload(seed=0, num_sessions=2)
    h100 = HARDWARE["h100-80gb"]
    windowed = ReplaySpec(workload=w, profile=Profile(h100, gemma, 1)).profile
    full = ReplaySpec(workload=w, profile=Profile(h100, as_full, 1)).profile
    share = w.window_share(1024)
    assert windowed.window_share == share == pytest.approx(0.1198, abs=1e-4)
    assert full.window_share is None
    bpb = windowed.kv_bytes_per_block(BLOCK)
    assert bpb == BLOCK * GEMMA_FULL_BYTES_PER_TOKEN + math.ceil(BLOCK * GEMMA_SLIDING_BYTES_PER_TOKEN * share)
    assert bpb == 8_508_000 and full.kv_bytes_per_block(BLOCK) == 32_505_856  # 3.82x less per block
    # HBM: the same ~19.96 GB of free KV memory holds 3.8x the blocks (2345 against 613 of 64 tokens)
    assert (windowed.hbm_kv_capacity_blocks(BLOCK), full.hbm_kv_capacity_blocks(BLOCK)) == (2345, 613)
    # an unfitted profile counts the sliding layers in full, as the full-attention model does
    assert get_profile("h100-80gb", "gemma-3-27b").kv_bytes_per_block(BLOCK) == 32_505_856
    # decode reads the kept KV too: 1000 cached tokens cost 1000 * kept bytes on top of the weights
    kept = GEMMA_FULL_BYTES_PER_TOKEN + GEMMA_SLIDING_BYTES_PER_TOKEN * share
    assert windowed.kept_kv_bytes_per_token == pytest.approx(kept, rel=1e-12)
    assert windowed.decode_step_time_s(1, 1000) < full.decode_step_time_s(1, 1000)


def test_gemma3_replay_moves_windowed_blocks_on_the_links() -> None:
    w = default_workload(seed=0, num_sessions=2, max_requests_per_agent=6)
    unfitted = get_profile("h100-80gb", "gemma-3-27b")
    spec = ReplaySpec(workload=w, profile=unfitted, policies=("lru-dram",), hbm_fractions=(0.3,), concs=(2,))
    bpb = spec.profile.kv_bytes_per_block(BLOCK)
    assert bpb < unfitted.kv_bytes_per_block(BLOCK)
    row = run_point(spec, "lru-dram", 2, spec.capacities()[0])
    moved = row["bytes_moved_per_link"]
    assert moved.get("hbm->dram", 0) > 0
    assert all(n % bpb == 0 for n in moved.values()), moved
    # a Simulator given the unfitted profile fits it to its workload itself
    sim = Simulator(w, SimConfig(hbm_blocks=1000, dram_blocks=1000), make_placement("lru-dram"), unfitted)
    assert sim.bytes_per_block == bpb
    assert sim.mover.path_s("hbm", "dram", 10) == pytest.approx(10e-6 + 10 * bpb / 50e9, rel=1e-12)


def test_replay_cli_reports_the_window(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    assert main(["replay", "--profile", "h100-80gb:gemma-3-27b", "--sessions", "2", "--policies", "lru",
                 "--hbm-blocks", "2700", "--no-references", "--quiet", "--json", str(out)]) == 0
    window = json.loads(out.read_text())["sliding_window"]
    assert window["layers"] == 52 and window["of_layers"] == 62 and window["window_tokens"] == 1024
    assert window["kv_bytes_per_block"] == 8_508_000
    assert window["kv_bytes_per_block_full_attention"] == 32_505_856
    assert window["window_share"] == pytest.approx(0.1198, abs=1e-4)


# ---- validation


@pytest.mark.parametrize(
    ("changes", "setting", "match"),
    [
        ({"num_sliding_layers": 63}, "model.num_sliding_layers", "<= model.num_layers=62"),
        ({"sliding_window_tokens": 0}, "model.sliding_window_tokens", "exactly when"),
        ({"num_sliding_layers": 0}, "model.sliding_window_tokens", "exactly when"),
        ({"sliding_window_tokens": -1}, "model.sliding_window_tokens", "integer >= 0"),
    ],
)
def test_bad_window_figures_name_the_field(changes: dict, setting: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match) as info:
        get_profile("h100-80gb", "gemma-3-27b").with_overrides({"model": changes})
    assert info.value.setting == setting


@pytest.mark.parametrize("share", [-0.1, 1.5, math.nan])
def test_window_share_must_be_a_share(share: float) -> None:
    with pytest.raises(ConfigError, match="window_share"):
        replace(get_profile("h100-80gb", "gemma-3-27b"), window_share=share)
