"""Request-stream hints (``kvtier.hints.stream``): what is derived from what a client
sends, and what hostile or odd input cannot do (issue 42). The real server runs in
``tests/engine/test_vllm_stream_hints.py``; the hint server these events feed is
exercised here over gRPC on loopback."""

from __future__ import annotations

import json
import tracemalloc

import pytest

from kvtier.agents import AgentGraph, DurationHistory
from kvtier.hints.stream import ResponseCalls, StreamHints, StreamLimits

SYSTEM = {"role": "system", "content": "you are the planner"}


def _chat(first: str, *tail: dict, system: dict = SYSTEM) -> dict:
    return {"model": "m", "messages": [system, {"role": "user", "content": first}, *tail]}


def _kinds(events: list) -> list[str]:
    return [e[0] for e in events]


def test_a_session_header_an_agent_per_conversation_and_a_tool_wait_from_call_to_result() -> None:
    h = StreamHints()
    d = h.request("openai", {"x-claude-code-session-id": "abc"}, _chat("task one"), now=0.0)
    assert d is not None and _kinds(d.events) == ["session_start", "agent_spawn"]
    assert d.params == {"kvtier_session_id": d.session_id, "kvtier_agent_id": d.agent_id}
    assert d.events[1][1]["parent_agent_id"] == "" and d.events[1][1]["agent_type"] == d.session_id
    started = h.response(d, [("call_7", "pytest")], now=1.0)
    assert started == [("tool_call_start", {"session_id": d.session_id, "agent_id": d.agent_id,
                                            "tool_call_id": "call_7", "tool_name": "pytest"})]
    back = _chat("task one", {"role": "assistant", "tool_calls": [{"id": "call_7"}]},
                 {"role": "tool", "tool_call_id": "call_7", "content": "3 passed"})
    d2 = h.request("openai", {"x-claude-code-session-id": "abc"}, back, now=9.0)
    assert (d2.session_id, d2.agent_id) == (d.session_id, d.agent_id)
    assert d2.events == [("tool_call_end", {"session_id": d.session_id, "agent_id": d.agent_id,
                                            "tool_call_id": "call_7", "status": "ok"})]
    # a sub-agent: another system prompt in the same session, a child of the first agent
    sub = h.request("openai", {"x-claude-code-session-id": "abc"},
                    _chat("look up X", system={"role": "system", "content": "you are a searcher"}), now=10.0)
    assert sub.session_id == d.session_id and sub.agent_id != d.agent_id
    assert sub.events == [("agent_spawn", {"session_id": d.session_id, "agent_id": sub.agent_id,
                                           "parent_agent_id": d.agent_id, "agent_type": d.session_id})]


def test_anthropic_bodies_and_the_session_fallbacks() -> None:
    h = StreamHints()
    body = {"model": "m", "system": [{"type": "text", "text": "coder"}],
            "messages": [{"role": "user", "content": "fix it"}]}
    d = h.request("anthropic", {}, body, now=0.0)
    assert h.counters["sessions_fingerprinted"] == 1
    h.response(d, [("toolu_1", "bash")], now=0.5)
    back = {**body, "messages": body["messages"] + [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "bash", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "ok"}]}]}
    d2 = h.request("anthropic", {}, back, now=2.0)
    assert d2.session_id == d.session_id and _kinds(d2.events) == ["tool_call_end"]
    # prompt_cache_key, user and metadata name a session; each its own
    ids = {h.request("openai", {}, {**_chat("q"), key: value}, now=3.0).session_id
           for key, value in [("prompt_cache_key", "k1"), ("user", "k1"), ("metadata", {"session_id": "k1"})]}
    assert len(ids) == 3


def test_an_sdk_tagged_request_is_left_alone() -> None:
    h = StreamHints()
    body = {**_chat("x"), "kv_transfer_params": {"kvtier_session_id": "mine", "kvtier_agent_id": "a"}}
    assert h.request("openai", {"x-session-id": "s"}, body, now=0.0) is None
    assert h.counters["requests_sdk_tagged"] == 1 and len(h) == 0


@pytest.mark.parametrize("bad", ["x" * (1 << 20), "a\x00b", "line\nbreak", "\x7f", "", 12345, ["list"]])
def test_a_huge_or_control_character_id_falls_back_to_the_fingerprint(bad: object) -> None:
    h = StreamHints()
    d = h.request("openai", {"x-session-id": bad} if isinstance(bad, str) else {},
                  {**_chat("task"), "prompt_cache_key": bad}, now=0.0)
    plain = StreamHints().request("openai", {}, _chat("task"), now=0.0)
    assert d.session_id == plain.session_id  # as if no id were sent
    assert h.counters["ids_refused"] >= 1 and h.counters["sessions_fingerprinted"] == 1
    assert len(d.session_id) < 40 and len(d.agent_id) < 40


def test_ten_thousand_sessions_from_one_client_stay_bounded() -> None:
    h = StreamHints(StreamLimits(max_sessions=1000))
    tracemalloc.start()
    for i in range(10_000):
        d = h.request("openai", {"x-session-id": f"s{i}"}, _chat(f"task {i}"), now=float(i))
        h.response(d, [(f"c{i}", "bash")], now=float(i))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert len(h) == 1000 and h.counters["sessions_forgotten"] == 9000
    assert peak < 32 << 20, peak
    # a forgotten session's tool result is a new session, not an error
    back = _chat("task 0", {"role": "tool", "tool_call_id": "c0", "content": "late"})
    kinds = _kinds(h.request("openai", {"x-session-id": "s0"}, back, now=1e4).events)
    assert "session_start" in kinds and "tool_call_end" in kinds  # (the kept sessions' calls timed out)
    assert len(h._deadlines) <= 4 * 1000 + 1


def test_tenants_with_the_same_session_id_never_meet() -> None:
    h = StreamHints()
    a = h.request("openai", {"x-session-id": "shared", "authorization": "Bearer key-a"}, _chat("t"), now=0.0)
    b = h.request("openai", {"x-session-id": "shared", "authorization": "Bearer key-b"}, _chat("t"), now=0.0)
    assert a.session_id != b.session_id and _kinds(b.events) == ["session_start", "agent_spawn"]
    h.response(a, [("c1", "bash")], now=1.0)
    # tenant b sends a tool result for tenant a's call id: a's call stays in flight
    b2 = h.request("openai", {"x-session-id": "shared", "authorization": "Bearer key-b"},
                   _chat("t", {"role": "tool", "tool_call_id": "c1", "content": "x"}), now=2.0)
    assert b2.events == []
    a2 = h.request("openai", {"x-session-id": "shared", "authorization": "Bearer key-a"},
                   _chat("t", {"role": "tool", "tool_call_id": "c1", "content": "x"}), now=3.0)
    assert [e[1]["status"] for e in a2.events] == ["ok"]


def test_a_tool_result_that_never_comes_ends_the_call_at_its_ttl() -> None:
    h = StreamHints(StreamLimits(call_ttl_s=60.0))
    d = h.request("openai", {"x-session-id": "s"}, _chat("t"), now=0.0)
    h.response(d, [("c1", "bash")], now=1.0)
    assert h.expire(30.0) == []
    assert h.expire(61.5) == [("tool_call_end", {"session_id": d.session_id, "agent_id": d.agent_id,
                                                  "tool_call_id": "c1", "status": "timeout"})]
    assert h.expire(1e6) == []  # once


def test_one_session_id_reused_for_unrelated_conversations() -> None:
    """Each conversation is its own agent: one conversation's new request does not end
    the other's tool wait, and nothing crashes."""
    h = StreamHints()
    one = h.request("openai", {"x-session-id": "reused"}, _chat("write a poem"), now=0.0)
    two = h.request("openai", {"x-session-id": "reused"}, _chat("sum these numbers"), now=0.0)
    assert one.session_id == two.session_id and one.agent_id != two.agent_id
    assert two.events[0][1]["parent_agent_id"] == ""  # a peer (same system prompt), not a sub-agent
    h.response(one, [("c1", "search")], now=1.0)
    again = h.request("openai", {"x-session-id": "reused"}, _chat("sum these numbers", {
        "role": "assistant", "content": "5"}, {"role": "user", "content": "and now?"}), now=2.0)
    assert again.agent_id == two.agent_id and again.events == []  # c1 is still in flight
    cancelled = h.request("openai", {"x-session-id": "reused"}, _chat("write a poem", {
        "role": "assistant", "content": ""}, {"role": "user", "content": "never mind"}), now=3.0)
    assert [e[1]["status"] for e in cancelled.events] == ["cancelled"]  # back without the result


@pytest.mark.parametrize("body", [None, [], "text", {"messages": "no"}, {"messages": [1, None, {"role": 5}]},
                                  {"messages": [{"role": "user", "content": {"odd": [1, 2]}}], "metadata": [1]}])
def test_odd_bodies_never_raise(body: object) -> None:
    h = StreamHints()
    d = h.request("openai", {}, body, now=0.0)
    assert d is None or d.params
    h.request("anthropic", {}, body, now=0.0)


def test_response_calls_from_json_and_from_server_sent_events() -> None:
    openai_json = {"choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "bash", "arguments": "{}"}},
                       {"id": "c2", "type": "function", "function": {"name": "grep", "arguments": "{}"}}]}}]}
    w = ResponseCalls(streaming=False)
    raw = json.dumps(openai_json).encode()
    w.feed(raw[:10])
    w.feed(raw[10:])
    assert w.calls() == [("c1", "bash"), ("c2", "grep")]
    chunks = [{"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "c9", "function": {
                  "name": "bash", "arguments": ""}}]}}]},
              {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}}]},
              {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}]
    sse = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    w = ResponseCalls(streaming=True)
    for i in range(0, len(sse), 7):  # split anywhere, mid-line included
        w.feed(sse[i:i + 7].encode())
    assert w.calls() == [("c9", "bash")]
    anthropic_sse = ('event: content_block_start\ndata: {"type": "content_block_start", "index": 1, '
                     '"content_block": {"type": "tool_use", "id": "toolu_1", "name": "edit", "input": {}}}\n\n')
    w = ResponseCalls(streaming=True)
    w.feed(anthropic_sse.encode())
    assert w.calls() == [("toolu_1", "edit")]
    w = ResponseCalls(streaming=False)
    w.feed(json.dumps({"type": "message", "stop_reason": "tool_use", "content": [
        {"type": "text", "text": "hi"}, {"type": "tool_use", "id": "toolu_2", "name": "bash"}]}).encode())
    assert w.calls() == [("toolu_2", "bash")]
    w = ResponseCalls(streaming=False, max_bytes=100)
    w.feed(b"x" * 200)
    assert w.overflow and w.calls() == []


def test_the_predictor_goes_session_then_tool_then_all_tools() -> None:
    h = DurationHistory(max_keys=64, global_fallback=True)
    for d in (10.0, 10.0, 10.0):
        h.observe("s-1", "pytest", d)
    for d in (2.0, 2.0, 2.0):
        h.observe("s-2", "pytest", d)
    assert h.predict_s("s-1", "pytest", None) == pytest.approx(10.0)  # its session's own
    assert h.predict_s("s-3", "pytest", None) == pytest.approx(4.744, abs=0.01)  # the tool's EWMA, over sessions
    assert h.predict_s("s-3", "never-seen", None) == pytest.approx(4.744, abs=0.01)  # all tools
    assert DurationHistory(max_keys=64).predict_s("s-3", "never-seen", None) is None  # the replay's: none


def test_a_timed_out_call_does_not_teach_the_predictor() -> None:
    g = AgentGraph(global_fallback=True)
    assert g.start_session("t", "s", 0.0) is None
    assert g.spawn_agent("t", "s", "a", 0.0, agent_type="s") is None
    for i in range(4):
        g.start_tool_call("t", "s", "a", f"c{i}", "bash", expected_s=None, now_s=10.0 * i)
        g.end_tool_call("t", "s", "a", f"c{i}", now_s=10.0 * i + 2.0, observed=i < 3)
    assert g.history.predict_s("s", "bash", None) == pytest.approx(2.0)
