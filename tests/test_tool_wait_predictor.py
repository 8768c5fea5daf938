"""bench/tool_wait_predictor.py: the scoring on a hand-built workload whose answer is known, and the
real run's invariants on the dev traces (skipped when ../shared/traces is absent)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from kvtier.placement.base import UNPREDICTED_GAP_S
from kvtier.replay.model import Agent, Request, Session, Workload

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT.parent / "shared" / "traces"


@pytest.fixture(scope="module")
def twp():
    spec = importlib.util.spec_from_file_location("tool_wait_predictor", ROOT / "bench" / "tool_wait_predictor.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve their module by name
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.modules.pop(spec.name, None)
    return mod


def _agent(agent_id: str, agent_type: str, gaps: list[float], parent: str | None = None,
           spawn_after: int | None = None) -> Agent:
    """An agent whose request 0 starts at 0 and each later request follows a tool wait of ``gaps[i]``
    after the previous one (which takes 1 s to answer)."""
    reqs = [Request(0, 64, 1, (), 0.0, "start", "tool_use", 0.0, api_time_s=1.0)]
    at = 0.0
    for i, g in enumerate(gaps, 1):
        at += 1.0 + g
        reqs.append(Request(i, 64, 1, (), g, "tool", "tool_use", at, api_time_s=1.0))
    return Agent(agent_id, parent, agent_type, tuple(reqs), spawn_after)


def test_one_tool_always_two_seconds(twp):
    w = Workload("hand", 64, (Session("s", (_agent("root", "main", [2.0] * 6),)),), False)
    waits, rule = twp.collect_waits(w)
    assert [x.duration_s for x in waits] == [2.0] * 6 and "back to back" in rule
    assert {x.tool for x in waits} == {twp.TOOL}
    preds = twp.predict_all(waits)
    assert preds["kvtier"] == [None, None, None, 2.0, 2.0, 2.0]  # 3 samples before the EWMA answers
    assert preds["replay-chain"] == [None, None, None, 2.0, 2.0, 2.0]
    assert preds["global-mean"] == [None, 2.0, 2.0, 2.0, 2.0, 2.0]
    assert preds["default-10s"] == [UNPREDICTED_GAP_S] * 6
    fig = twp.evaluate_workload(w)["figures"]
    assert fig["tool_waits"] == 6 and fig["true_wait_s"]["median"] == 2.0
    k = fig["overall"]["kvtier"]
    assert (k["waits"], k["predicted"], k["unpredicted"]) == (6, 3, 3)
    assert k["predicted_only"]["median_abs_error_s"] == 0.0 and k["predicted_only"]["p90_abs_error_s"] == 0.0
    assert k["predicted_only"]["under_fraction"] == 0.0
    # the 3 unpredicted waits scored at the connector's 10 s default: |10 - 2| = 8
    assert sorted([0.0] * 3 + [8.0] * 3) == sorted(
        abs((UNPREDICTED_GAP_S if p is None else p) - 2.0) for p in preds["kvtier"])
    assert k["all_unpredicted_as_default"]["median_abs_error_s"] == pytest.approx(4.0)
    assert k["all_unpredicted_as_default"]["mean_abs_error_s"] == pytest.approx(4.0)
    assert k["common_subset"]["waits"] == 3 and k["common_subset"]["median_abs_error_s"] == 0.0
    d = fig["overall"]["default-10s"]
    assert d["predicted"] == 6 and d["predicted_only"]["median_abs_error_s"] == pytest.approx(8.0)
    assert d["predicted_only"]["under_fraction"] == 0.0
    assert fig["per_tool"] == {twp.TOOL: fig["overall"]}


def test_session_keys_and_time_order(twp):
    """Per session beats the replay's per agent type when two sessions of one type differ; a wait is
    predicted at its start, so a wait still running when another starts has not been observed yet."""
    a = Session("a", (_agent("root", "main", [1.0] * 4),))
    b = Session("b", (_agent("root", "main", [9.0] * 4),))
    waits, _ = twp.collect_waits(Workload("two", 64, (a, b), False))
    assert all(x.start_s >= y.end_s for x in waits[4:] for y in waits[:4])  # back to back
    preds = twp.predict_all(waits)
    assert preds["kvtier"][:4] == [None, None, None, 1.0]
    # session b: the per-tool entry (EWMA of 1 s) until b has 3 samples of its own
    assert preds["kvtier"][4:7] == [1.0, pytest.approx(3.4), pytest.approx(5.08)]
    assert preds["kvtier"][7] == pytest.approx(9.0)
    assert preds["replay-chain"][7] != pytest.approx(9.0)  # "main" pools both sessions
    # a sub-agent whose 20 s wait spans the parent's later waits: each of those is predicted before it ends
    parent = _agent("root", "main", [1.0] * 5)
    child = Agent("c", "root", "Explore", (Request(0, 64, 1, (), 0.0, "start", "tool_use", 0.5, api_time_s=0.5),
                                           Request(1, 64, 1, (), 20.0, "tool", "end_turn", 21.0)), 0, None)
    w = Workload("sub", 64, (Session("s", (parent, child)),), False)
    waits, _ = twp.collect_waits(w)
    preds = twp.predict_all(waits)
    long = next(i for i, x in enumerate(waits) if x.duration_s == 20.0)
    assert preds["kvtier"][long] is None  # it starts at 1 s: nothing observed yet
    assert all(p in (None, 1.0) for p in preds["kvtier"])  # the 20 s wait ends after every parent wait started


def test_zero_length_wait_is_predicted_before_observed(twp):
    w = Workload("z", 64, (Session("s", (_agent("root", "main", [0.0] * 4),)),), False)
    preds = twp.predict_all(twp.collect_waits(w)[0])
    assert preds["kvtier"] == [None, None, None, 0.0]
    assert preds["global-mean"] == [None, 0.0, 0.0, 0.0]


def test_quantile_matches_linear_interpolation(twp):
    assert twp.quantile([], 0.5) is None
    assert twp.quantile([3.0], 0.9) == 3.0
    assert twp.quantile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
    assert twp.quantile(list(range(11)), 0.9) == pytest.approx(9.0)


@pytest.mark.skipif(not (TRACES / "weka_claude_code" / "weka_dev_120.tar.xz").exists(),
                    reason=f"dev traces not found under {TRACES} (expected ../shared/traces beside the checkout)")
def test_real_traces_invariants(twp, tmp_path):
    report = twp.run(TRACES, tmp_path, plot=False)
    assert json.loads((tmp_path / twp.JSON_NAME).read_text()) == report
    assert report["trace_set"] == twp.TRACE_SET and report["tool_names_in_trace"] is False
    assert report["commit"] is None or len(report["commit"]) == 40
    assert set(report["splits"]) == {"eval", "tune"} and report["headline_split"] == "eval"
    # the halves partition the sessions and every tool wait of the trace set
    from kvtier.replay import load_trace

    w = load_trace(TRACES / twp.TRACE_SET)
    total_waits = sum(r.gap_cause == "tool" for _, _, r in w.iter_requests())
    splits = report["splits"].values()
    assert sum(s["sessions"] for s in splits) == len(w.sessions)
    assert sum(s["tool_waits"] for s in splits) == total_waits > 0
    for fig in splits:
        assert set(fig["overall"]) == set(twp.METHODS)
        assert sum(rows["kvtier"]["waits"] for rows in fig["per_tool"].values()) == fig["tool_waits"]
        for rows in [fig["overall"], *fig["per_tool"].values()]:
            for s in rows.values():
                assert s["predicted"] + s["unpredicted"] == s["waits"]
                assert 0 <= s["predicted"] <= s["waits"]
                assert s["common_subset"]["waits"] <= s["predicted"]
                for block in ("predicted_only", "all_unpredicted_as_default", "common_subset"):
                    for key in ("median_abs_error_s", "p90_abs_error_s", "mean_abs_error_s"):
                        v = s[block][key]
                        assert v is None or v >= 0
                    med, p90 = s[block]["median_abs_error_s"], s[block]["p90_abs_error_s"]
                    assert med is None or med <= p90
        assert fig["overall"]["default-10s"]["unpredicted"] == 0
        assert fig["overall"]["kvtier"]["unpredicted"] == 3  # a fresh history: only the first 3 waits
