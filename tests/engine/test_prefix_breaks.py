"""Prefix breaks (``kvtier_vllm.prefix_breaks``): an agent's request that does not begin with
its previous prompt is counted with the tokens it loses and logged once per session; an
ordinary growing conversation, a template closing the last block and a branch are not."""

from __future__ import annotations

import logging
from collections import Counter

import pytest
from kvtier_vllm.prefix_breaks import MAX_AGENTS, PrefixBreaks

BS = 16
SYSTEM = list(range(1000, 1000 + 4 * BS))  # 4 blocks


def test_a_growing_conversation_is_no_break() -> None:
    c: Counter[str] = Counter()
    pb = PrefixBreaks(c, BS)
    prompt = SYSTEM + [1] * 20
    for turn in range(5):
        assert pb.arrived(("s", "a"), prompt) is None
        prompt = prompt + [turn + 2] * 30
    assert c["prefix_breaks"] == 0


def test_a_line_rewritten_near_the_top_is_a_break_logged_once_per_session(caplog) -> None:
    c: Counter[str] = Counter()
    pb = PrefixBreaks(c, BS)
    with caplog.at_level(logging.WARNING, logger="kvtier_vllm.prefix_breaks"):
        prompt = SYSTEM + [1] * 40
        assert pb.arrived(("s", "a"), prompt) is None
        for turn in range(3):
            prompt = list(prompt)
            prompt[20] = 5000 + turn  # "Current time: ..." in the system prompt's second block
            prompt += [7] * 25
            assert pb.arrived(("s", "a"), prompt) == 20
    assert c["prefix_breaks"] == 3
    # each turn loses the previous prompt from the break's block (block 1, token 16) on
    assert c["prefix_break_tokens_lost"] == sum(len(SYSTEM) + 40 + 25 * t - BS for t in range(3))
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "session s, agent a" in lines[0] and "first difference at token 20 (block 1" in lines[0]


def test_the_last_block_and_branches_are_not_breaks() -> None:
    c: Counter[str] = Counter()
    pb = PrefixBreaks(c, BS)
    prev = SYSTEM + [1] * 40  # 104 tokens: full blocks up to 96, the last full block starts at 80
    pb.arrived(("s", "a"), prev)
    closed = prev[:90] + [9] * 30  # differs inside the last full block: a template closing the turn
    assert pb.arrived(("s", "a"), closed) is None
    assert pb.arrived(("s", "a"), closed[:50]) is None  # a prefix of the previous prompt: a branch back
    assert pb.arrived(("s", "b"), [3] * 100) is None  # another agent's first request
    assert c["prefix_breaks"] == 0


def test_bounded_and_tolerant() -> None:
    c: Counter[str] = Counter()
    pb = PrefixBreaks(c, BS)
    for i in range(MAX_AGENTS + 10):
        pb.arrived(("s", f"a{i}"), SYSTEM)
    assert len(pb._last) == MAX_AGENTS
    assert pb.arrived(None, SYSTEM) is None and pb.arrived(("s", "x"), None) is None
    assert pb.arrived(("s", "y"), [-1, 2]) is None  # not token ids
    assert c["prefix_breaks"] == 0


@pytest.mark.parametrize("n", [0, 1, 15, 16, 17])
def test_short_prompts(n: int) -> None:
    pb = PrefixBreaks(Counter(), BS)
    pb.arrived(("s", "a"), list(range(n)))
    assert pb.arrived(("s", "a"), [99] * n) is None  # nothing before the last full block to break
