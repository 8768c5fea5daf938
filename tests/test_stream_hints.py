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
    assert d is not None and d.events == []  # the server hears of a session at its first tool call
    assert d.params == {"kvtier_session_id": d.session_id, "kvtier_agent_id": d.agent_id}
    started = h.response(d, [("call_7", "pytest")], now=1.0)
    assert _kinds(started) == ["session_start", "agent_spawn", "tool_call_start"]
    assert started[1][1]["parent_agent_id"] == "" and started[1][1]["agent_type"] == d.session_id
    assert started[2] == ("tool_call_start", {"session_id": d.session_id, "agent_id": d.agent_id,
                                              "tool_call_id": "call_7", "tool_name": "pytest"})
    back = _chat("task one", {"role": "assistant", "tool_calls": [{"id": "call_7"}]},
                 {"role": "tool", "tool_call_id": "call_7", "content": "3 passed"})
    d2 = h.request("openai", {"x-claude-code-session-id": "abc"}, back, now=9.0)
    assert (d2.session_id, d2.agent_id) == (d.session_id, d.agent_id)
    assert d2.events == [("tool_call_end", {"session_id": d.session_id, "agent_id": d.agent_id,
                                            "tool_call_id": "call_7", "status": "ok"})]
    # a sub-agent: another system prompt in the same session, a child of the first agent
    sub = h.request("openai", {"x-claude-code-session-id": "abc"},
                    _chat("look up X", system={"role": "system", "content": "you are a searcher"}), now=10.0)
    assert sub.session_id == d.session_id and sub.agent_id != d.agent_id and sub.events == []
    assert h.response(sub, [("c9", "search")], now=11.0)[0] == (
        "agent_spawn", {"session_id": d.session_id, "agent_id": sub.agent_id, "parent_agent_id": d.agent_id,
                        "agent_type": d.session_id})
    # a plain chat (no tool call) never reaches the hint server
    chat = h.request("openai", {"x-session-id": "chat"}, _chat("hello"), now=12.0)
    assert chat.events == [] and h.response(chat, [], now=13.0) == []


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
    # vLLM's session_id, prompt_cache_key, user and metadata name a session; each its own
    fingerprinted = h.counters["sessions_fingerprinted"]
    ids = {h.request("openai", {}, {**_chat("q"), key: value}, now=3.0).session_id
           for key, value in [("session_id", "k1"), ("prompt_cache_key", "k1"), ("user", "k1"),
                              ("metadata", {"session_id": "k1"})]}
    assert len(ids) == 4 and h.counters["sessions_fingerprinted"] == fingerprinted


def test_a_request_forcing_a_tool_call_carries_its_wait_learned_from_the_agent_then_the_session() -> None:
    h = StreamHints(StreamLimits(forced_call_wait_s=7.0))
    tools = [{"type": "function", "function": {"name": "bash"}}]
    forced = {**_chat("task"), "tools": tools, "tool_choice": {"type": "function", "function": {"name": "bash"}}}
    d = h.request("openai", {"x-session-id": "s"}, forced, now=0.0)
    assert d.params["kvtier_tool_wait_s"] == 7.0  # nothing seen yet: the default
    h.response(d, [("c1", "bash")], now=1.0)
    back = {**forced, "messages": forced["messages"] + [{"role": "assistant", "tool_calls": [{"id": "c1"}]},
                                                        {"role": "tool", "tool_call_id": "c1", "content": "ok"}]}
    assert h.request("openai", {"x-session-id": "s"}, back, now=3.5).params["kvtier_tool_wait_s"] == 2.5
    # another agent of the session: the session's last wait; "required" forces a call too
    sub = {**_chat("search", system={"role": "system", "content": "searcher"}), "tools": tools,
           "tool_choice": "required"}
    assert h.request("openai", {"x-session-id": "s"}, sub, now=4.0).params["kvtier_tool_wait_s"] == 2.5
    # a choice the model may decline, or no tools: no wait said
    for body in ({**forced, "tool_choice": "auto"}, {**forced, "tool_choice": "none"}, {**forced, "tools": []},
                 {**_chat("task"), "tool_choice": "required"}):
        assert "kvtier_tool_wait_s" not in h.request("openai", {"x-session-id": "s"}, body, now=5.0).params
    anthropic = {"model": "m", "messages": [{"role": "user", "content": "go"}], "tools": [{"name": "bash"}]}
    for choice, said in [({"type": "any"}, True), ({"type": "tool", "name": "bash"}, True), ({"type": "auto"}, False)]:
        got = h.request("anthropic", {"x-session-id": "a"}, {**anthropic, "tool_choice": choice}, now=6.0)
        assert ("kvtier_tool_wait_s" in got.params) is said
    assert h.counters["requests_forcing_tool_calls"] == 5


def test_dynamo_names_the_run_its_chains_and_their_parents() -> None:
    """NVIDIA Dynamo's clients: ``nvext.agent_context`` (run, trajectory, parent trajectory; the newer
    workflow / program names too), else ``X-Dynamo-Session-ID`` (a chain) and ``X-Dynamo-Parent-Session-ID``:
    one kvtier session per run (per tree of chains), one agent per chain, a child under its parent."""
    h = StreamHints()

    def ctx(**kw: str) -> dict:
        return {**_chat("task"), "nvext": {"agent_context": {"session_type_id": "coding", **kw},
                                           "agent_hints": {"priority": 5, "osl": 64}}}

    planner = h.request("openai", {}, ctx(session_id="run-1", trajectory_id="planner"), now=0.0)
    coder = h.request("openai", {}, ctx(session_id="run-1", trajectory_id="coder", parent_trajectory_id="planner"),
                      now=0.1)
    newer = h.request("openai", {}, ctx(workflow_id="run-1", program_id="tester", parent_program_id="planner"),
                      now=0.2)
    assert planner.session_id == coder.session_id == newer.session_id
    assert len({planner.agent_id, coder.agent_id, newer.agent_id}) == 3
    h.response(planner, [("p1", "plan")], now=0.3)
    spawn = [e for e in h.response(coder, [("c1", "bash")], now=0.4) if e[0] == "agent_spawn"]
    assert spawn[0][1]["parent_agent_id"] == planner.agent_id  # the parent the client named
    assert (h.counters["dynamo_agent_context"], h.counters["dynamo_agent_hints"]) == (3, 3)
    # the headers: a chain, its parent chain, and a grandchild whose session is the tree's root
    root = h.request("openai", {"x-dynamo-session-id": "r"}, _chat("t"), now=1.0)
    child = h.request("openai", {"x-dynamo-session-id": "c", "x-dynamo-parent-session-id": "r"}, _chat("t"), now=1.1)
    grand = h.request("openai", {"x-dynamo-session-id": "g", "x-dynamo-parent-session-id": "c"}, _chat("t"), now=1.2)
    assert root.session_id == child.session_id == grand.session_id != planner.session_id
    assert len({root.agent_id, child.agent_id, grand.agent_id}) == 3
    h.response(root, [("r1", "x")], now=1.3)
    h.response(child, [("c1", "x")], now=1.4)
    spawn = [e for e in h.response(grand, [("g1", "x")], now=1.5) if e[0] == "agent_spawn"]
    assert spawn[0][1]["parent_agent_id"] == child.agent_id
    # a run's trajectory with no parent is a root, not a child of the run's first trajectory
    peer = h.request("openai", {}, ctx(session_id="run-1", trajectory_id="reviewer"), now=1.6)
    spawn = [e for e in h.response(peer, [("v1", "x")], now=1.7) if e[0] == "agent_spawn"]
    assert spawn[0][1]["parent_agent_id"] == ""
    # agent_context's chain form (no trajectory): session_id names a chain under parent_session_id
    chain = {**_chat("t"), "nvext": {"agent_context": {"session_id": "c", "parent_session_id": "r"}}}
    assert h.request("openai", {}, chain, now=1.8).agent_id == child.agent_id
    # another tenant's equal chain id is another session; a bad id falls back to the other identities
    other = h.request("openai", {"x-dynamo-session-id": "r", "authorization": "Bearer b"}, _chat("t"), now=2.0)
    assert other.session_id != root.session_id
    odd = h.request("openai", {"x-session-id": "plain"}, {**_chat("t"), "nvext": {"agent_context": {
        "session_id": "run-1", "trajectory_id": ["not", "a", "string"]}}}, now=2.1)
    assert odd.session_id == h.request("openai", {"x-session-id": "plain"}, _chat("t"), now=2.2).session_id


def test_named_parents_that_loop_back_never_raise() -> None:
    """A client naming parents can make a loop (an agent pushed out of its session and named again under its
    own child): the loop is cut when the agent is made, and announcing never recurses without end."""
    h = StreamHints(StreamLimits(max_agents_per_session=2))

    def chain(name: str, parent: str | None = None) -> dict:
        hdrs = {"x-dynamo-session-id": name}
        return hdrs | ({"x-dynamo-parent-session-id": parent} if parent else {})

    a = h.request("openai", chain("A"), _chat("t"), now=0.0)
    b = h.request("openai", chain("B", "A"), _chat("t"), now=0.1)
    h.request("openai", chain("C", "A"), _chat("t"), now=0.2)  # A is pushed out of the session's two agents
    b = h.request("openai", chain("B", "A"), _chat("t"), now=0.3)
    a = h.request("openai", chain("A", "B"), _chat("t"), now=0.4)  # B's parent is A: a loop, cut
    events = h.response(a, [("a1", "x")], now=0.5) + h.response(b, [("b1", "x")], now=0.6)
    spawns = {e[1]["agent_id"]: e[1]["parent_agent_id"] for e in events if e[0] == "agent_spawn"}
    assert spawns[a.agent_id] == ""


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
    h = StreamHints(StreamLimits(max_sessions=1000, call_ttl_s=1e6))
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
    again = h.request("openai", {"x-session-id": "s0"}, back, now=1e4)
    assert _kinds(again.events) == ["tool_call_end", "session_end"]  # it pushed out the oldest kept session
    assert _kinds(h.response(again, [("c0b", "bash")], now=1e4))[:2] == ["session_start", "agent_spawn"]
    assert len(h._deadlines) <= 2 * h._live_calls + 1024 + 1
    # the forgotten sessions ended on the server too, their calls cancelled
    assert h.counters["tool_calls_ended_cancelled"] == 9001


def test_tenants_with_the_same_session_id_never_meet() -> None:
    h = StreamHints()
    a = h.request("openai", {"x-session-id": "shared", "authorization": "Bearer key-a"}, _chat("t"), now=0.0)
    b = h.request("openai", {"x-session-id": "shared", "authorization": "Bearer key-b"}, _chat("t"), now=0.0)
    assert a.session_id != b.session_id
    h.response(a, [("c1", "bash")], now=1.0)
    # an x-api-key (Anthropic's header) is a tenant too
    k1 = h.request("anthropic", {"x-session-id": "shared", "x-api-key": "k1"}, {"messages": []}, now=0.0)
    k2 = h.request("anthropic", {"x-session-id": "shared", "x-api-key": "k2"}, {"messages": []}, now=0.0)
    assert k1.session_id != k2.session_id
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
    spawn = [e for e in h.response(two, [("c2", "sum")], now=0.5) if e[0] == "agent_spawn"]
    assert spawn[0][1]["parent_agent_id"] == ""  # a peer (same system prompt), not a sub-agent
    h.response(one, [("c1", "search")], now=1.0)
    again = h.request("openai", {"x-session-id": "reused"}, _chat("sum these numbers", {
        "role": "assistant", "content": "5"}, {"role": "user", "content": "and now?"}), now=2.0)
    assert again.agent_id == two.agent_id  # its own call c2 ends (cancelled); c1 is still in flight
    assert [(e[1]["tool_call_id"], e[1]["status"]) for e in again.events] == [("c2", "cancelled")]
    cancelled = h.request("openai", {"x-session-id": "reused"}, _chat("write a poem", {
        "role": "assistant", "content": ""}, {"role": "user", "content": "never mind"}), now=3.0)
    assert [e[1]["status"] for e in cancelled.events] == ["cancelled"]  # back without the result


@pytest.mark.parametrize("body", [None, [], "text", {"messages": "no"}, {"messages": [1, None, {"role": 5}]},
                                  {"messages": [{"role": "user", "content": {"odd": [1, 2]}}], "metadata": [1]},
                                  {"messages": [], "nvext": [1]}, {"messages": [], "nvext": {"agent_context": "x"}},
                                  {"messages": [], "nvext": {"agent_context": {"session_id": float("nan"),
                                                                               "trajectory_id": "t" * 10_000}}},
                                  {"messages": [], "nvext": {"agent_context": {"session_id": "s", "trajectory_id": "t",
                                                                               "parent_trajectory_id": {"a": 1}}}},
                                  {"messages": [], "tools": [{"x": 1}], "tool_choice": {"type": ["required"]}},
                                  {"messages": [], "tools": [1], "tool_choice": [{"type": "function"}]}])
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
    for i in range(4):  # three calls of 2 s; the fourth timed out after 100 s and is not a duration
        g.start_tool_call("t", "s", "a", f"c{i}", "bash", expected_s=None, now_s=200.0 * i)
        g.end_tool_call("t", "s", "a", f"c{i}", now_s=200.0 * i + (2.0 if i < 3 else 100.0), observed=i < 3)
    assert g.history.predict_s("s", "bash", None) == pytest.approx(2.0)


def test_the_hint_server_does_not_learn_from_a_timed_out_or_cancelled_call() -> None:
    from kvtier.hints.apply import HintApplier
    from kvtier.hints._gen import hints_pb2 as pb

    g = AgentGraph(global_fallback=True)
    app = HintApplier(g)
    assert g.start_session("t", "s", 0.0) is None and g.spawn_agent("t", "s", "a", 0.0, agent_type="s") is None
    for i, (status, took) in enumerate([(pb.TOOL_STATUS_OK, 2.0)] * 3 + [(pb.TOOL_STATUS_TIMEOUT, 300.0),
                                                                        (pb.TOOL_STATUS_CANCELLED, 90.0)]):
        g.start_tool_call("t", "s", "a", f"c{i}", "bash", expected_s=None, now_s=1000.0 * i)
        end = pb.ToolCallEnd(session_id="s", agent_id="a", tool_call_id=f"c{i}", status=status)
        assert app._s_tool_call_end("t", end, 1000.0 * i + took, "client") is None
    assert g.history.predict_s("s", "bash", None) == pytest.approx(2.0)


def test_two_results_for_one_of_two_calls_end_the_other_cancelled_in_any_order() -> None:
    for order in (["c1", "c2"], ["c2", "c1"]):
        h = StreamHints()
        d = h.request("openai", {"x-session-id": "s"}, _chat("t"), now=0.0)
        h.response(d, [(c, "bash") for c in order], now=1.0)
        back = h.request("openai", {"x-session-id": "s"}, _chat("t", {"role": "assistant", "content": ""},
                         {"role": "tool", "tool_call_id": "c1", "content": "x"},
                         {"role": "user", "content": "(a note the client added)"}), now=2.0)
        assert {e[1]["tool_call_id"]: e[1]["status"] for e in back.events} == {"c1": "ok", "c2": "cancelled"}


# --- the ASGI middleware (kvtier_vllm.middleware), against a stand-in app: no vLLM needed ---------------------


class _Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict]] = []

    def emit(self, kind: str, **fields: object) -> bool:
        self.events.append((kind, fields))
        return True


def _asgi(mw, path: str, body: bytes, response: list[dict], chunks: int = 1, headers: list | None = None):
    """Run one request through ``mw`` whose app answers ``response`` (ASGI messages); what the app received
    (headers, body) and what the client got."""
    import asyncio

    seen: dict = {}

    async def app(scope, receive, send):
        got = b""
        while True:
            msg = await receive()
            got += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        seen["headers"], seen["body"] = dict(scope["headers"]), got
        for m in response:
            await send(m)

    mw.app = app
    parts = [body[i * len(body) // chunks:(i + 1) * len(body) // chunks] for i in range(chunks)]
    inbox = [{"type": "http.request", "body": p, "more_body": i < chunks - 1} for i, p in enumerate(parts)]
    sent: list[dict] = []

    async def receive():
        return inbox.pop(0) if inbox else {"type": "http.disconnect"}

    async def send(m):
        sent.append(m)

    scope = {"type": "http", "method": "POST", "path": path, "root_path": "",
             "headers": (headers or []) + [(b"content-length", str(len(body)).encode())]}
    asyncio.run(mw(scope, receive, send))
    return seen, sent


def _middleware():
    from kvtier_vllm.middleware import RequestStreamHints

    mw = RequestStreamHints(None)
    mw._client, mw._client_tried = _Recorder(), True
    return mw


def test_the_middleware_tags_the_body_and_reads_tool_calls_from_json_and_sse() -> None:
    mw = _middleware()
    req = json.dumps({**_chat("fix ü"), "kv_transfer_params": {"other": 1}}).encode()
    answer = json.dumps({"choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
        "tool_calls": [{"id": "c1", "function": {"name": "bash", "arguments": "{}"}}]}}]}).encode()
    seen, sent = _asgi(mw, "/v1/chat/completions", req, [
        {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]},
        {"type": "http.response.body", "body": answer[:9], "more_body": True},
        {"type": "http.response.body", "body": answer[9:], "more_body": False}], chunks=3,
        headers=[(b"x-session-id", b"s1")])
    body = json.loads(seen["body"])
    assert body["kv_transfer_params"]["other"] == 1 and "kvtier_session_id" in body["kv_transfer_params"]
    assert seen["headers"][b"content-length"] == str(len(seen["body"])).encode()
    assert b"".join(m.get("body", b"") for m in sent) == answer  # the response is untouched
    assert [k for k, _ in mw._client.events] == ["session_start", "agent_spawn", "tool_call_start"]
    # a streamed response (the content type says so, whatever the body's "stream" was)
    sse = b'data: {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "c2", "function": ' \
          b'{"name": "grep"}}]}}]}\n\ndata: [DONE]\n\n'
    back = json.dumps({**_chat("fix ü", {"role": "assistant", "content": ""},
                              {"role": "tool", "tool_call_id": "c1", "content": "ok"}), "stream": "false"}).encode()
    _asgi(mw, "/v1/chat/completions", back, [
        {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]},
        {"type": "http.response.body", "body": sse, "more_body": False}], headers=[(b"x-session-id", b"s1")])
    assert [(k, f.get("tool_call_id")) for k, f in mw._client.events[3:]] == [("tool_call_end", "c1"),
                                                                               ("tool_call_start", "c2")]


def test_the_middleware_says_a_forced_calls_wait_unless_the_client_did() -> None:
    mw = _middleware()
    forced = {**_chat("go"), "tools": [{"type": "function", "function": {"name": "bash"}}], "tool_choice": "required"}
    reply = [{"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]},
             {"type": "http.response.body", "body": b"{}", "more_body": False}]
    seen, _ = _asgi(mw, "/v1/chat/completions", json.dumps(forced).encode(), reply)
    assert json.loads(seen["body"])["kv_transfer_params"]["kvtier_tool_wait_s"] == 10.0
    own = {**forced, "kv_transfer_params": {"kvtier_tool_wait_s": 3.0}}
    seen, _ = _asgi(mw, "/v1/chat/completions", json.dumps(own).encode(), reply)
    params = json.loads(seen["body"])["kv_transfer_params"]
    assert params["kvtier_tool_wait_s"] == 3.0 and "kvtier_session_id" in params


def test_the_middleware_passes_through_what_it_cannot_or_must_not_read() -> None:
    mw = _middleware()
    ok = [{"type": "http.response.start", "status": 200, "headers": []},
          {"type": "http.response.body", "body": b"{}", "more_body": False}]
    for path, body in [("/v1/chat/completions", b"not json"), ("/v1/completions", b'{"prompt": "x"}'),
                       ("/v1/chat/completions", json.dumps({**_chat("x"), "kv_transfer_params": "odd"}).encode()),
                       ("/v1/chat/completions", json.dumps({**_chat("x"), "kv_transfer_params": {
                           "kvtier_session_id": "sdk", "kvtier_agent_id": "a"}}).encode())]:
        seen, sent = _asgi(mw, path, body, ok)
        assert seen["body"] == body and sent == ok, path
    # an error response teaches nothing
    seen, sent = _asgi(mw, "/v1/messages", json.dumps({"messages": [{"role": "user", "content": "q"}]}).encode(),
                       [{"type": "http.response.start", "status": 401, "headers": []},
                        {"type": "http.response.body", "body": b'{"content": [{"type": "tool_use", "id": "t", '
                                                               b'"name": "x"}], "type": "message"}'}])
    assert mw._client.events == []


def test_per_session_entries_never_push_out_the_shared_fallbacks() -> None:
    h = DurationHistory(max_keys=16, global_fallback=True)
    for i in range(200):  # 200 sessions, one call each: far more (session, tool) keys than fit
        h.observe(f"s-{i}", "pytest", 3.0)
    assert len(h) <= 16
    assert h.predict_s("s-new", "pytest", None) == pytest.approx(3.0)  # the tool's pooled entry survived
    assert h.predict_s("s-new", "never-seen", None) == pytest.approx(3.0)  # and the all-tools one
