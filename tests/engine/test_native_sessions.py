"""Agents of requests named only by vLLM's ``session_id`` (``kvtier_vllm.native_sessions``), on
real chained keys: a request that continues an agent's last prompt is that agent, another first
message after the same system prompt is a new one. The connector through a real engine:
tests/engine/test_vllm_stream_hints.py (``vllm-session`` servers)."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

from kvtier_vllm.native_sessions import MAX_AGENTS_PER_SESSION, NativeSessions

from kvtier.keys import Namespace, chain_keys

NS = Namespace(model="m", dtype="bfloat16", layout="fused", block_size=4)
SYSTEM = list(range(100, 116))  # 4 blocks every agent of a session shares


def _req(session):
    return SimpleNamespace(session_id=session)


def test_a_continuation_is_its_agent_and_another_first_message_a_new_one() -> None:
    c: Counter[str] = Counter()
    ns = NativeSessions(c, max_sessions=8)
    a0 = SYSTEM + [1] * 8
    b0 = SYSTEM + [2] * 8
    assert ns.tags(_req("s"), chain_keys(NS, a0)) == ("s", "vllm-0")
    assert ns.tags(_req("s"), chain_keys(NS, b0)) == ("s", "vllm-1")  # shares only the system prompt
    a1 = a0 + [7] * 6  # A's next turn: its last prompt, its output, a tool result (a partial block)
    b1 = b0 + [8] * 9
    assert ns.tags(_req("s"), chain_keys(NS, b1)) == ("s", "vllm-1")
    assert ns.tags(_req("s"), chain_keys(NS, a1)) == ("s", "vllm-0")
    assert ns.tags(_req("s"), chain_keys(NS, a1 + [9] * 4)) == ("s", "vllm-0")
    # another session with the same tokens is its own agents
    assert ns.tags(_req("t"), chain_keys(NS, a1)) == ("t", "vllm-0")
    assert c["native_session_requests"] == 6 and c["native_session_agents"] == 3


def test_the_longest_continuation_wins_and_no_full_block_is_the_first_agent() -> None:
    ns = NativeSessions(Counter(), max_sessions=8)
    parent = SYSTEM + [1] * 4
    assert ns.tags(_req("s"), chain_keys(NS, parent)) == ("s", "vllm-0")
    child = parent + [5] * 8  # forked from the parent's context: continues it, so it is the parent ...
    assert ns.tags(_req("s"), chain_keys(NS, child)) == ("s", "vllm-0")
    other = SYSTEM + [3] * 4
    assert ns.tags(_req("s"), chain_keys(NS, other)) == ("s", "vllm-1")
    assert ns.tags(_req("s"), chain_keys(NS, other + [6] * 4)) == ("s", "vllm-1")  # ... and vllm-1 is not
    assert ns.tags(_req("s"), []) == ("s", "vllm-0")


def test_no_id_or_a_refused_one_leaves_the_request_untagged() -> None:
    c: Counter[str] = Counter()
    ns = NativeSessions(c, max_sessions=8)
    keys = chain_keys(NS, SYSTEM)
    assert ns.tags(SimpleNamespace(), keys) == (None, None)  # a Request without the attribute (older vLLM)
    assert ns.tags(_req(None), keys) == (None, None)
    assert ns.tags(_req(""), keys) == (None, None)
    assert ns.tags(_req(12), keys) == (None, None)
    assert ns.tags(_req("x" * 100_000), keys) == (None, None)
    assert c["native_session_refused"] == 2 and c["native_session_requests"] == 0


def test_sessions_and_agents_are_bounded() -> None:
    ns = NativeSessions(Counter(), max_sessions=3)
    for i in range(10):
        ns.tags(_req(f"s{i}"), chain_keys(NS, SYSTEM))
    assert len(ns._sessions) == 3 and set(ns._sessions) == {"s7", "s8", "s9"}
    for i in range(MAX_AGENTS_PER_SESSION + 5):
        ns.tags(_req("s9"), chain_keys(NS, SYSTEM + [i] * 4))
    assert len(ns._sessions["s9"]) == MAX_AGENTS_PER_SESSION


def test_the_gaps_seen_predict_the_next_wait(monkeypatch) -> None:
    import kvtier_vllm.native_sessions as mod

    clock = [100.0]
    monkeypatch.setattr(mod.time, "monotonic", lambda: clock[0])
    ns = NativeSessions(Counter(), max_sessions=8)
    prompt = SYSTEM + [1] * 4
    waits = []
    for gap in (2.0, 2.0, 2.0, 2.0):
        session, agent = ns.tags(_req("s"), chain_keys(NS, prompt))
        waits.append(ns.ended(session, agent))
        clock[0] += gap
        prompt = prompt + [int(gap)] * 4
    assert waits[:3] == [None, None, None]  # fewer than 3 gaps seen: a turn end
    assert waits[3] == 2.0
    # another session learns from this one's gaps until it has its own
    session, agent = ns.tags(_req("t"), chain_keys(NS, SYSTEM))
    assert ns.ended(session, agent) == 2.0
    assert ns.ended("s", "vllm-9") is None and ns.ended(None, None) is None  # not an agent of the table
