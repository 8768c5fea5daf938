"""bench/stale_results.py: which committed results predate a change to their inputs (issue 43)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _script():
    spec = importlib.util.spec_from_file_location("stale_results", ROOT / "bench" / "stale_results.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                          capture_output=True, text=True).stdout.strip()


def test_a_result_is_stale_once_its_inputs_change_after_the_commit_it_names(tmp_path: Path) -> None:
    sr = _script()
    (tmp_path / "kvtier" / "replay").mkdir(parents=True)
    (tmp_path / "out").mkdir()
    _git(tmp_path, "init", "-q")
    (tmp_path / "kvtier" / "replay" / "sim.py").write_text("v = 1\n")
    (tmp_path / "out" / "replay-a.json").write_text("{}")  # no stamp: the commit that wrote it counts
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "commit", "-qm", "first")
    first = _git(tmp_path, "rev-parse", "HEAD")
    (tmp_path / "out" / "replay-b.json").write_text(json.dumps({"commit": first}))  # stamped: made on `first`
    (tmp_path / "out" / "codecs.json").write_text("{}")  # another input set
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "commit", "-qm", "results")
    assert all(not e["changed_by"] for e in sr.staleness(tmp_path / "out", tmp_path))
    (tmp_path / "kvtier" / "replay" / "sim.py").write_text("v = 2\n")
    _git(tmp_path, "commit", "-qam", "simulator changed")
    got = {Path(e["file"]).name: e for e in sr.staleness(tmp_path / "out", tmp_path)}
    assert [c.split(" ", 1)[1] for c in got["replay-a.json"]["changed_by"]] == ["simulator changed"]
    assert got["replay-b.json"]["stamped"] and got["replay-b.json"]["produced_on"] == first
    assert len(got["replay-b.json"]["changed_by"]) == 1
    assert got["codecs.json"]["changed_by"] == []  # the simulator is not a codec input


def test_a_change_to_comments_docstrings_or_layout_alone_does_not_make_a_result_stale(tmp_path: Path) -> None:
    sr = _script()
    sim = tmp_path / "kvtier" / "replay" / "sim.py"
    sim.parent.mkdir(parents=True)
    (tmp_path / "out").mkdir()
    _git(tmp_path, "init", "-q")
    sim.write_text('"""The simulator."""\n\ndef step(x):\n    return x + 1\n')
    (tmp_path / "out" / "replay-a.json").write_text("{}")
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "commit", "-qm", "first")
    sim.write_text('"""The simulator, documented."""\n\n\ndef step(x):  # one more\n    """Step."""\n'
                   '    return (x + 1)\n')
    _git(tmp_path, "commit", "-qam", "docs only")
    (entry,) = sr.staleness(tmp_path / "out", tmp_path)
    assert entry["changed_by"] == [] and entry["text_only"] == ["kvtier/replay/sim.py"]
    sim.write_text('"""The simulator, documented."""\n\n\ndef step(x):\n    """Step."""\n    return x + 2\n')
    _git(tmp_path, "commit", "-qam", "code moved")
    sim.write_text('"""Again."""\n\n\ndef step(x):\n    """Step."""\n    return x + 2\n')
    _git(tmp_path, "commit", "-qam", "docs again")
    (entry,) = sr.staleness(tmp_path / "out", tmp_path)
    # only the commit that moved code counts, not the text-only ones around it
    assert [c.split(" ", 1)[1] for c in entry["changed_by"]] == ["code moved"] and entry["text_only"] == []


def test_the_committed_results_are_listed(capsys: pytest.CaptureFixture[str]) -> None:
    sr = _script()
    entries = sr.staleness(ROOT / "bench" / "out")
    if entries is None:
        pytest.skip("no git history in this checkout: stale_results has nothing to compare")
    assert sr.main([]) == 0
    out = capsys.readouterr().out
    print(out)  # the CI log's record of which results to rerun
    assert f"of {len(entries)} results" in out
