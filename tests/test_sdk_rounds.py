"""The round-aware prompt layout (``kvtier.sdk.rounds``): every agent's prompt of a round
shares its prefix token for token, whatever order the round's outputs came in."""

from __future__ import annotations

import doctest

import pytest

from kvtier.sdk import rounds
from kvtier.sdk.rounds import RoundLayout


def test_the_module_examples_hold() -> None:
    assert doctest.testmod(rounds).failed == 0


def test_every_agent_of_a_round_shares_the_prefix_in_any_arrival_order() -> None:
    a, b = RoundLayout([1, 2]), RoundLayout([1, 2])
    a.add_round({"x": [5, 6], "y": [7]})
    b.add_round({"y": [7], "x": [5, 6]})  # the same round, finished in the other order
    pa, pb = a.prompt([100, 101]), b.prompt([200])
    assert pa.tokens[: pa.shared_tokens] == pb.tokens[: pb.shared_tokens] == [1, 2, 5, 6, 7]
    assert pa.tokens[pa.shared_tokens:] == [100, 101] and pb.tokens[pb.shared_tokens:] == [200]


def test_each_round_extends_the_last_rounds_prefix() -> None:
    layout = RoundLayout([1])
    first = layout.prompt([9]).shared_tokens
    layout.add_round({"a": [2, 3]})
    second = layout.prompt([9])
    assert second.tokens[:first] == [1] and second.shared_tokens == 3 and layout.rounds == 1
    assert second.shared_blocks(2) == 1


def test_agent_ids_must_be_strings() -> None:
    with pytest.raises(TypeError, match="agent ids must be str"):
        RoundLayout([]).add_round({1: [2]})


class _Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict]] = []

    def emit(self, kind: str, **fields) -> bool:
        from kvtier.sdk.client import _check_fields

        _check_fields(kind, fields)  # what HintClient.emit checks before queueing
        self.events.append((kind, fields))
        return True


def test_a_shared_round_is_announced_with_its_agents_and_ended() -> None:
    from kvtier.sdk import SessionHandle

    client = _Recorder()
    with SessionHandle(client, "s1").shared_round("r2", ["a0", "a1"]):
        pass
    assert client.events == [
        ("shared_round_start", {"session_id": "s1", "round_id": "r2", "agent_ids": ["a0", "a1"],
                                "shared_block_keys": b""}),
        ("shared_round_end", {"session_id": "s1", "round_id": "r2"})]
    with pytest.raises(ValueError, match="agent_ids"):
        SessionHandle(client, "s1").shared_round("r3", [])


def test_round_tags_carry_the_round_and_its_shared_length() -> None:
    from kvtier.sdk import request_round, tag_request, tag_round

    layout = RoundLayout(preamble=list(range(70)))
    prompt = layout.prompt([5, 6])
    body = tag_round(tag_request({}, "s1", "a0"), "r1", prompt.shared_tokens)
    assert request_round(body["kv_transfer_params"]) == ("r1", 70)
    assert body["kv_transfer_params"]["kvtier_agent_id"] == "a0"
    for bad in ({"kvtier_round_id": "r1"}, {"kvtier_round_id": "", "kvtier_shared_tokens": 3},
                {"kvtier_round_id": "r1", "kvtier_shared_tokens": -1}, None):
        assert request_round(bad) is None
    with pytest.raises(ValueError, match="shared_tokens"):
        tag_round({}, "r1", True)
