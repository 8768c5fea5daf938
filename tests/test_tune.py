"""kvtier tune (issue 25): tunable placement constants, the split of a recording by
time, the successive-halving search, and the config file it writes, which
``kvtier replay --config`` replays."""

from __future__ import annotations

import doctest
import json
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

import kvtier.placement.params as params_mod
from kvtier.cli import main
from kvtier.config import load_config
from kvtier.errors import ConfigError
from kvtier.placement import make_placement
from kvtier.replay import load_trace
from kvtier.replay.generator import generate_coding_sessions, write_traces
from kvtier.replay.profiles import DEFAULT_PROFILE, parse_profile
from kvtier.recording.requests import RequestRecorder
from kvtier.replay.run import CONFIG, ReplaySpec, run_point
from kvtier.replay.tune import Candidate, candidates, split_for_tuning, tune


def test_params_doctest_and_knobs_reach_the_policy() -> None:
    assert doctest.testmod(params_mod).failed == 0
    p = make_placement("kvtier", params={"prefetch_lead_factor": 3.0, "rho_min": 0.1, "rho_max": 0.2,
                                          "critical_at": 0.5, "demote_after_s": 30})
    assert p.lead_s(1.0) == pytest.approx(0.05 + 3.0) and make_placement("kvtier").lead_s(1.0) == pytest.approx(1.55)
    assert (p.rho_bounds, p.rho, p.critical_at, p.demote_after_s) == ((0.1, 0.2), 0.1, 0.5, 30.0)
    assert make_placement("kvflow", params={"prefetch_lead_factor": 2.0}).lead_s(1.0) == pytest.approx(2.0)
    with pytest.raises(ConfigError, match="placement.speed=1: unknown knob"):
        make_placement("kvtier", params={"speed": 1})
    with pytest.raises(ConfigError, match="placement.rho_min=0.5: gives an empty reserve range"):
        make_placement("kvtier", params={"rho_min": 0.5})


def _recording(tmp: Path, n: int) -> Path:
    """A recorder's directory with ``n`` one-request sessions, session i starting at 100 + i."""
    rec = RequestRecorder(tmp, block_size=16)
    for i in range(n):
        rec.arrived(f"r{i}", f"s{n - i:02d}", "a", 64, [i, i + 1, i + 2], now=100.0 + i)
        rec.finished(f"r{i}", 4, tool_wait=False, now=100.5 + i)
    rec.close()
    return tmp


def test_the_holdout_is_the_latest_part_of_a_recording(tmp_path: Path) -> None:
    w = load_trace(_recording(tmp_path, 8))
    tune_part, held = split_for_tuning(w, 0.25)
    assert [s.session_id for s in held.sessions] == ["s02:a", "s01:a"]  # the last two to start, not by name
    assert len(tune_part.sessions) == 6 and not {s.session_id for s in tune_part.sessions} & {"s02:a", "s01:a"}
    tune_half, eval_half = split_for_tuning(w, "split")
    assert len(tune_half.sessions) == len(eval_half.sessions) == 4
    for bad in (0.0, 1.0, "0.5"):
        with pytest.raises(ConfigError, match="--holdout"):
            split_for_tuning(w, bad)


def test_candidates_start_with_the_defaults_and_do_not_repeat() -> None:
    cands = candidates(("kvtier", "lru-dram"), ("next_use_trust", "rho_min", "rho_max"), 12, seed=3)
    assert cands[:2] == [Candidate("kvtier"), Candidate("lru-dram")]
    assert len(cands) == 12 == len(set(cands))
    assert all(c.policy == "kvtier" for c in cands[2:])  # lru-dram has no knobs
    assert all(dict(c.params).get("rho_min", 0) <= dict(c.params).get("rho_max", 1) for c in cands)
    assert len(candidates(("kvtier",), ("critical_at",), 50, seed=0)) == 4  # defaults + a grid of 3
    with pytest.raises(ConfigError, match="--knobs"):
        candidates(("kvtier",), ("speed",), 4, seed=0)


@pytest.fixture(scope="module")
def gen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("gen")
    write_traces(d, generate_coding_sessions(12, seed=1))
    return d


def test_the_search_halves_keeps_the_best_and_checks_it_on_the_holdout(gen_dir: Path) -> None:
    w = load_trace(gen_dir)
    tune_part, held = split_for_tuning(w, 0.25)
    spec = ReplaySpec(workload=w, profile=parse_profile(DEFAULT_PROFILE), concs=(4,), hbm_blocks=(2000,),
                      skip_oversized=True, references=False)
    cands = [Candidate("kvtier"), Candidate("lru-dram"), Candidate("kvtier", (("next_use_trust", 4.0),)),
             Candidate("tokencake")]
    result = tune(spec, tune_part, held, cands, "prefill", 4, 2000, eta=2, rungs=2, budget_s=600)
    assert [len(r) for r in result.rungs] == [4, 2]
    assert result.rungs[0][0]["sessions"] < result.rungs[1][0]["sessions"] == len(tune_part.sessions)
    finals = {e["candidate"]: e["value"] for e in result.rungs[1]}
    assert result.best.describe() in finals and finals[result.best.describe()] == min(finals.values())
    # the figures are what the replay gives for that candidate, on each part
    direct = run_point(replace(spec, workload=held, config_policy=result.best.policy,
                               config_params=dict(result.best.params)), CONFIG, 4, 2000)
    assert result.holdout["best"]["prefill_tokens_computed"] == direct["prefill_tokens_computed"]
    assert result.holdout["sessions"] == len(held.sessions) and result.default == Candidate("kvtier")


def test_a_spent_budget_starts_no_new_rung(gen_dir: Path) -> None:
    w = load_trace(gen_dir)
    tune_part, held = split_for_tuning(w, 0.25)
    spec = ReplaySpec(workload=w, profile=parse_profile(DEFAULT_PROFILE), concs=(4,), hbm_blocks=(2000,),
                      skip_oversized=True, references=False)
    cands = [Candidate("kvtier"), Candidate("lru-dram"), Candidate("tokencake")]
    result = tune(spec, tune_part, held, cands, "ttft-p99", 4, 2000, rungs=3, budget_s=1e-9)
    assert result.stopped_by_budget and len(result.rungs) == 1 and result.best in cands


def test_tune_writes_a_config_that_replay_and_load_config_take(gen_dir: Path, tmp_path: Path, capsys) -> None:
    out, js, png = tmp_path / "tuned.yaml", tmp_path / "tune.json", tmp_path / "tune.png"
    rc = main(["tune", "--trace", str(gen_dir), "--hbm-blocks", "2000", "--skip-oversized", "--conc", "4",
               "--candidates", "4", "--rungs", "2", "--jobs", "2", "--quiet", "--out", str(out), "--json", str(js),
               "--plot", str(png)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "best: kvtier" in printed and "held out, the last 25% of sessions by start time" in printed
    cfg = load_config(out, env={})
    report = json.loads(js.read_text())
    assert cfg.placement.policy == "kvtier" and cfg.tuned.objective == "prefill" and cfg.tuned.trace == str(gen_dir)
    assert report["best"].startswith("kvtier") and len(report["rungs"]) == 2 and png.stat().st_size > 10_000
    best_params = yaml.safe_load(out.read_text())["placement"]
    assert {k: v for k, v in best_params.items() if k != "policy"} == cfg.placement.params()
    rc = main(["replay", "--trace", str(gen_dir), "--config", str(out), "--policies", "lru-dram", "--conc", "4",
               "--hbm-blocks", "2000", "--skip-oversized", "--no-references", "--quiet", "--json",
               str(tmp_path / "r.json")])
    assert rc == 0
    rows = {r["policy"] for r in json.loads((tmp_path / "r.json").read_text())["results"]}
    assert rows == {"lru-dram", "config"}


def test_replay_config_policy_needs_a_config_file(gen_dir: Path, capsys) -> None:
    rc = main(["replay", "--trace", str(gen_dir), "--policies", "config", "--quiet"])
    assert rc == 2 and "give --config FILE" in capsys.readouterr().err
