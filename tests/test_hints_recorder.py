"""Recording live hints into AgentX / Weka traces that the replay reader loads."""

from __future__ import annotations

import json
import time

import pytest
from hints_support import ServerThread

from kvtier.recording.hints import HintRecorder
from kvtier.sdk import HintClient


def _record(tmp_path):
    recorder = HintRecorder(tmp_path, block_size=16, model="m")
    with ServerThread(recorder=recorder) as s:
        with HintClient(s.address, flush_interval_s=0.001) as client:
            with client.session("rec-1", model="m"):
                with client.agent("planner", agent_id="main") as main:
                    with main.request("r0", prompt_block_keys=[1, 2, 3], num_prompt_tokens=60) as r:
                        r.num_output_tokens, r.stop = 10, "tool_use"
                    with main.tool_call("bash", expected_s=0.01):
                        time.sleep(0.01)
                    with main.agent("coder", agent_id="kid") as kid:
                        with kid.request("k0", prompt_block_keys=[1, 2, 9]) as r:
                            r.num_output_tokens, r.stop = 5, "end_turn"
                    with main.request("r1", prompt_block_keys=[1, 2, 3, 4], num_prompt_tokens=70) as r:
                        r.num_output_tokens, r.stop = 8, "end_turn"
            with client.session("empty"):  # no request: not written
                pass
            with client.session("open"):  # still open at close: written by close()
                with client.agent("solo") as solo:
                    with solo.request("o0", prompt_block_keys=[7]):
                        pass
            assert client.flush(10)
        s.stop()
    recorder.close()
    return recorder


def test_recording_is_agentx_json_plus_hints_side_file(tmp_path):
    recorder = _record(tmp_path)
    assert (recorder.num_traces_written, recorder.num_sessions_empty) == (2, 1)
    [trace_path] = [p for p in recorder.written if p.name.endswith("_rec-1.json")]
    trace = json.loads(trace_path.read_text())
    assert (trace["id"], trace["block_size"], trace["hash_id_scope"], trace["models"]) == ("rec-1", 16, "local", ["m"])
    # only the fields aiperf's WekaTrace allows (tests/test_interop_aiperf.py validates with aiperf itself)
    assert set(trace) == {"id", "models", "block_size", "hash_id_scope", "requests", "totals"}
    assert trace["totals"] == {"parent_tokens": {"input": 130, "output": 18}, "subagent_tokens": {"input": 48, "output": 5},
                               "combined_tokens": {"input": 178, "output": 23}, "subagent_count": 1,
                               "tenant": "default", "recorded_by": "kvtier hints recorder"}
    r0, sub, r1 = trace["requests"]
    assert r0["model"] == r1["model"] == sub["requests"][0]["model"] == "m" and sub["models"] == ["m"]
    assert type(sub["duration_ms"]) is int
    assert (r0["type"], r0["in"], r0["out"], r0["hash_ids"], r0["stop"]) == ("n", 60, 10, [0, 1, 2], "tool_use")
    assert (sub["type"], sub["agent_id"], sub["subagent_type"]) == ("subagent", "kid", "coder")
    assert sub["status"] == "completed"
    assert sub["requests"][0]["hash_ids"] == [0, 1, 3] and sub["requests"][0]["in"] == 48  # 3 keys * 16 tokens
    assert r1["hash_ids"] == [0, 1, 2, 4] and r1["think_time"] >= 0 and r1["t"] >= r0["t"]
    lines = [json.loads(line) for line in (tmp_path / "hints.jsonl").read_text().splitlines()]
    kinds = [line["kind"] for line in lines]
    assert kinds.count("session_start") == 3 and "tool_call_start" in kinds and "agent_spawn" in kinds
    start = next(line for line in lines if line["kind"] == "request_start")
    assert start["fields"]["prompt_block_keys"][0] == "00000000000000000000000000000001"
    assert start["tenant"] == "default" and start["client_time_unix_us"] > 0


def test_recording_loads_through_the_replay_reader(tmp_path):
    readers = pytest.importorskip("kvtier.replay.readers")
    _record(tmp_path)
    workload = readers.load_trace(tmp_path / "traces")
    assert workload.block_size == 16 and not workload.open_loop
    sessions = {s.session_id: s for s in workload.sessions}
    assert set(sessions) == {"rec-1", "open"}
    root, kid = sessions["rec-1"].agents
    assert [len(r.block_ids) for r in root.requests] == [3, 4]
    assert kid.parent_id == root.agent_id and kid.join_before == 1  # the next main request waits for it
    assert root.requests[1].depends_on == ("kid",)
    # the shared prefix keeps its ids across agents of the session
    assert root.requests[0].block_ids[:2] == kid.requests[0].block_ids[:2] == root.requests[1].block_ids[:2]
