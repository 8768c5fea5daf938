"""All-gather rounds replay: workload shape, costs and a consistent capacity search."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvtier.errors import ConfigError
from kvtier.replay.profiles import parse_profile
from kvtier.replay.rounds import (
    ROUND_POLICIES,
    RoundsConfig,
    RoundsWorkload,
    capacity,
    meets_slo,
    prefix_hits,
    round_costs,
    run_rounds,
)

PROFILE = parse_profile("h100-80gb:llama-3.1-8b")
W = RoundsWorkload(num_agents=4, num_rounds=3, private_tokens=256, observe_tokens=32, output_tokens=64)


def test_agents_see_shared_outputs_in_their_own_orders_so_prefix_caching_misses() -> None:
    orders = W.orders(0)
    assert all(sorted(o) == [j for j in range(4) if j != a] for a, o in enumerate(orders))
    assert len({tuple(o) for o in orders}) > 1 or W.num_agents <= 2
    assert prefix_hits(W, 1) == 0
    blocks = W.agent_blocks(0, 1)
    assert len(blocks) == 256 // 16 + 2 + 4 * (64 // 16)


def test_kvtier_prefills_less_and_holds_less_kv_than_full_copies() -> None:
    cfg = RoundsConfig()
    lru, kv = round_costs(W, PROFILE, "lru", cfg), round_costs(W, PROFILE, "kvtier", cfg)
    assert lru[0].prefill_tokens == kv[0].prefill_tokens  # round 0 gathers nothing yet
    for a, b in zip(lru[1:], kv[1:]):
        assert b.prefill_tokens < a.prefill_tokens and b.kv_tokens < a.kv_tokens
    # recomputing everything and materialising every block is exactly full copies
    same = RoundsConfig(recompute_fraction=1.0, diff_block_fraction=1.0)
    assert [c.prefill_tokens for c in round_costs(W, PROFILE, "kvtier", same)] == [c.prefill_tokens for c in lru]


def test_overflow_is_recomputed_by_lru_and_swapped_by_the_dram_strategies() -> None:
    small = PROFILE.with_overrides({"hardware": {"hbm_bytes": 19 * 2**30}})  # ~ a few thousand KV tokens
    big = replace(W, num_agents=32, private_tokens=2048)
    lru = round_costs(big, small, "lru", RoundsConfig())[-1]
    dram = round_costs(big, small, "lru-dram", RoundsConfig())[-1]
    assert lru.overflow_tokens > 0 and lru.swap_s == 0.0 and lru.prefill_tokens > dram.prefill_tokens
    assert dram.swap_s > 0.0


@pytest.mark.parametrize("latency", ["full", "ttft"])
def test_capacity_search_is_consistent(latency: str) -> None:
    cfg = RoundsConfig(latency=latency)
    for policy in ROUND_POLICIES:
        row = capacity(W, PROFILE, policy, cfg, max_agents=256)
        n = row["max_agents"]
        assert n >= 2
        assert meets_slo(replace(W, num_agents=n), PROFILE, policy, cfg)
        assert not meets_slo(replace(W, num_agents=n + 1), PROFILE, policy, cfg)
        pts = {p["num_agents"]: p for p in row["points"]}
        assert pts[n]["meets_slo"] and not pts[n + 1]["meets_slo"]
    report = run_rounds(W, PROFILE, ROUND_POLICIES, cfg)
    by = {r["policy"]: r["max_agents"] for r in report["capacity"]}
    assert by["kvtier"] >= by["lru"] and report["ratios"]["kvtier_vs_lru"] == by["kvtier"] / by["lru"]


def test_tighter_slo_never_admits_more_agents() -> None:
    loose = capacity(W, PROFILE, "kvtier", RoundsConfig(slo_round_s=3.0))["max_agents"]
    tight = capacity(W, PROFILE, "kvtier", RoundsConfig(slo_round_s=0.8))["max_agents"]
    assert tight <= loose


def test_a_smaller_hbm_costs_lru_agents_first() -> None:
    """HBM capacity binds: lru recomputes what does not fit, kvtier's masters and
    mirrors hold less KV, so the capacity ratio grows as HBM shrinks (it never
    shrinks lru's capacity below what a larger HBM allows, nor raises it)."""
    w = RoundsWorkload(num_agents=1, num_rounds=4, output_tokens=32)
    caps = {}
    for hbm in (None, 4000, 1000):
        cfg = RoundsConfig(hbm_blocks=hbm)
        caps[hbm] = {p: capacity(w, PROFILE, p, cfg)["max_agents"] for p in ("lru", "kvtier")}
    assert caps[None]["lru"] >= caps[4000]["lru"] >= caps[1000]["lru"]
    ratios = [caps[h]["kvtier"] / caps[h]["lru"] for h in (None, 4000, 1000)]
    assert ratios[0] < ratios[1] < ratios[2]
    report = run_rounds(w, PROFILE, ("lru",), RoundsConfig(hbm_blocks=1000))
    assert report["hbm_kv_tokens"] == 1000 * w.block_size


def test_bad_settings_name_the_setting() -> None:
    with pytest.raises(ConfigError, match="rounds.hbm_blocks"):
        RoundsConfig(hbm_blocks=0)
    with pytest.raises(ConfigError, match="rounds.slo_round_s"):
        RoundsConfig(slo_round_s=0)
    with pytest.raises(ConfigError, match="rounds.output_tokens"):
        RoundsWorkload(output_tokens=10)
    with pytest.raises(ConfigError, match="rounds.policy"):
        round_costs(W, PROFILE, "fifo", RoundsConfig())


def test_cli_replay_rounds_writes_json(tmp_path, capsys) -> None:
    import json

    from kvtier.cli import main

    out = tmp_path / "rounds.json"
    assert main(["replay", "--workload", "rounds", "--rounds", "2", "--private-tokens", "256", "--quiet",
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["profile"] == "h100-80gb:llama-3.1-8b:1" and report["config"]["slo_round_s"] == 1.5
    assert {r["policy"] for r in report["capacity"]} == set(ROUND_POLICIES)
    assert "kvtier_vs_lru" in capsys.readouterr().out


def test_cli_replay_rounds_takes_one_hbm_capacity(capsys) -> None:
    from kvtier.cli import main

    assert main(["replay", "--workload", "rounds", "--hbm-fraction", "0.5", "--quiet"]) == 2
    assert "takes one --hbm-blocks N" in capsys.readouterr().err
