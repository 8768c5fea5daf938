"""The traces kvtier writes are ones aiperf (the AgentX / InferenceX client) accepts,
and kvtier's infinite-cache hit rate agrees with `aiperf analyze-trace`.

aiperf lives in a side venv (integrations/aiperf/setup_aiperf_venv.sh, which
scripts/test.sh builds for the full suite); its interpreter is AIPERF_PYTHON
or .venv-aiperf/bin/python. Without it these tests skip, except in CI
(KVTIERTEST_REQUIRE_AIPERF=1), where they fail.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from kvtier.replay.analysis import analyze
from kvtier.replay.generator import generate_coding_sessions, write_traces
from kvtier.replay.readers import load_trace

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT.parent / "shared" / "traces"
MOONCAKE = TRACES / "mooncake_fast25" / "conversation_trace.jsonl"
CHECK = ROOT / "integrations" / "aiperf" / "check_traces.py"


def _aiperf_python() -> Path | None:
    explicit = os.environ.get("AIPERF_PYTHON")
    side = Path(explicit) if explicit else ROOT / ".venv-aiperf" / "bin" / "python"
    if side.exists():
        return side
    if os.environ.get("KVTIERTEST_REQUIRE_AIPERF") == "1":
        pytest.fail(f"aiperf side venv missing at {side} (integrations/aiperf/setup_aiperf_venv.sh)")
    pytest.skip("no aiperf interpreter (integrations/aiperf/setup_aiperf_venv.sh)")


def _check(python: Path, *paths: Path) -> tuple[int, dict]:
    proc = subprocess.run([str(python), str(CHECK), *map(str, paths)], capture_output=True, text=True, timeout=600)
    assert proc.stdout.strip(), proc.stderr[-4000:]
    return proc.returncode, json.loads(proc.stdout.strip().splitlines()[-1])


def test_generated_and_recorded_traces_validate_as_aiperf_weka_traces(tmp_path: Path) -> None:
    python = _aiperf_python()
    from test_hints_recorder import _record

    generated = write_traces(tmp_path / "generated", generate_coding_sessions(30, seed=3))
    recorder = _record(tmp_path / "recorded")
    assert len(generated) == 30 and recorder.num_traces_written >= 1
    rc, report = _check(python, tmp_path / "generated", tmp_path / "recorded" / "traces")
    print(f"aiperf {report['aiperf']} WekaTrace: {report['valid']} valid, {len(report['invalid'])} invalid")
    assert report["invalid"] == [] and rc == 0
    assert report["valid"] == 30 + recorder.num_traces_written
    # The check can fail: the scope the generator used to write is refused, and so is an unknown field.
    bad = json.loads(generated[0].read_text())
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "global.json").write_text(json.dumps({**bad, "hash_id_scope": "global"}))
    (tmp_path / "bad" / "extra.json").write_text(json.dumps({**bad, "tenant": "t"}))
    rc, report = _check(python, tmp_path / "bad")
    assert rc == 1 and report["valid"] == 0 and len(report["invalid"]) == 2
    assert "hash_id_scope" in " ".join(report["invalid"][1]["errors"])


@pytest.mark.skipif(not MOONCAKE.exists(), reason=f"public traces not found under {TRACES}")
def test_infinite_cache_hit_rate_matches_aiperf_analyze_trace(tmp_path: Path) -> None:
    python = _aiperf_python()
    out = tmp_path / "aiperf.json"
    proc = subprocess.run([str(python.parent / "aiperf"), "analyze-trace", str(MOONCAKE), "--block-size", "512",
                           "--output-file", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    theirs = json.loads(out.read_text())["cache_hit_rate"]
    ours = analyze(load_trace(MOONCAKE))
    print(f"Mooncake conversation trace, infinite cache: aiperf analyze-trace cache_hit_rate {theirs:.4f}; "
          f"kvtier request_mean_hit_rate {ours['request_mean_hit_rate']:.4f} (same definition), "
          f"block_hit_rate {ours['block_hit_rate']:.4f}, token_hit_rate {ours['token_hit_rate']:.4f} "
          "(full blocks only, weighted by size)")
    assert round(theirs, 3) == 0.384
    assert ours["request_mean_hit_rate"] == pytest.approx(theirs, abs=1e-9)
