"""kvtier.tiers.lossy: the one place that says which blocks are approximations
(TieredStore and the vLLM connector's scheduler both keep their rule through it)."""

from __future__ import annotations

import doctest

import kvtier.tiers.lossy
from kvtier.keys import BlockKey
from kvtier.tiers.lossy import LossyCopies


def test_module_doctest() -> None:
    assert doctest.testmod(kvtier.tiers.lossy).failed == 0


def test_cold_values_are_lossy_per_block_and_copies_of_copies_stay_copies() -> None:
    lossy = LossyCopies()  # no tier lossy for every value: only what was written cold
    a, b, c = BlockKey(1), BlockKey(2), BlockKey(3)
    lossy.wrote("remote", [a])
    assert lossy.is_lossy(a, "remote") and not lossy.is_lossy(a, "ssd") and not lossy.is_lossy(b, "remote")
    assert lossy.decoded([a, b], ["remote", "remote"]) == 1 and lossy.any_copies()
    lossy.derive([c], [a])  # c was re-rotated from a's decoded bytes
    assert lossy.storable([a, b, c]) == [False, True, False]
    lossy.forget_value(a, "remote")
    assert not lossy.is_lossy(a, "remote") and lossy.is_copy(a)  # the copy outlives the value it came from
    lossy.forget_copy(a)
    lossy.forget_copy(c)
    assert lossy.storable([a, c]) == [True, True] and not lossy.any_copies()
