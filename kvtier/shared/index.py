"""SharedIndex: the bookkeeping of shared segments (masters, mirrors, ref counts).

Owns: for each shared segment, which tier holds it, the slots of its master
blocks (pool tiers), which agent owns the master, which agents hold mirrors
and how many diff bytes each mirror stores, reader pins, slot and diff-byte
budgets per tier, and recency. Must not touch bytes, import torch or do I/O:
:class:`~kvtier.shared.store.SharedStore` moves the bytes and reports back.

Rules it enforces (``check_invariants`` asserts them):

* One master per segment; every mirror of a segment diffs against that
  segment's master and nothing else (a mirror is a record of the segment,
  never of another mirror), so mirror-of-mirror chains cannot exist.
* ``ref_count = (1 if the master has an owner) + mirrors + reader pins``; a
  segment is freed exactly when it reaches 0, so a master outlives its owner
  while mirrors use it, and nothing dangles.
* A promoted mirror (re-base) becomes the owned master in the same slots;
  the old owner's copy is gone and every other mirror must be re-diffed
  against the new master before the promotion commits.
* Free + used slots == capacity per pool tier; used diff bytes <= budget.

Not thread-safe: the store serialises calls under its lock.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import NewType

from ..errors import ConfigError, ProtocolError
from .segments import SegmentKey

AgentId = NewType("AgentId", str)
POOL_TIERS: tuple[str, ...] = ("hbm", "dram")
SHARED_TIERS: tuple[str, ...] = ("hbm", "dram", "ssd")


@dataclass(frozen=True, slots=True)
class MirrorInfo:
    """One agent's mirror of a segment: how many blocks differ and their diff bytes."""

    agent: AgentId
    num_diff_blocks: int
    diff_bytes: int


@dataclass(frozen=True, slots=True)
class SegmentInfo:
    """A snapshot of one segment's bookkeeping."""

    segment: SegmentKey
    tier: str
    num_blocks: int
    slots: tuple[int, ...]
    owner: AgentId | None
    mirrors: tuple[MirrorInfo, ...]
    num_readers: int

    @property
    def ref_count(self) -> int:
        return (self.owner is not None) + len(self.mirrors) + self.num_readers


@dataclass(slots=True)
class _Segment:
    key: SegmentKey
    tier: str
    num_blocks: int
    slots: tuple[int, ...]
    owner: AgentId | None
    mirrors: dict[AgentId, MirrorInfo] = field(default_factory=dict)
    num_readers: int = 0
    last_use: int = 0

    @property
    def ref_count(self) -> int:
        return (self.owner is not None) + len(self.mirrors) + self.num_readers


class SharedIndex:
    """Masters and mirrors of shared segments in ``capacity_blocks`` tiers.

    ``capacity_blocks[tier]`` bounds master blocks per tier (``hbm`` / ``dram``
    are slot pools; ``ssd`` is counted only); ``diff_capacity_bytes[tier]``
    bounds the diff bytes of mirrors stored there. All operations are O(1) or
    O(mirrors of one segment) except :meth:`lru_segments` (O(segments log segments)).

    >>> ix = SharedIndex({"dram": 4}, {"dram": 1000})
    >>> ix.add_master(SegmentKey(7), AgentId("a"), "dram", 2)
    (0, 1)
    >>> ix.add_mirror(SegmentKey(7), AgentId("b"), num_diff_blocks=1, diff_bytes=100)
    True
    >>> ix.release(SegmentKey(7), AgentId("a")).freed  # the mirror keeps the master alive
    False
    >>> ix.release(SegmentKey(7), AgentId("b")).freed, ix.free_slots("dram")
    (True, 4)
    """

    def __init__(self, capacity_blocks: Mapping[str, int], diff_capacity_bytes: Mapping[str, int]) -> None:
        self._capacity: dict[str, int] = {}
        self._diff_capacity: dict[str, int] = {}
        for tier, cap in capacity_blocks.items():
            if tier not in SHARED_TIERS:
                raise ConfigError("shared.tier", tier, f"valid tiers: {list(SHARED_TIERS)}")
            if not isinstance(cap, int) or cap < 0:
                raise ConfigError(f"shared.{tier}.capacity_blocks", cap, "must be an integer >= 0")
            self._capacity[tier] = cap
            diff_cap = diff_capacity_bytes.get(tier, 0)
            if not isinstance(diff_cap, int) or diff_cap < 0:
                raise ConfigError(f"shared.{tier}.diff_capacity_bytes", diff_cap, "must be an integer >= 0")
            self._diff_capacity[tier] = diff_cap
        self._free: dict[str, list[int]] = {t: list(range(c - 1, -1, -1)) for t, c in self._capacity.items()
                                            if t in POOL_TIERS}
        self._used_blocks: dict[str, int] = dict.fromkeys(self._capacity, 0)
        self._used_diff: dict[str, int] = dict.fromkeys(self._capacity, 0)
        self._segments: dict[SegmentKey, _Segment] = {}
        self._tick = 0

    # ------------------------------------------------------------ queries

    @property
    def tier_names(self) -> tuple[str, ...]:
        return tuple(self._capacity)

    def capacity_blocks(self, tier: str) -> int:
        return self._capacity[self._check_tier(tier)]

    def used_blocks(self, tier: str) -> int:
        return self._used_blocks[self._check_tier(tier)]

    def free_slots(self, tier: str) -> int:
        return self._capacity[self._check_tier(tier)] - self._used_blocks[tier]

    def used_diff_bytes(self, tier: str) -> int:
        return self._used_diff[self._check_tier(tier)]

    def info(self, seg: SegmentKey) -> SegmentInfo | None:
        """Snapshot of ``seg``, or ``None`` when it is not stored."""
        s = self._segments.get(seg)
        if s is None:
            return None
        return SegmentInfo(s.key, s.tier, s.num_blocks, s.slots, s.owner, tuple(s.mirrors.values()), s.num_readers)

    def role(self, seg: SegmentKey, agent: AgentId) -> str | None:
        """``"master"``, ``"mirror"`` or ``None``: what ``agent`` holds of ``seg``."""
        s = self._segments.get(seg)
        if s is None:
            return None
        if s.owner == agent:
            return "master"
        return "mirror" if agent in s.mirrors else None

    def segments(self) -> Iterator[SegmentKey]:
        return iter(list(self._segments))

    def lru_segments(self, tier: str) -> list[SegmentKey]:
        """Segments of ``tier`` without reader pins, least recently used first."""
        cands = [s for s in self._segments.values() if s.tier == tier and not s.num_readers]
        return [s.key for s in sorted(cands, key=lambda s: s.last_use)]

    # ------------------------------------------------------------ masters and mirrors

    def can_add_master(self, tier: str, num_blocks: int) -> bool:
        return self.free_slots(tier) >= num_blocks

    def add_master(self, seg: SegmentKey, owner: AgentId, tier: str, num_blocks: int) -> tuple[int, ...] | None:
        """Record ``owner``'s copy of a new segment as its master in ``tier``.

        Returns the reserved slots (empty for ``ssd``), or ``None`` when the
        tier has fewer than ``num_blocks`` free. Raises ``ProtocolError`` if
        ``seg`` already has a master (add a mirror instead).
        """
        if seg in self._segments:
            raise ProtocolError(f"segment {seg:#x} already has a master; store other copies as mirrors")
        if not self.can_add_master(tier, num_blocks):
            return None
        slots = tuple(self._free[tier].pop() for _ in range(num_blocks)) if tier in self._free else ()
        self._used_blocks[tier] += num_blocks
        self._segments[seg] = _Segment(seg, tier, num_blocks, slots, owner, last_use=self._next_tick())
        return slots

    def can_add_mirror(self, seg: SegmentKey, diff_bytes: int) -> bool:
        s = self._segments.get(seg)
        return s is not None and self._used_diff[s.tier] + diff_bytes <= self._diff_capacity[s.tier]

    def add_mirror(self, seg: SegmentKey, agent: AgentId, num_diff_blocks: int, diff_bytes: int) -> bool:
        """Record ``agent``'s mirror of ``seg`` (diffed against its master). ``False``
        when the tier's diff budget is full. Raises ``ProtocolError`` when
        ``seg`` has no master or ``agent`` already holds a copy."""
        s = self._live(seg)
        if agent == s.owner or agent in s.mirrors:
            raise ProtocolError(f"agent {agent!r} already holds segment {seg:#x}; release it first")
        if not self.can_add_mirror(seg, diff_bytes):
            return False
        s.mirrors[agent] = MirrorInfo(agent, num_diff_blocks, diff_bytes)
        self._used_diff[s.tier] += diff_bytes
        s.last_use = self._next_tick()
        return True

    def touch(self, seg: SegmentKey) -> None:
        self._live(seg).last_use = self._next_tick()

    def pin_reader(self, seg: SegmentKey) -> None:
        """A restore is reading ``seg``: it cannot be freed, moved or re-based until unpinned."""
        self._live(seg).num_readers += 1

    def unpin_reader(self, seg: SegmentKey) -> ReleaseResult:
        s = self._live(seg)
        if s.num_readers <= 0:
            raise ProtocolError(f"segment {seg:#x} has no reader pin to release")
        s.num_readers -= 1
        return self._maybe_free(s, ())

    # ------------------------------------------------------------ release, evict, re-base

    def release(self, seg: SegmentKey, agent: AgentId) -> ReleaseResult:
        """``agent`` drops its copy. A mirror frees its diff bytes; the owner of the
        master only clears ownership (mirrors keep the master alive). The segment
        is freed when its ref count reaches 0."""
        s = self._live(seg)
        dropped: tuple[AgentId, ...] = ()
        if s.owner == agent:
            s.owner = None
        elif agent in s.mirrors:
            self._used_diff[s.tier] -= s.mirrors.pop(agent).diff_bytes
            dropped = (agent,)
        else:
            raise ProtocolError(f"agent {agent!r} holds no copy of segment {seg:#x}")
        return self._maybe_free(s, dropped)

    def drop(self, seg: SegmentKey) -> ReleaseResult:
        """Evict the master and every mirror of ``seg`` (no re-base). Raises
        ``ProtocolError`` while a restore pins it."""
        s = self._live(seg)
        if s.num_readers:
            raise ProtocolError(f"segment {seg:#x} is being restored; evict it after the restore")
        dropped = tuple(s.mirrors)
        for m in s.mirrors.values():
            self._used_diff[s.tier] -= m.diff_bytes
        s.mirrors.clear()
        s.owner = None
        return self._maybe_free(s, dropped)

    def promote(self, seg: SegmentKey, agent: AgentId, rediffed: Mapping[AgentId, MirrorInfo]) -> None:
        """Re-base: mirror ``agent`` becomes the owned master (same slots, its bytes
        now written there); the old owner loses its copy; every other mirror is
        replaced by its entry in ``rediffed`` (diffed against the new master) or,
        when absent there, dropped. Raises ``ProtocolError`` while pinned."""
        s = self._live(seg)
        if s.num_readers:
            raise ProtocolError(f"segment {seg:#x} is being restored; re-base it after the restore")
        if agent not in s.mirrors:
            raise ProtocolError(f"agent {agent!r} has no mirror of segment {seg:#x} to promote")
        for a, m in rediffed.items():
            if a == agent or a not in s.mirrors or m.agent != a:
                raise ProtocolError(f"re-base of {seg:#x}: {a!r} is not another mirror of the segment")
        for m in s.mirrors.values():
            self._used_diff[s.tier] -= m.diff_bytes
        s.mirrors = {a: rediffed[a] for a in s.mirrors if a in rediffed}
        for m in s.mirrors.values():
            self._used_diff[s.tier] += m.diff_bytes
        s.owner = agent
        s.last_use = self._next_tick()

    def prepare_move(self, seg: SegmentKey, dst: str) -> tuple[int, ...] | None:
        """Reserve ``dst`` room for ``seg``'s master (slots; empty for ``ssd``) before
        copying it there; ``None`` when ``dst`` has no room. Then :meth:`complete_move`."""
        s = self._live(seg)
        self._check_tier(dst)
        if dst == s.tier or s.num_readers:
            raise ProtocolError(f"segment {seg:#x}: cannot move from {s.tier} to {dst} (same tier or pinned)")
        if not self.can_add_master(dst, s.num_blocks):
            return None
        slots = tuple(self._free[dst].pop() for _ in range(s.num_blocks)) if dst in self._free else ()
        self._used_blocks[dst] += s.num_blocks
        return slots

    def complete_move(self, seg: SegmentKey, dst: str, slots: tuple[int, ...], ok: bool,
                      diff_sizes: Mapping[AgentId, int] | None = None) -> None:
        """Commit (``ok``: the master and mirror diffs now live in ``dst``, re-encoded to
        ``diff_sizes``) or roll back the move reserved by :meth:`prepare_move`."""
        s = self._live(seg)
        if not ok:
            self._give_back(dst, slots, s.num_blocks)
            return
        self._give_back(s.tier, s.slots, s.num_blocks)
        sizes = diff_sizes or {}
        moved = {a: MirrorInfo(a, m.num_diff_blocks, sizes.get(a, m.diff_bytes)) for a, m in s.mirrors.items()}
        for m in s.mirrors.values():
            self._used_diff[s.tier] -= m.diff_bytes
        for m in moved.values():
            self._used_diff[dst] += m.diff_bytes
        s.tier, s.slots, s.mirrors = dst, slots, moved

    # ------------------------------------------------------------ invariants

    def check_invariants(self) -> None:
        """Assert every rule in the module docstring (O(segments + slots))."""
        used = dict.fromkeys(self._capacity, 0)
        diff = dict.fromkeys(self._capacity, 0)
        taken: dict[str, set[int]] = {t: set() for t in self._free}
        for key, s in self._segments.items():
            assert key == s.key and s.ref_count > 0, f"segment {key:#x} kept with ref count {s.ref_count}"
            assert s.num_readers >= 0
            assert s.owner not in s.mirrors, f"segment {key:#x}: the owner also holds a mirror"
            used[s.tier] += s.num_blocks
            diff[s.tier] += sum(m.diff_bytes for m in s.mirrors.values())
            if s.tier in taken:
                assert len(s.slots) == s.num_blocks and not taken[s.tier] & set(s.slots), f"{key:#x}: slots"
                taken[s.tier] |= set(s.slots)
            else:
                assert s.slots == ()
            for a, m in s.mirrors.items():
                assert m.agent == a and 0 <= m.num_diff_blocks <= s.num_blocks and m.diff_bytes >= 0
        for t in self._capacity:
            assert used[t] == self._used_blocks[t] <= self._capacity[t], f"{t}: used blocks"
            assert diff[t] == self._used_diff[t] <= self._diff_capacity[t], f"{t}: diff bytes"
        for t, free in self._free.items():
            assert len(free) + used[t] == self._capacity[t] and not taken[t] & set(free), f"{t}: free + used"

    # ------------------------------------------------------------ internals

    def _live(self, seg: SegmentKey) -> _Segment:
        s = self._segments.get(seg)
        if s is None:
            raise ProtocolError(f"segment {seg:#x} is not stored")
        return s

    def _check_tier(self, tier: str) -> str:
        if tier not in self._capacity:
            raise ConfigError("shared.tier", tier, f"not an enabled tier; enabled: {list(self._capacity)}")
        return tier

    def _maybe_free(self, s: _Segment, dropped: tuple[AgentId, ...]) -> ReleaseResult:
        if s.ref_count:
            return ReleaseResult(False, s.tier, (), dropped)
        del self._segments[s.key]
        self._give_back(s.tier, s.slots, s.num_blocks)
        return ReleaseResult(True, s.tier, s.slots, dropped)

    def _give_back(self, tier: str, slots: tuple[int, ...], num_blocks: int) -> None:
        self._used_blocks[tier] -= num_blocks
        if tier in self._free:
            self._free[tier].extend(reversed(slots))

    def _next_tick(self) -> int:
        self._tick += 1
        return self._tick


@dataclass(frozen=True, slots=True)
class ReleaseResult:
    """What a release, unpin or drop did: ``freed`` when the whole segment went
    (its master ``slots`` in ``tier`` are free again); ``dropped_mirrors`` lost
    their diffs (the store deletes their bytes)."""

    freed: bool
    tier: str
    slots: tuple[int, ...]
    dropped_mirrors: tuple[AgentId, ...]
