"""The lossy-copy rule, in one place: an approximation is never stored as if it were exact.

Owns: which blocks hold an approximation of their KV, for every caller that
moves bytes between tiers (:class:`~kvtier.store.TieredStore` and the vLLM
connector's scheduler): the values a lossy codec (``rq4`` / ``rq3``: a tier's
codec, or the cold-block codec) wrote, per tier, and the copies decoded from
one. The rule: a decoded copy is never stored again, in any tier, so a block is
compressed at most once and no tier holds an approximation as exact bytes.
Must not move bytes or decide what to store; callers ask :meth:`storable` and
report what they wrote, read and lost.

>>> lossy = LossyCopies(lossy_tiers=("ssd",))
>>> lossy.is_lossy(7, "ssd"), lossy.is_lossy(7, "remote")
(True, False)
>>> lossy.decoded([7, 8], ["ssd", "dram"])   # 7 was read from a lossy value, 8 was not
1
>>> lossy.storable([7, 8])
[False, True]
>>> lossy.forget_copy(7)                      # its decoded copy is gone
>>> lossy.storable([7])
[True]
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ..keys import BlockKey


class LossyCopies:
    """Lossy values per tier and the decoded copies of them (see the module doc).

    ``lossy_tiers``: tiers whose codec is lossy for every value; other tiers hold a
    lossy value only where :meth:`wrote` said so (cold blocks)."""

    def __init__(self, lossy_tiers: Iterable[str] = ()) -> None:
        self.lossy_tiers = frozenset(lossy_tiers)
        self._values: dict[str, set[BlockKey]] = {}  # tier -> keys written lossy by a per-block codec choice
        self._copies: set[BlockKey] = set()  # keys whose copy outside the lossy values was decoded from one

    def any_copies(self) -> bool:
        """Whether any decoded copy is known (when not, every key is storable)."""
        return bool(self._copies)

    def wrote(self, tier: str, keys: Iterable[BlockKey]) -> None:
        """``keys`` were written to ``tier`` with a lossy codec (a cold block, or the tier's own)."""
        if tier not in self.lossy_tiers:
            self._values.setdefault(tier, set()).update(keys)

    def is_lossy(self, key: BlockKey, tier: str) -> bool:
        """Whether ``tier``'s value of ``key`` is an approximation."""
        return tier in self.lossy_tiers or key in self._values.get(tier, ())

    def decoded(self, keys: Sequence[BlockKey], tiers: Sequence[str]) -> int:
        """``keys[i]`` was read from ``tiers[i]``: those read from a lossy value are now
        decoded copies. Returns how many."""
        n = 0
        for key, tier in zip(keys, tiers):
            if self.is_lossy(key, tier):
                self._copies.add(key)
                n += 1
        return n

    def derive(self, keys: Sequence[BlockKey], sources: Sequence[BlockKey]) -> None:
        """``keys[i]`` was made from ``sources[i]``'s bytes (e.g. re-rotated): a copy of a
        decoded copy is one too."""
        self._copies.update(k for k, src in zip(keys, sources) if src in self._copies)

    def is_copy(self, key: BlockKey) -> bool:
        """Whether the copy of ``key`` outside the lossy values was decoded from one."""
        return key in self._copies

    def storable(self, keys: Iterable[BlockKey]) -> list[bool]:
        """Per key, whether its bytes may be stored: not a decoded copy."""
        copies = self._copies
        return [k not in copies for k in keys]

    def forget_value(self, key: BlockKey, tier: str) -> None:
        """``tier``'s value of ``key`` is gone."""
        values = self._values.get(tier)
        if values is not None:
            values.discard(key)

    def forget_copy(self, key: BlockKey) -> None:
        """No decoded copy of ``key`` is left: bytes stored under it later were computed."""
        self._copies.discard(key)

    def counts(self) -> dict[str, int]:
        """Sizes, for stats: decoded copies and lossy values per tier (per-block choices only)."""
        return {"lossy_copies": len(self._copies), **{f"lossy_values_{t}": len(v) for t, v in self._values.items()}}
