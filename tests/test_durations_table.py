"""scripts/durations_table.py: per-module totals from pytest's --durations output."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "durations_table.py"

LOG = """\
....s.. [100%]
============================== slowest durations ===============================
150.88s setup    tests/engine/test_a.py::test_one
12.50s call     tests/engine/test_a.py::test_two[x-1]
40.00s call     tests/engine/test_b.py::test_three
0.20s teardown tests/engine/test_b.py::test_three
3.00s call     tests/engine/test_c.py::test_four
(54 durations < 0.005s hidden.  Use -vv to show these durations.)
"""


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, check=False)


def test_modules_are_summed_and_ordered_longest_first_with_the_rest_folded(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    log.write_text(LOG)
    proc = _run(str(log), "--top", "2")
    assert proc.returncode == 0, proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ")][1:]
    assert rows[0].startswith("| `test_a.py` | 163 | 79% | setup test_one (151 s)")
    assert rows[1].startswith("| `test_b.py` | 40 | 19% | call test_three (40 s)")
    assert rows[2].startswith("| 1 more modules | 3 | 1% |")
    assert rows[3].startswith("| **all** | **207** |")


def test_a_log_without_durations_or_a_missing_file_is_named(tmp_path: Path) -> None:
    empty = tmp_path / "plain.log"
    empty.write_text("5 passed in 3.0s\n")
    proc = _run(str(empty))
    assert proc.returncode == 1 and "plain.log" in proc.stderr and "--durations=0" in proc.stderr
    proc = _run(str(tmp_path / "absent.log"))
    assert proc.returncode == 2 and "absent.log" in proc.stderr
