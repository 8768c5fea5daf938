"""All-gather rounds replay: workload shape, each strategy's costs, its measured inputs and a consistent
capacity search."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from kvtier.errors import ConfigError
from kvtier.replay import rounds as rounds_mod
from kvtier.replay.profiles import parse_profile
from kvtier.replay.rounds import (
    DIFF_MEASURED,
    ROUND_POLICIES,
    RoundsConfig,
    RoundsWorkload,
    capacity,
    format_rounds_table,
    meets_slo,
    prefix_hits,
    round_costs,
    run_rounds,
)

ROOT = Path(__file__).resolve().parents[1]
PROFILE = parse_profile("h100-80gb:llama-3.1-8b")
W = RoundsWorkload(num_agents=4, num_rounds=3, private_tokens=256, observe_tokens=32, output_tokens=64)
KV_PER_TOKEN = PROFILE.model.kv_bytes_per_token * PROFILE.kv_copies
HBM_BW = PROFILE.hardware.hbm_bw_bytes_s * PROFILE.num_chips


def _costs(w: RoundsWorkload, policy: str, cfg: RoundsConfig | None = None):
    return round_costs(w, PROFILE, policy, cfg or RoundsConfig())


def test_agents_see_shared_outputs_in_their_own_orders_so_prefix_caching_misses() -> None:
    orders = W.orders(0)
    assert all(sorted(o) == [j for j in range(4) if j != a] for a, o in enumerate(orders))
    assert len({tuple(o) for o in orders}) > 1 or W.num_agents <= 2
    assert prefix_hits(W, 1) == 0
    blocks = W.agent_blocks(0, 1)
    assert len(blocks) == 256 // 16 + 2 + 4 * (64 // 16)


def test_lru_prefills_every_received_output_and_holds_each_agents_context_once() -> None:
    n, p, o, t = W.num_agents, W.private_tokens, W.observe_tokens, W.output_tokens
    for r, c in enumerate(_costs(W, "lru")):
        received = (n - 1) * t if r else 0
        assert c.prefill_tokens == n * (received + o)
        # one agent's context at the end of round r: private, r + 1 observations and outputs, r rounds received
        assert c.kv_tokens == n * (p + (r + 1) * (o + t) + r * (n - 1) * t)
        assert c.swap_s == c.restore_s == 0.0


def test_diff_constants_are_the_engine_measurement() -> None:
    """DIFF_MEASURED must be what bench/out/engine-shared.json says: a re-measurement that
    changes the JSON fails here until the constants follow it."""
    data = json.loads((ROOT / "bench" / "out" / "engine-shared.json").read_text())
    layers = data["layers"]
    assert len(layers) >= 2
    for key in ("diff_over_raw", "zstd_alone_over_raw"):
        mean = sum(layer[key] for layer in layers) / len(layers)
        assert DIFF_MEASURED[key] == pytest.approx(mean, rel=1e-12, abs=0.0), key
    assert DIFF_MEASURED["source"].startswith("bench/out/engine-shared.json")
    assert data["engine"] in DIFF_MEASURED["source"]


def test_approx_quality_is_the_engine_measurement() -> None:
    """APPROX_QUALITY must be what bench/out/engine-approx.json says (both models)."""
    data = json.loads((ROOT / "bench" / "out" / "engine-approx.json").read_text())
    q = rounds_mod.APPROX_QUALITY
    assert q is not None and q["source"].startswith("bench/out/engine-approx.json") and data["engine"] in q["source"]
    for prefix, model in (("copy_model", "trained"), ("random_model", "random")):
        measured = data["models"][model]["quality"]
        assert q[f"{prefix}_token_agreement"] == measured["token_agreement"], prefix
        assert q[f"{prefix}_max_logprob_diff"] == measured["max_abs_logprob_diff"], prefix


def test_layout_prefills_each_rounds_new_shared_tokens_once() -> None:
    """With a tiny private history the layout's one prefill of the new shared tokens
    beats every agent prefilling every received output."""
    w = replace(W, private_tokens=16)
    n, p, o, t = w.num_agents, w.private_tokens, w.observe_tokens, w.output_tokens
    lay, lru = _costs(w, "layout"), _costs(w, "lru")
    assert lay[0].prefill_tokens == lru[0].prefill_tokens == n * o  # round 0: the same prompts
    assert lay[0].kv_tokens == lru[0].kv_tokens
    for r in range(1, w.num_rounds):
        assert lay[r].prefill_tokens == n * t + n * (p + (r + 1) * o)
        assert lay[r].prefill_tokens < lru[r].prefill_tokens
        assert lay[r].kv_tokens == r * n * t + n * (p + (r + 1) * o + t)  # the shared context held once
        assert lay[r].kv_tokens < lru[r].kv_tokens
        assert lay[r].decode_s == pytest.approx(lru[r].decode_s)  # the same tokens attended


def test_layout_recomputes_every_private_suffix_and_can_lose_to_lru() -> None:
    """Prefix caching reuses only a prefix: after a longer shared context every agent's
    private history is recomputed each round. With the default 2,048-token history that
    costs more than lru's recomputed outputs: a finding the report must show."""
    w = RoundsWorkload(num_agents=8, num_rounds=3)
    n, p = w.num_agents, w.private_tokens
    lay, lru = _costs(w, "layout"), _costs(w, "lru")
    for r in range(1, w.num_rounds):
        assert lay[r].prefill_tokens >= n * p + n * w.output_tokens
        assert lay[r].prefill_tokens > lru[r].prefill_tokens
    cfg = RoundsConfig()
    assert capacity(w, PROFILE, "layout", cfg)["max_agents"] < capacity(w, PROFILE, "lru", cfg)["max_agents"]


def test_diff_stores_mirrors_at_the_measured_fraction_and_prefills_like_lru() -> None:
    n, t = W.num_agents, W.output_tokens
    f = DIFF_MEASURED["diff_over_raw"]
    diff, dram = _costs(W, "diff"), _costs(W, "lru-dram")
    assert diff[0].kv_tokens == dram[0].kv_tokens and diff[0].restore_s == 0.0
    for r in range(W.num_rounds):
        mirrors = n * r * (n - 1) * t  # every received segment every agent holds
        assert diff[r].prefill_tokens == dram[r].prefill_tokens  # lossless: no recompute saved
        assert diff[r].kv_tokens == dram[r].kv_tokens - mirrors + round(f * mirrors)
        assert diff[r].restore_s == pytest.approx(2 * mirrors * KV_PER_TOKEN / HBM_BW)
        if r:
            assert diff[r].kv_tokens < dram[r].kv_tokens and diff[r].round_s > dram[r].round_s


def test_approx_prefills_each_output_once_and_loads_it_over_the_host_link() -> None:
    """As the connector does it: the first receiver of each output computes it (the
    master, written through to DRAM), every other receiver loads it re-rotated."""
    n, o, t = W.num_agents, W.observe_tokens, W.output_tokens
    approx, dram = _costs(W, "approx"), _costs(W, "lru-dram")
    for r in range(W.num_rounds):
        once = n * t if r else 0
        assert approx[r].prefill_tokens == n * o + once
        assert approx[r].kv_tokens == dram[r].kv_tokens  # an engine's blocks belong to one request
        loaded = n * (n - 1) * t - once if r else 0  # every receiver but the one that computed it
        assert approx[r].restore_s == pytest.approx(PROFILE.transfer_time_s(loaded * KV_PER_TOKEN, "dram->hbm")
                                                    + PROFILE.transfer_time_s(once * KV_PER_TOKEN, "hbm->dram"))
        if r:
            assert approx[r].prefill_tokens < dram[r].prefill_tokens
    assert approx[-1].prefill_s < dram[-1].prefill_s


def test_overflow_is_recomputed_by_lru_and_swapped_by_the_other_strategies() -> None:
    small = PROFILE.with_overrides({"hardware": {"hbm_bytes": 19 * 2**30}})  # ~ a few thousand KV tokens
    big = replace(W, num_agents=32, private_tokens=2048)
    lru = round_costs(big, small, "lru", RoundsConfig())[-1]
    assert lru.overflow_tokens > 0 and lru.swap_s == 0.0
    for policy in ("lru-dram", "layout", "diff", "approx"):
        other = round_costs(big, small, policy, RoundsConfig())[-1]
        assert other.overflow_tokens > 0 and other.swap_s > 0.0, policy
        assert other.prefill_tokens == _costs(big, policy)[-1].prefill_tokens, policy  # swapped, not recomputed
    assert lru.prefill_tokens > round_costs(big, small, "lru-dram", RoundsConfig())[-1].prefill_tokens


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
    assert by["approx"] >= by["lru-dram"] >= by["lru"]
    for policy in ("layout", "diff", "approx"):
        for base in ("lru", "lru-dram"):
            assert report["ratios"][f"{policy}_vs_{base}"] == by[policy] / by[base]
    assert len(report["ratios"]) == 6


def test_tighter_slo_never_admits_more_agents() -> None:
    for policy in ROUND_POLICIES:
        loose = capacity(W, PROFILE, policy, RoundsConfig(slo_round_s=3.0))["max_agents"]
        tight = capacity(W, PROFILE, policy, RoundsConfig(slo_round_s=0.8))["max_agents"]
        assert tight <= loose, policy


def test_a_smaller_hbm_costs_lru_agents_first() -> None:
    """HBM capacity binds: lru recomputes what does not fit, the other strategies swap it,
    so lru loses agents first as HBM shrinks; diff's smaller mirrors never cost agents."""
    w = RoundsWorkload(num_agents=1, num_rounds=4, output_tokens=32)
    caps = {}
    for hbm in (None, 4000, 1000):
        cfg = RoundsConfig(hbm_blocks=hbm)
        caps[hbm] = {p: capacity(w, PROFILE, p, cfg)["max_agents"] for p in ROUND_POLICIES}
    assert caps[None]["lru"] > caps[4000]["lru"] > caps[1000]["lru"]
    assert caps[None]["lru"] == caps[None]["lru-dram"]  # roomy HBM: nothing overflows
    for hbm in (4000, 1000):
        assert caps[hbm]["lru-dram"] > caps[hbm]["lru"]
        assert caps[hbm]["diff"] >= caps[hbm]["lru-dram"]
    ratios = [caps[h]["lru-dram"] / caps[h]["lru"] for h in (None, 4000, 1000)]
    assert ratios[0] < ratios[1] < ratios[2]
    assert all(caps[h]["approx"] > caps[h]["lru-dram"] for h in caps)  # approx also swaps its full copies
    report = run_rounds(w, PROFILE, ("lru",), RoundsConfig(hbm_blocks=1000))
    assert report["hbm_kv_tokens"] == 1000 * w.block_size


def test_report_labels_approx_and_carries_the_measured_inputs(monkeypatch) -> None:
    report = run_rounds(W, PROFILE, ROUND_POLICIES, RoundsConfig())
    rows = {r["policy"]: r for r in report["capacity"]}
    assert rows["approx"]["approximate"] and rows["approx"]["label"] == "approx (approximate)"
    assert not any(rows[p]["approximate"] for p in ROUND_POLICIES if p != "approx")
    assert report["diff_measured"] == DIFF_MEASURED
    assert "approx_quality" in report and report["approx_quality"] == rounds_mod.APPROX_QUALITY
    text = format_rounds_table(report)
    assert "approx (approximate)" in text and "approx_vs_lru (approximate)" in text
    assert f"{DIFF_MEASURED['diff_over_raw']:.3f}" in text and f"{DIFF_MEASURED['zstd_alone_over_raw']:.3f}" in text
    monkeypatch.setattr(rounds_mod, "APPROX_QUALITY", None)
    assert "approx (approximate): quality: not measured" in format_rounds_table(
        run_rounds(W, PROFILE, ("approx",), RoundsConfig()))
    quality = {"greedy_token_agreement": 0.5, "source": "a test"}
    monkeypatch.setattr(rounds_mod, "APPROX_QUALITY", quality)
    report = run_rounds(W, PROFILE, ("lru", "approx"), RoundsConfig())
    assert report["approx_quality"] == quality
    assert "approx (approximate): quality: greedy_token_agreement 0.5, source a test" in format_rounds_table(report)
    assert "diff:" not in format_rounds_table(report)  # no diff row, no diff inputs line


def test_plot_labels_approx_as_approximate(tmp_path, monkeypatch) -> None:
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    figs = []
    monkeypatch.setattr(plt, "close", figs.append)
    report = run_rounds(W, PROFILE, ("lru", "approx"), RoundsConfig())
    rounds_mod.plot_rounds(report, str(tmp_path / "rounds.png"))
    labels = [t.get_text() for t in figs[0].axes[0].get_legend().get_texts()]
    assert any(label.startswith("approx (approximate)") for label in labels)
    assert (tmp_path / "rounds.png").stat().st_size > 0


def test_bad_settings_name_the_setting() -> None:
    with pytest.raises(ConfigError, match="rounds.hbm_blocks"):
        RoundsConfig(hbm_blocks=0)
    with pytest.raises(ConfigError, match="rounds.slo_round_s"):
        RoundsConfig(slo_round_s=0)
    with pytest.raises(ConfigError, match="rounds.output_tokens"):
        RoundsWorkload(output_tokens=10)
    for bad in ("fifo", "kvtier"):  # kvtier's assumed master + mirror model is gone
        with pytest.raises(ConfigError, match="rounds.policy.*layout.*diff.*approx"):
            round_costs(W, PROFILE, bad, RoundsConfig())


def test_cli_replay_rounds_writes_json(tmp_path, capsys) -> None:
    from kvtier.cli import main

    out = tmp_path / "rounds.json"
    assert main(["replay", "--workload", "rounds", "--rounds", "2", "--private-tokens", "256", "--quiet",
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["profile"] == "h100-80gb:llama-3.1-8b:1" and report["config"]["slo_round_s"] == 1.5
    assert [r["policy"] for r in report["capacity"]] == list(ROUND_POLICIES)
    assert report["diff_measured"] == DIFF_MEASURED
    text = capsys.readouterr().out
    assert "layout_vs_lru" in text and "diff_vs_lru-dram" in text and "approx (approximate)" in text


def test_cli_replay_rounds_policies_and_removed_flags(capsys) -> None:
    from kvtier.cli import main

    assert main(["replay", "--workload", "rounds", "--rounds", "2", "--policies", "lru,layout", "--quiet"]) == 0
    assert "layout_vs_lru" in capsys.readouterr().out
    assert main(["replay", "--workload", "rounds", "--policies", "lru,kvtier", "--quiet"]) == 2
    assert "rounds.policy" in capsys.readouterr().err
    for flag in ("--recompute-fraction", "--diff-block-fraction"):
        with pytest.raises(SystemExit) as e:
            main(["replay", "--workload", "rounds", flag, "0.2"])
        assert e.value.code == 2


def test_cli_replay_rounds_help_explains_the_strategies(capsys) -> None:
    from kvtier.cli import main

    with pytest.raises(SystemExit):
        main(["replay", "--workload", "rounds", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for words in ("lru-dram", "layout", "RoundLayout", "master + lossless diff", "approx", "APPROXIMATE"):
        assert words in text, words


def test_cli_replay_rounds_takes_one_hbm_capacity(capsys) -> None:
    from kvtier.cli import main

    assert main(["replay", "--workload", "rounds", "--hbm-fraction", "0.5", "--quiet"]) == 2
    assert "takes one --hbm-blocks N" in capsys.readouterr().err
