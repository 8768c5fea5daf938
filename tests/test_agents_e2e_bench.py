"""bench/agents_e2e.py without an engine: the agents it plans from the dev traces, the
comparisons it states, its flags and the README table rendered from its JSON."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "agents_e2e.py"


def _bench():
    spec = importlib.util.spec_from_file_location("agents_e2e", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _row(name: str, p50: float, p99: float, mean: float, makespan: float = 60.0) -> dict:
    return {"name": name, "label": name, "later_ttft_p50_s": p50, "later_ttft_p99_s": p99, "later_ttft_mean_s": mean,
            "first_ttft_p50_s": 1.0, "makespan_s": makespan, "output_tok_s": 5.0, "prefill_computed_tokens": 1000.0,
            "ids": [{"0.0": [5, 6]}]}


def test_agents_are_planned_from_the_evaluation_half_scaled_to_the_context() -> None:
    bench = _bench()
    if not bench.DEV_TRACE.exists():
        pytest.skip(f"dev traces not at {bench.DEV_TRACE} (see ../shared/traces/README.md)")
    plans = bench.plan_agents(8, 6, 1536, 0.25)
    assert len(plans) == 8 and len({p["trace"] for p in plans}) == 8
    from kvtier.replay.readers import load_trace
    from kvtier.replay.run import split_workload

    eval_ids = {s.session_id for s in split_workload(load_trace(bench.DEV_TRACE), "eval").sessions}
    assert {p["trace"] for p in plans} <= eval_ids  # never the tuning half
    for p in plans:
        assert len(p["grow_tokens"]) == len(p["waits_s"]) == 5
        last = p["first_tokens"] + sum(p["grow_tokens"])
        assert 1536 - 8 <= last <= 1536 + 8 * 5, p  # rounding, and at least 8 tokens a turn
        assert all(bench.WAIT_CLAMP_S[0] <= w <= bench.WAIT_CLAMP_S[1] for w in p["waits_s"])
    assert bench.plan_agents(8, 6, 1536, 0.25) == plans  # the same agents every run


def test_checks_state_the_order_and_the_ratios() -> None:
    bench = _bench()
    res = {"none": _row("none", 2.0, 4.0, 2.2, 100.0), "lru-dram": _row("lru-dram", 1.0, 2.0, 1.2),
           "kvtier": _row("kvtier", 0.8, 1.8, 1.0), "middleware": _row("middleware", 0.7, 1.5, 0.9, 70.0),
           "sdk": _row("sdk", 0.6, 1.4, 0.8)}
    c = bench._checks(res)
    assert c["middleware_vs_none_later_p50"] == pytest.approx(0.35)
    assert c["middleware_vs_none_makespan"] == pytest.approx(0.7)
    assert c["hints_never_cost_time_mean"] and c["hints_never_cost_time_p99"]
    res["sdk"] = _row("sdk", 0.6, 1.6, 0.8)  # SDK hints slower at p99 than the middleware: the order fails
    res["kvtier"]["ids"] = [{"0.0": [5, 6]}, {"0.0": [5, 7]}]  # its second run differs
    c = bench._checks(res)
    assert c["hints_never_cost_time_mean"] and not c["hints_never_cost_time_p99"]
    assert c["ids_identical_to_none"] == {"none": True, "lru-dram": True, "kvtier": False, "middleware": True,
                                          "sdk": True}


def test_plot_mode_and_the_readme_table_render_from_the_json(tmp_path: Path) -> None:
    bench = _bench()
    rows = {n: _row(n, 1.0 / (i + 1), 2.0 / (i + 1), 1.5 / (i + 1)) for i, n in enumerate(bench.CONFIGS)}
    checks = bench._checks(rows)
    for r in rows.values():
        r.pop("ids")
    data = {"commit": "0123456789", "code_dirty": False, "configs": list(rows.values()), "checks": checks,
            "settings": {"agents": 8, "turns": 6, "context_tokens": 1536, "hbm_contexts": 2.5, "wait_scale": 0.25,
                         "wait_clamp_s": [0.5, 6.0], "model": {"name": "tiny", "hidden_size": 128,
                                                               "num_hidden_layers": 2}}}
    path = tmp_path / "e2e.json"
    path.write_text(json.dumps(data))
    proc = subprocess.run([sys.executable, str(SCRIPT), "--plot", str(path)], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "middleware" in proc.stdout and "0.333" in proc.stdout  # the middleware row's later p50
    # rendered in a child: importing the table modules here would leave them registered in this process
    render = subprocess.run([sys.executable, "-c", "import json, sys; sys.path.insert(0, 'bench'); "
                             "import readme_tables as t; t._load_renderers(); "
                             f"print(t.TABLES['agents-e2e'][1](json.load(open({str(path)!r}))))"],
                            capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert render.returncode == 0, render.stderr
    text = render.stdout
    assert "commit 0123456" in text and "(0.33x)" in text and "8 agents at once" in text
    assert text.count("\n| ") == 1 + len(bench.CONFIGS)  # header + one row per configuration
    # the caption is the command that made the JSON: this model, context and set of configurations
    assert "2-layer, 128-wide" in text and "0.50 s (0.50x)" in text
    assert f"agents_e2e.py --model tiny --context-tokens 1536 --configs {','.join(bench.CONFIGS)} " in text


def test_checks_compare_recompute_and_sync_loads_with_the_do_nothing_connector() -> None:
    bench = _bench()
    res = {"none": _row("none", 0.05, 0.09, 0.05), "null": _row("null", 0.05, 0.4, 0.05),
           "kvtier": _row("kvtier", 0.04, 0.07, 0.04), "cheaper": _row("cheaper", 0.03, 0.07, 0.035),
           "sync": _row("sync", 0.02, 0.1, 0.03)}
    c = bench._checks(res)
    assert c["cheaper_vs_null_later_p50"] == pytest.approx(0.6)
    assert c["cheaper_vs_null_later_p99"] == pytest.approx(0.175)
    assert c["sync_vs_kvtier_later_p50"] == pytest.approx(0.5)
    assert c["sync_vs_null_later_mean"] == pytest.approx(0.6)


def test_an_unknown_configuration_is_refused_naming_the_flag() -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--configs", "none,lmcache"], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and "--configs" in proc.stderr and "lmcache" in proc.stderr
