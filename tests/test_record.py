"""kvtier.recording.requests: what a live engine's recording holds, and that the replay reads it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvtier.replay import load_trace
from kvtier.recording.requests import SALT_FILE, RequestRecorder


def _files(d: Path) -> list[Path]:
    return sorted(d.glob("*.json"))


def test_tagged_agents_become_traces_with_their_gaps_and_tool_stops(tmp_path: Path) -> None:
    rec = RequestRecorder(tmp_path, block_size=16, model="m")
    # agent a of session s: two turns with a tool call between; agent b: one turn; one untagged request
    rec.arrived("a1", "s", "a", 40, [1, 2], now=10.0)
    rec.arrived("b1", "s", "b", 33, [1, 2], now=10.5)
    rec.arrived("u1", None, None, 20, [9], now=11.0)
    rec.finished("a1", 7, tool_wait=True, now=12.0)
    rec.finished("b1", 3, tool_wait=False, now=12.5)
    rec.finished("u1", 1, tool_wait=False, now=11.2)
    rec.arrived("a2", "s", "a", 60, [1, 2, 3], now=15.0)
    rec.finished("a2", 4, tool_wait=False, now=16.0)
    rec.close()
    traces = {json.loads(f.read_text())["id"]: json.loads(f.read_text()) for f in _files(tmp_path)}
    assert sorted(traces) == ["s:a", "s:b", "untagged"]
    a = traces["s:a"]
    assert a["block_size"] == 16 and a["hash_id_scope"] == "global" and a["start_unix_s"] == 10.0
    r1, r2 = a["requests"]
    assert (r1["t"], r1["in"], r1["out"], r1["stop"], r1["api_time"], r1["think_time"]) == (0.0, 40, 7, "tool_use",
                                                                                          2.0, None)
    assert (r2["t"], r2["stop"], r2["think_time"], r2["api_time"]) == (5.0, "end_turn", 3.0, 1.0)
    assert r2["hash_ids"][:2] == r1["hash_ids"] == traces["s:b"]["requests"][0]["hash_ids"]  # one id per block
    assert set(r1) == {"t", "type", "model", "in", "out", "hash_ids", "stop", "api_time", "think_time"}
    w = load_trace(tmp_path)  # what kvtier replay reads
    assert w.block_size == 16 and len(w.sessions) == 3
    by_id = {s.session_id: s for s in w.sessions}
    reqs = by_id["s:a"].root.requests
    assert [r.gap_cause for r in reqs] == ["start", "tool"] and reqs[1].gap_s == 3.0
    assert reqs[1].block_ids[:2] == reqs[0].block_ids == by_id["s:b"].root.requests[0].block_ids


def test_block_ids_are_anonymous_and_stable_across_restarts(tmp_path: Path) -> None:
    ids = []
    for run in range(2):
        rec = RequestRecorder(tmp_path, block_size=16)
        rec.arrived(f"r{run}", None, None, 32, [123456789, 42], now=float(run))
        rec.finished(f"r{run}", 1, tool_wait=False, now=run + 0.5)
        rec.close()
        ids.append(json.loads(max(_files(tmp_path), key=os.path.getmtime).read_text())["requests"][0]["hash_ids"])
    assert ids[0] == ids[1]  # the salt in the directory keeps ids equal across engine restarts
    assert 123456789 not in ids[0] and 42 not in ids[0]
    assert all(0 <= i < 2 ** 52 for i in ids[0])
    assert oct((tmp_path / SALT_FILE).stat().st_mode & 0o777) == oct(0o600)
    other = tmp_path / "other"
    rec = RequestRecorder(other, block_size=16)
    rec.arrived("x", None, None, 32, [123456789, 42], now=0.0)
    rec.finished("x", 1, tool_wait=False, now=1.0)
    rec.close()
    assert json.loads(_files(other)[0].read_text())["requests"][0]["hash_ids"] != ids[0]  # another recording


def test_long_traces_rotate_and_a_full_directory_stops_recording(tmp_path: Path) -> None:
    rec = RequestRecorder(tmp_path, block_size=16, max_requests_per_file=3)
    for i in range(7):
        rec.arrived(f"r{i}", "s", "a", 16, [i], now=float(i))
        rec.finished(f"r{i}", 1, tool_wait=False, now=i + 0.5)
    rec.close()
    files = _files(tmp_path)
    assert [len(json.loads(f.read_text())["requests"]) for f in files] == [3, 3, 1]
    assert sum(s.num_requests() for s in load_trace(tmp_path).sessions) == 7
    full = tmp_path / "full"
    rec = RequestRecorder(full, block_size=16, max_bytes=600)
    for i in range(20):
        rec.arrived(f"r{i}", f"s{i}", "a", 16, [i], now=float(i))
        rec.finished(f"r{i}", 1, tool_wait=False, now=i + 0.5)
    rec.close()
    assert 0 < len(_files(full)) < 20 and rec.counters["record_skipped_full"] > 0
    assert sum(f.stat().st_size for f in _files(full)) <= 600


def test_a_full_queue_drops_requests_and_counts_them(tmp_path: Path) -> None:
    rec = RequestRecorder(tmp_path, block_size=16, max_queue=1)
    for i in range(2000):  # far faster than the writer drains
        rec.arrived(f"r{i}", None, None, 16, list(range(200)), now=float(i))
    rec.close()
    assert rec.counters["record_dropped"] > 0
    assert rec.counters["recorded_requests"] + rec.counters["record_dropped"] == 2000


def test_bad_directory_names_the_setting(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match="record_path="):
        RequestRecorder(blocker / "sub", block_size=16)


CHILD = """
import sys, time
from kvtier.recording.requests import RequestRecorder
rec = RequestRecorder(sys.argv[1], block_size=16, flush_s=0.01)
i = 0
while True:
    rec.arrived(f"r{i}", f"s{i % 5}", "a", 64, list(range(i % 5)), now=float(i))
    rec.finished(f"r{i}", 3, tool_wait=i % 2 == 0, now=i + 0.5)
    i += 1
    if i == 200:
        print("going", flush=True)
    time.sleep(0.0005)
"""


def test_a_killed_recorder_leaves_whole_files(tmp_path: Path) -> None:
    """SIGKILL while the writer rewrites files every 10 ms: every ``.json`` left parses
    and replays (partial writes are only ever ``.tmp`` files)."""
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "going"
    time.sleep(0.3)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    files = _files(tmp_path)
    assert files
    for f in files:
        json.loads(f.read_text())
    assert load_trace(tmp_path).num_requests() > 0


def test_out_of_order_finishes_and_requests_in_flight_at_close(tmp_path: Path) -> None:
    """Overlapping untagged requests are written in arrival order once they finished;
    one still in flight when the engine stops is left out; ids reused from the
    previous request's shared prefix equal fresh ones (a chain that diverges)."""
    rec = RequestRecorder(tmp_path, block_size=16)
    rec.arrived("a", None, None, 64, [1, 2, 3, 4], now=1.0)
    rec.arrived("b", None, None, 64, [1, 2, 9, 10], now=1.1)  # shares two blocks, then diverges
    rec.arrived("c", None, None, 32, [7, 8], now=1.2)
    rec.finished("b", 2, tool_wait=False, now=2.0)
    rec.finished("a", 3, tool_wait=False, now=2.5)  # "c" never finishes
    rec.close()
    (f,) = _files(tmp_path)
    reqs = json.loads(f.read_text())["requests"]
    assert [r["in"] for r in reqs] == [64, 64] and [r["out"] for r in reqs] == [3, 2]
    fresh = RequestRecorder(tmp_path / "check", block_size=16)
    fresh._salt = rec._salt
    assert reqs[1]["hash_ids"] == [fresh._anon(k) for k in (1, 2, 9, 10)]
    assert reqs[0]["hash_ids"][:2] == reqs[1]["hash_ids"][:2] and reqs[0]["hash_ids"][2] != reqs[1]["hash_ids"][2]
    fresh.close()


def test_the_recording_modules_doctests() -> None:
    import doctest

    import kvtier.recording.requests
    import kvtier.recording.traces

    for mod in (kvtier.recording.requests, kvtier.recording.traces):
        assert doctest.testmod(mod).failed == 0, mod.__name__
