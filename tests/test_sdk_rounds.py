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
