"""Coverage-guided fuzzing with atheris (libFuzzer) of the SSD value header, the
config loader, the trace readers, the hint server's protobuf decoding and
apply, a request's kv_transfer_params as the connector reads them and the hint
Watch stream's views as the connector's watcher takes them: each target runs in its own process from valid seeds, and any exception
other than the parser's clean error fails it (see tests/fuzz/atheris_targets.py).
The hypothesis property tests next to each parser cover the same ground where
atheris has no wheel."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("atheris", reason="atheris has wheels for Linux x86_64, Python < 3.13 only")

HARNESS = Path(__file__).parent / "fuzz" / "atheris_targets.py"
RUNS = {"ssd_header": 20_000, "config": 5_000, "trace": 5_000, "hints": 10_000, "kv_params": 10_000,
        "watch": 10_000}


@pytest.mark.parametrize("target", sorted(RUNS))
def test_parser_survives_coverage_guided_fuzzing(target: str, tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(HARNESS), target, f"-runs={RUNS[target]}", "-max_total_time=60", "-seed=1",
         f"-artifact_prefix={tmp_path}/"],
        capture_output=True, text=True, timeout=300, check=False)
    tail = (proc.stdout + proc.stderr)[-3000:]
    assert proc.returncode == 0, f"{target}: a finding (input saved under {tmp_path}):\n{tail}"
    assert "DONE" in tail, tail
