"""Regression tests of the second hardening round (one per defect found by an
adversarial user): each failed before its fix. Flag ranges and output paths
are in ``test_cli_flags.py``, the SSD file checks in
``tests/fault/test_fault_storage.py``, the hint-server restart in
``test_hints_restart.py``, the SDK's field checks in ``test_hints_sdk.py``,
documented commands in ``test_docs.py``."""

from __future__ import annotations

import shutil
import sys
import tarfile
from pathlib import Path

from kvtier.cli import main

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT.parent / "shared" / "traces" / "weka_claude_code" / "example_trace_0277_with_subagents.json"


def _replay(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        rc = main(["replay", "--quiet", *argv])
    except SystemExit as done:
        rc = done.code
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_a_block_size_the_workload_cannot_take_is_one_line(capsys) -> None:
    rc, _, err = _replay(["--sessions", "1", "--policies", "lru", "--block-size", "7"], capsys)
    assert rc == 2 and "Traceback" not in err
    assert err.strip() == ("kvtier replay: error: --block-size=7: the workload has blocks of 64 tokens; "
                           "re-blocking needs one to be a multiple of the other")


def test_an_empty_trace_is_an_error_not_a_table_of_dashes(tmp_path: Path, capsys) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    rc, out, err = _replay(["--trace", str(empty), "--policies", "lru"], capsys)
    assert rc == 2 and "holds no requests: nothing to replay" in err and out == ""


def test_skip_bad_that_skips_everything_says_so_with_the_files_and_reasons(tmp_path: Path, capsys) -> None:
    (tmp_path / "a.json").write_text('{"value": 1}')
    (tmp_path / "b.json").write_text("[1, 2")
    try:
        rc = main(["replay", "--trace", str(tmp_path), "--skip-bad", "--policies", "lru"])
    except SystemExit as done:
        rc = done.code
    err = capsys.readouterr().err
    assert rc == 2 and "holds no requests (2 trace file(s) skipped as bad)" in err
    assert f"{tmp_path / 'a.json'}: missing field 'requests'" in err and "{'" not in err


def test_a_tarball_inside_a_trace_directory_is_read(tmp_path: Path) -> None:
    from kvtier.replay import load_trace
    from kvtier.replay.generator import generate_coding_sessions, write_traces

    # the real example where it is beside the checkout, else a generated trace (a clone with nothing beside it)
    example = EXAMPLE if EXAMPLE.exists() else write_traces(tmp_path / "gen", generate_coding_sessions(1, seed=5))[0]
    shutil.copy(example, tmp_path / "one.json")
    with tarfile.open(tmp_path / "more.tar.gz", "w:gz") as tar:
        tar.add(example, arcname="inner/two.json")
    shutil.rmtree(tmp_path / "gen", ignore_errors=True)
    assert len(load_trace(tmp_path).sessions) == 2


def test_hbm_that_holds_the_whole_working_set_is_pointed_out(capsys) -> None:
    rc, out, _ = _replay(["--sessions", "2", "--policies", "lru,kvtier", "--hbm-blocks", "100000",
                          "--no-references"], capsys)
    assert rc == 0 and "note: HBM of 100,000 blocks holds every distinct block of the workload" in out


def test_a_closed_pipe_ends_quietly(monkeypatch, capsys) -> None:
    """`kvtier replay ... | head -1`: the reader closes the pipe; no traceback."""

    class ClosedPipe:
        def write(self, text: str) -> int:
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self) -> None:
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    rc = main(["replay", "--quiet", "--sessions", "1", "--policies", "lru", "--no-references"])
    assert rc == 1 and "Traceback" not in capsys.readouterr().err


def test_json_is_checked_before_the_work(tmp_path: Path, capsys) -> None:
    rc, _, err = _replay(["--sessions", "1", "--policies", "lru", "--json", str(tmp_path / "no" / "x.json")], capsys)
    assert rc == 2 and f"argument --json: directory '{tmp_path / 'no'}' does not exist" in err


def test_the_sdk_closes_at_once_when_the_server_is_down() -> None:
    """close() used to wait its whole flush timeout (5 s) for a server that was not there.
    Measured as the sender's attempts: it stops at the first failure instead of retrying."""
    from kvtier.sdk import HintClient

    client = HintClient("127.0.0.1:1", max_batch_attempts=50, backoff_initial_s=0.05, backoff_max_s=0.05)
    client.emit("session_start", session_id="s")
    client.close(timeout_s=30.0)
    stats = client.stats()
    assert stats.dropped["unavailable"] + stats.dropped["closed"] == 1
    assert 1 <= stats.failed_calls < 10  # given up on at close, not retried 50 times
