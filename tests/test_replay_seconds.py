"""The replay in seconds (issue 57): a profile fitted to measured timings, the API's per-request overhead in
TTFT, a recording replayed from its recorded starts, and the bench that compares them with the engine."""

from __future__ import annotations

import json
import random
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from kvtier.errors import ConfigError
from kvtier.placement import make_placement
from kvtier.recording.requests import RequestRecorder
from kvtier.replay import load_trace
from kvtier.replay.calibrate import Timing, fit_profile, fitted_profile, model_profile, write_profile
from kvtier.replay.model import Agent, Request, Session, Workload
from kvtier.replay.profiles import load_profile_overrides
from kvtier.replay.sim import SimConfig, Simulator

ROOT = Path(__file__).resolve().parents[1]
SHAPE = model_profile("m", layers=12, hidden=1024, heads=16, kv_heads=2, intermediate=2816, vocab=1000,
                      dtype="float32")


def _timings(truth, noise: float, seed: int = 0) -> list[Timing]:
    rng = random.Random(seed)
    out = [Timing("prefill", n, 0, 1, (truth.hardware.request_overhead_s + truth.step_time_s(n, 0, 0, 0))
                  * (1 + rng.uniform(-noise, noise))) for n in (96, 256, 512, 1024, 1400) for _ in range(2)]
    out += [Timing("decode", 0, ctx, b, truth.step_time_s(0, 0, b, ctx) * (1 + rng.uniform(-noise, noise)))
            for b, ctx in ((1, 150), (1, 1050), (4, 1700), (8, 1800)) for _ in range(2)]
    return out


def test_the_fit_recovers_the_figures_that_made_the_timings_through_noise() -> None:
    truth = fitted_profile(SHAPE, flops=8e10, hbm_bw=1.5e10, step_s=0.012, request_s=0.02, hbm_blocks=80,
                           block_size=32)
    fit = fit_profile(SHAPE, _timings(truth, noise=0.03), hbm_blocks=80, block_size=32)
    hw = fit.profile.hardware
    assert hw.peak_flops == pytest.approx(8e10, rel=0.1)
    assert hw.request_overhead_s == pytest.approx(0.02, abs=0.02)
    assert fit.max_relative_error < 0.08  # the noise, not the model
    # what the profile predicts for a step it was not fitted to: a long prefill after a cached prefix
    assert fit.profile.step_time_s(700, 600, 0, 0) == pytest.approx(truth.step_time_s(700, 600, 0, 0), rel=0.1)
    assert fit.profile.hbm_kv_capacity_blocks(32) == 80  # the engine's KV cache, beside the weights


def test_too_few_timings_and_bad_ones_are_refused_by_name() -> None:
    truth = fitted_profile(SHAPE, flops=8e10, hbm_bw=1.5e10, step_s=0.01, request_s=0.0, hbm_blocks=80, block_size=32)
    only_prefill = [t for t in _timings(truth, 0.0) if t.kind == "prefill"]
    with pytest.raises(ConfigError, match="two decode timings"):
        fit_profile(SHAPE, only_prefill, hbm_blocks=80, block_size=32)
    with pytest.raises(ConfigError, match="timing.kind"):
        Timing("load", 1, 0, 1, 0.1)
    with pytest.raises(ConfigError, match="timing.seconds"):
        Timing("decode", 0, 10, 1, 0.0)
    with pytest.raises(ConfigError, match="dtype"):
        model_profile("m", layers=1, hidden=64, heads=1, kv_heads=1, intermediate=64, vocab=10, dtype="int3")


def test_the_written_profile_is_the_profile_kvtier_replay_reads_back(tmp_path: Path) -> None:
    p = fitted_profile(SHAPE, flops=8e10, hbm_bw=1.5e10, step_s=0.012, request_s=0.02, hbm_blocks=80, block_size=32,
                       host_link=(1e-4, 1.3e10), name="here")
    path = write_profile(p, tmp_path / "p.yaml", {"fitted by": "a test"})
    assert path.read_text().startswith("# fitted by: a test\n")
    back = load_profile_overrides(path)
    assert back == p and back.hardware.request_overhead_s == 0.02
    assert back.transfer_time_s(1.3e10, "dram->hbm") == pytest.approx(1.0001)


def _two_turns(sid: str) -> Session:
    reqs = (Request(0, 256, 4, (1, 2, 3, 4), 0.0, "start", "tool_use", 0.0),
            Request(1, 320, 4, (1, 2, 3, 4, 5), 1.0, "tool", "end_turn", 0.0))
    return Session(sid, (Agent("root", None, "main", reqs),))


def test_the_request_overhead_is_in_every_ttft_and_nowhere_else() -> None:
    w = Workload("w", 64, (_two_turns("a"), _two_turns("b")), False)
    base = fitted_profile(SHAPE, flops=8e10, hbm_bw=1.5e10, step_s=0.01, request_s=0.0, hbm_blocks=80,
                          block_size=64)
    slow = replace(base, hardware=replace(base.hardware, request_overhead_s=0.25))
    runs = [Simulator(w, SimConfig(hbm_blocks=80, conc=2), make_placement("lru"), p).run() for p in (base, slow)]
    for a, b in zip(runs[0].records, runs[1].records):
        assert b.ttft_s == pytest.approx(a.ttft_s + 0.25)
        assert (b.first_token_s, b.finish_s, b.computed_tokens) == (a.first_token_s, a.finish_s, a.computed_tokens)
    assert runs[0].makespan_s == runs[1].makespan_s


def test_a_recording_replays_from_its_recorded_starts(tmp_path: Path) -> None:
    rec = RequestRecorder(tmp_path, block_size=64, model="m")
    for sid, t in (("s1", 100.0), ("s2", 105.0)):
        rec.arrived(f"{sid}-1", sid, "root", 256, [1, 2, 3, 4], now=t)
        rec.finished(f"{sid}-1", 4, tool_wait=True, now=t + 0.5)
        rec.arrived(f"{sid}-2", sid, "root", 320, [1, 2, 3, 4, 5], now=t + 2.5)
        rec.finished(f"{sid}-2", 4, tool_wait=False, now=t + 3.0)
    rec.close()
    w = load_trace(tmp_path)
    profile = fitted_profile(SHAPE, flops=8e10, hbm_bw=1.5e10, step_s=0.01, request_s=0.0, hbm_blocks=80,
                             block_size=64)

    def firsts(cfg: SimConfig) -> dict[str, float]:
        res = Simulator(w, cfg, make_placement("lru"), profile).run()
        return {w.sessions[r.session].session_id: r.ready_s for r in res.records if r.index == 0}

    assert firsts(SimConfig(hbm_blocks=80, conc=2)) == {"s1:root": 0.0, "s2:root": 0.0}  # conc at once
    assert firsts(SimConfig(hbm_blocks=80, recorded_starts=True)) == {"s1:root": 0.0, "s2:root": 5.0}
    unrecorded = Workload("w", 64, (_two_turns("a"),), False)
    with pytest.raises(ConfigError, match="recorded_starts.*'a' has no recorded start"):
        Simulator(unrecorded, SimConfig(hbm_blocks=80, recorded_starts=True), make_placement("lru"), profile).run()


def test_kvtier_replay_takes_recorded_starts_max_running_and_a_fitted_profile(tmp_path: Path, capsys) -> None:
    from kvtier.cli import main

    rec = tmp_path / "rec"
    r = RequestRecorder(rec, block_size=32, model="m")
    for i in range(3):
        r.arrived(f"q{i}", f"s{i}", "root", 200, [1, 2, 3, 4, 5, 6], now=10.0 + i)
        r.finished(f"q{i}", 8, tool_wait=False, now=10.5 + i)
    r.close()
    prof = write_profile(fitted_profile(SHAPE, flops=8e10, hbm_bw=1.5e10, step_s=0.01, request_s=0.05,
                                        hbm_blocks=80, block_size=32), tmp_path / "p.yaml")
    base = ["replay", "--trace", str(rec), "--profile-file", str(prof), "--hbm-blocks", "80", "--dram-blocks", "0",
            "--policies", "lru", "--no-references", "--quiet", "--jobs", "1"]
    out = tmp_path / "r.json"
    assert main(base + ["--recorded-starts", "--max-running", "1", "--scheduler", "vllm", "--json", str(out)]) == 0
    row = json.loads(out.read_text())["results"][0]
    assert row["num_requests"] == 3 and row["ttft_p50_s"] >= 0.05  # the request overhead is in every TTFT
    assert row["makespan_s"] >= 2.0  # the third session started 2 s after the first
    capsys.readouterr()
    assert main(base + ["--recorded-starts", "--engines", "2"]) == 2
    assert "--recorded-starts" in capsys.readouterr().err


def test_the_bench_compares_each_figure_with_its_target_and_renders(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import replay_seconds as rs
    finally:
        sys.path.remove(str(ROOT / "bench"))
    measured = {"later_ttft_p50_s": 1.0, "later_ttft_p99_s": 4.0, "later_ttft_mean_s": 1.5, "makespan_s": 30.0,
                "prefill_computed_tokens": 10_000.0}
    close = rs.compare(measured, {**measured, "later_ttft_p50_s": 1.15, "prefill_computed_tokens": 10_150})
    assert close["within_target"] == {"prefill_computed_tokens": True, "later_ttft_p50_s": True,
                                      "later_ttft_p99_s": True}
    far = rs.compare(measured, {**measured, "later_ttft_p99_s": 5.0, "prefill_computed_tokens": 10_300})
    assert far["within_target"] == {"prefill_computed_tokens": False, "later_ttft_p50_s": True,
                                    "later_ttft_p99_s": False}
    assert far["error"]["later_ttft_p99_s"] == pytest.approx(0.25)
    data = {"configs": {"none": close, "sdk": far}}
    (tmp_path / "d.json").write_text(json.dumps(data))
    table = rs.render(data)
    assert "+15.0%" in table and "+25.0%" in table and "+3.0%" in table
    pytest.importorskip("matplotlib")
    assert rs.main(["--plot", str(tmp_path / "d.json"), "--png", str(tmp_path / "d.png")]) == 0
    assert (tmp_path / "d.png").stat().st_size > 0


def test_the_answer_blocks_a_recording_names_are_cached_and_hit_only_where_the_next_prompt_has_them(
        tmp_path: Path) -> None:
    profile = fitted_profile(SHAPE, flops=8e10, hbm_bw=1.5e10, step_s=0.01, request_s=0.0, hbm_blocks=80,
                             block_size=64)

    def second_turn_hits(next_ids: tuple[int, ...], answer: tuple[int, ...] | None) -> int:
        reqs = (Request(0, 256, 140, (1, 2, 3, 4), 0.0, "start", "tool_use", 0.0, answer_block_ids=answer),
                Request(1, 64 * len(next_ids) + 10, 4, next_ids, 1.0, "tool", "end_turn", 0.0))
        w = Workload("w", 64, (Session("s", (Agent("root", None, "main", reqs),)),), False)
        res = Simulator(w, SimConfig(hbm_blocks=80, conc=1), make_placement("lru"), profile).run()
        return next(r.hit_hbm_tokens for r in res.records if r.index == 1)

    # the answer (140 tokens) filled blocks 5 and 6 after the prompt's 4
    assert second_turn_hits((1, 2, 3, 4, 5, 6, 7), None) == 6 * 64  # not recorded: the next prompt's are the answer's
    assert second_turn_hits((1, 2, 3, 4, 5, 6, 7), (5, 6)) == 6 * 64  # recorded and re-sent as generated
    assert second_turn_hits((1, 2, 3, 4, 8, 9, 7), (5, 6)) == 4 * 64  # recorded, but the next prompt re-rendered it


def test_the_recorder_writes_the_answer_blocks_and_the_reader_maps_them_with_the_prompts(tmp_path: Path) -> None:
    rec = RequestRecorder(tmp_path, block_size=16, model="m")
    rec.arrived("a1", "s", "a", 40, [11, 12], now=1.0)
    rec.finished("a1", 30, tool_wait=True, now=2.0, answer_keys=[13, 14])
    rec.arrived("a2", "s", "a", 80, [11, 12, 13, 99, 15], now=3.0)
    rec.finished("a2", 2, tool_wait=False, now=4.0, answer_keys=[])
    rec.arrived("a3", "s", "a", 90, [11, 12, 13, 99, 15], now=5.0)
    rec.finished("a3", 2, tool_wait=False, now=6.0)  # not known: left out, and the replay infers them
    rec.close()
    obj = json.loads(next(tmp_path.glob("*.json")).read_text())
    r1, r2, r3 = obj["requests"]
    assert len(r1["out_hash_ids"]) == 2 and r2["out_hash_ids"] == [] and "out_hash_ids" not in r3
    assert r1["out_hash_ids"][0] == r2["hash_ids"][2] and r1["out_hash_ids"][1] != r2["hash_ids"][3]
    reqs = load_trace(tmp_path).sessions[0].root.requests
    assert len(reqs[0].answer_block_ids) == 2 and reqs[1].answer_block_ids == () and reqs[2].answer_block_ids is None
    assert reqs[0].answer_block_ids[0] == reqs[1].block_ids[2]  # equal keys, equal ids, as for prompts
    assert reqs[0].answer_block_ids[1] != reqs[1].block_ids[3]


def test_a_request_that_arrives_during_a_step_is_ready_from_its_arrival() -> None:
    profile = fitted_profile(SHAPE, flops=8e10, hbm_bw=1.5e10, step_s=0.01, request_s=0.0, hbm_blocks=80,
                             block_size=64)
    long = Request(0, 1400, 2, tuple(range(1, 22)), 0.0, "start", "end_turn", 0.0)
    short = Request(0, 128, 2, (100, 101), 0.0, "start", "end_turn", 0.0)
    w = Workload("w", 64, (Session("a", (Agent("root", None, "main", (long,)),), recorded_at_s=50.0),
                           Session("b", (Agent("root", None, "main", (short,)),), recorded_at_s=51.0)), False)
    res = Simulator(w, SimConfig(hbm_blocks=80, recorded_starts=True), make_placement("lru"), profile).run()
    a, b = sorted(res.records, key=lambda r: r.session)
    step = profile.step_time_s(1400, 0, 0, 0)
    assert step > 2.0 and a.first_token_s == pytest.approx(step)  # b arrived 1 s into a's prefill step ...
    assert b.ready_s == 1.0 and b.ttft_s > step - 1.0  # ... and waited out the rest of it
