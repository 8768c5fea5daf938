"""Session-aware eviction (SAE), modelled from vLLM PR #50422, for one host tier.

Owns: the order of one tier's resident blocks grouped by the store that wrote
them (an SAE "session": one request's store batch, or a later batch of the
same request merged into the session its lookup hit), each group's score, the
per-key ghost scores that outlive eviction, and SAE's admission gate. Must
not allocate, copy or free: like every eviction policy it only answers
:class:`~kvtier.manager.TierManager`'s hooks (``kvtier.policies.base``).
Built by the ``sae`` placement (``kvtier.placement.peers``), which feeds it
the two things a key-only policy cannot see: a request's lookup
(:meth:`SAEOrder.lookup`, SAE's ``record_lookup`` + ``touch``) and the start
of a store batch (:meth:`SAEOrder.open_store`, SAE's ``open_session``).

Source: ``vllm/v1/kv_offload/cpu/policies/sae.py`` (``SAECachePolicy``) of the
PR's branch, InbarShapira/vllm at db13bf05, read and paraphrased; no code
copied. What it does, at its defaults:

* a group's score is ``last_touch + 1500 * hits + 30000 / (1 + start_pos / 8)``
  (``start_pos``: the request's blocks already stored ahead of the batch);
  the lowest score is evicted first, each group from its tail (its newest
  block), skipping blocks in use;
* ``touch`` (of a request's keys, by vLLM's offloading connector at its lookup
  and after each store batch that stored) advances a logical timer, adds to each
  looked-up key's ghost score ``w / log2(i + 2)`` (``w`` 12 for a stored
  block, 1 for a miss; ``i`` its position in the request) and gives each
  group hit ``hits += 1`` and ``last_touch = timer``; every 500 touches hits
  and ghosts decay by 0.9 (ghosts of absent keys under 0.01 are dropped);
* a new group's hits start at the sum of its keys' ghost scores / 12,
  truncated; a batch of a request whose lookup hit a stored group continues
  that group (hits and ghosts unchanged, ``last_touch`` refreshed);
* the gate: a store that needs room and does not continue a group is
  declined when ``timer + 30000 / (1 + start_pos / 8)`` is below the worst
  group's score.

Not modelled, or modelled differently:

* SAE's ``evict(n)`` is atomic (all ``n`` or none); the manager here asks for
  one victim at a time, so a batch that finds too few victims stores what
  fits, and a declined batch still fills the tier's free slots;
* the lookup is the request's whole context when it arrives (vLLM's
  scheduler looks up, and may look up again while the request waits); the
  merge pointer is per agent (one request of an agent runs at a time);
* blocks are the replay's (64 tokens in the dev traces); vLLM's offload block
  defaults to the engine's (16 tokens), where ``start_pos`` is 4x larger
  (a stricter gate) and decode stores 4x more batches (a faster timer).
"""

from __future__ import annotations

import math
from typing import Callable, Hashable, Iterable, Sequence

from ..keys import BlockKey
from .base import IsEvictable

POSITION_BONUS = 30000.0  # the score of a new group at start_pos 0, over its timer
POSITION_SCALE = 8.0  # start_pos blocks that halve it
HIT_WEIGHT = 1500.0


class SAEOrder:
    """SAE's eviction order over one tier (see the module docstring).

    A block joins its store batch's group when the store is prepared (SAE inserts it then,
    its copy still pending); it becomes a hit, and evictable, once its copy landed."""

    name = "sae"

    def __init__(self, decay_interval: int = 500, decay_factor: float = 0.9, ghost_hit_weight: float = 12.0,
                 ghost_miss_weight: float = 1.0, ghost_norm: float = 12.0,
                 count: Callable[[str], None] | None = None) -> None:
        self.decay_interval, self.decay_factor = decay_interval, decay_factor
        self.ghost_hit_weight, self.ghost_miss_weight, self.ghost_norm = ghost_hit_weight, ghost_miss_weight, ghost_norm
        self.count = count or (lambda name: None)  # the host's counter (sae_stores_declined, ...)
        self._keys: dict[int, dict[BlockKey, None]] = {}  # group -> its keys in chain order, head first
        self._group: dict[BlockKey, int] = {}  # key (stored, or its store prepared) -> its group
        self._ready: set[BlockKey] = set()  # keys whose copy landed
        self._stats: dict[int, list[float]] = {}  # group -> [hits, last_touch, start_pos]
        self._ghost: dict[BlockKey, float] = {}
        self._held: set[BlockKey] = set()
        self._pointer: dict[Hashable, int] = {}  # requester -> the group its lookup hit last
        self.timer = 0
        self._touches = 0
        self._next_group = 0
        self._open: int | None = None  # the group taking this store's keys
        self._merged = False
        self._start_pos = 0
        self._gate: bool | None = None  # this store's gate: None until it needs room
        self._order: list[int] | None = None  # groups, worst first (None: scores changed since)
        self._batch: tuple[Hashable, tuple[BlockKey, ...], int] | None = None  # requester, touch keys, times
        self._reserved = 0  # blocks the open batch prepared
        self.declined_by: set[Hashable] = set()  # requesters whose running request had a batch declined

    # ------------------------------------------------------------ what the placement tells it

    def lookup(self, requester: Hashable, keys: Sequence[BlockKey], start: int = 0) -> None:
        """A request of ``requester`` with the context ``keys`` looked up ``keys[start:]`` (vLLM
        looks up past its own prefix cache's hit): the merge pointer is the group of the
        last block of that lookup's hit (none: no pointer), then SAE's ``touch`` of all ``keys``."""
        self._pointer.pop(requester, None)
        for key in keys[start:]:
            group = self._group.get(key)
            if group is None:
                break
            self._pointer[requester] = group
        self.touch(keys)

    def touch(self, keys: Iterable[BlockKey], times: int = 1) -> None:
        """SAE's touch of a request's keys (vLLM makes one at its lookup and one after each store
        batch), ``times`` in a row: the timer, ghost scores by position (a landed block is a hit),
        group hits, decay (at the end of the run where a decay falls inside it)."""
        self.timer += times
        touched = set()
        ghost, groups, ready = self._ghost, self._group, self._ready
        for i, key in enumerate(keys):
            group = groups.get(key)
            weight = self.ghost_hit_weight if key in ready else self.ghost_miss_weight
            ghost[key] = ghost.get(key, 0.0) + times * weight / math.log2(i + 2)
            if group is not None:
                touched.add(group)
        for group in touched:
            stats = self._stats[group]
            stats[0] += times
            stats[1] = self.timer
        decays = (self._touches + times) // self.decay_interval - self._touches // self.decay_interval
        self._touches += times
        for _ in range(decays):
            self._decay()
        self._order = None

    def open_store(self, requester: Hashable, keys: Sequence[BlockKey], touch: Sequence[BlockKey] = (),
                   times: int = 1) -> None:
        """A store batch of ``requester``'s request (context ``keys``) begins: it continues the
        group its lookup hit, or opens a new one at ``start_pos`` = the leading blocks of
        ``keys`` stored already. If it prepares any block and the gate did not decline it,
        ``touch`` is touched ``times`` times when it closes (vLLM touches a request's keys
        after each batch that stored)."""
        self.close()
        start_pos = 0
        for key in keys:
            if key not in self._group:
                break
            start_pos += 1
        group = self._pointer.pop(requester, None)
        self._merged = group is not None and group in self._stats
        if self._merged:
            self._stats[group][1] = self.timer
            self.count("sae_stores_merged")
        else:
            group = self._new_group(start_pos)
        self._open, self._start_pos, self._gate = group, start_pos, None
        self._batch, self._reserved = (requester, tuple(touch), times), 0
        self._order = None

    def close(self) -> None:
        """The store batch opened last is done: its touches if it stored."""
        batch, stored = self._batch, self._reserved and self._gate is not False
        group = self._open
        if group is not None and group in self._stats:
            if self._keys[group]:
                self._stats[group][0] = float(int(self._stats[group][0]))
            else:  # it stored nothing: no group
                del self._keys[group], self._stats[group]
        self._open, self._merged, self._batch, self._reserved = None, False, None, 0
        self._order = None
        if batch is not None and stored and batch[1]:
            self.touch(batch[1], batch[2])

    def forget(self, requester: Hashable) -> None:
        """``requester``'s request finished: drop its merge pointer and declined mark."""
        self._pointer.pop(requester, None)
        self.declined_by.discard(requester)

    # ------------------------------------------------------------ the eviction protocol

    def before_insert(self, key: BlockKey) -> None:
        """A store of ``key`` is prepared: it joins the open batch's group (a new group when the
        placement announced none), whose hits a new group seeds from its ghost score."""
        group = self._open
        if group is None:
            group = self._open = self._new_group(0)
        if key in self._group:  # prepared before and never stored (that store was dropped)
            self._leave(key)
        self._keys[group][key] = None
        self._group[key] = group
        self._reserved += 1
        if not self._merged:
            self._stats[group][0] += self._ghost.get(key, 0.0) / self.ghost_norm

    def on_insert(self, key: BlockKey) -> None:
        """``key``'s copy landed: a hit from now on, and evictable when idle."""
        if key not in self._group:  # stored without a prepared store (not on the placement's paths)
            self.before_insert(key)
        self._ready.add(key)

    def on_insert_held(self, key: BlockKey) -> None:
        self.on_insert(key)
        self._held.add(key)

    def on_access(self, key: BlockKey) -> None:
        """A read of a stored block: SAE counts hits once per request, in ``touch``."""

    def on_access_many(self, keys: Iterable[BlockKey]) -> None:
        """See :meth:`on_access`."""

    def on_remove(self, key: BlockKey) -> None:
        self._held.discard(key)
        self._ready.discard(key)
        self._leave(key)

    def on_hold(self, key: BlockKey) -> None:
        self._held.add(key)

    def on_unhold(self, key: BlockKey, front: bool = False) -> None:
        """Evictable again; its place is its group's (``front`` does not apply)."""
        self._held.discard(key)

    def parked_keys(self) -> Iterable[BlockKey]:
        return self._held

    def pop_victim(self, is_evictable: IsEvictable, incoming: BlockKey | None = None) -> BlockKey | None:
        """The newest idle landed block of the worst-scored group; ``None`` when none is evictable or
        the gate declined this store (checked at its first eviction, as SAE checks it in ``evict``)."""
        if self._gate is None:
            self._gate = self._merged or self._admits()
            if not self._gate:
                self.count("sae_stores_declined")
                if self._batch is not None:
                    self.declined_by.add(self._batch[0])
        if not self._gate:
            return self._refused(incoming)
        if self._order is None:
            self._order = sorted(self._stats, key=self.score)  # stable: the older group first on a tie
        held, ready = self._held, self._ready
        for group in self._order:
            keys = self._keys.get(group)
            if not keys:
                continue
            for key in reversed(keys):  # the tail first
                if key in ready and key not in held and is_evictable(key):
                    self._ready.discard(key)
                    self._leave(key)
                    return key
        return self._refused(incoming)

    def _refused(self, incoming: BlockKey | None) -> None:
        """No room for ``incoming``: the manager drops its store, so it leaves the group it joined."""
        if incoming is not None and incoming in self._group and incoming not in self._ready:
            self._leave(incoming)
            self._reserved -= 1

    def __len__(self) -> int:
        return len(self._ready)

    def check_invariants(self) -> None:
        assert self._held <= self._ready <= self._group.keys(), "a held or landed key is in no group"
        assert self._keys.keys() == self._stats.keys(), "a group without its score"
        assert sum(map(len, self._keys.values())) == len(self._group), "a key is in two groups"
        assert all(self._group[k] == g for g, keys in self._keys.items() for k in keys)
        assert all(keys or g == self._open for g, keys in self._keys.items()), "an empty group outlived its store"

    # ------------------------------------------------------------ internals

    def ghost(self, key: BlockKey) -> float:
        """``key``'s ghost score (0.0 when it has none)."""
        return self._ghost.get(key, 0.0)

    def group_of(self, key: BlockKey) -> int | None:
        """The group ``key`` belongs to (``None``: neither stored nor being stored)."""
        return self._group.get(key)

    def score(self, group: int) -> float:
        """The group's score (lower is evicted first)."""
        hits, last_touch, start_pos = self._stats[group]
        return last_touch + HIT_WEIGHT * hits + POSITION_BONUS / (1.0 + start_pos / POSITION_SCALE)

    def _admits(self) -> bool:
        others = [g for g in self._stats if g != self._open]
        if not others:
            return True
        baseline = self.timer + POSITION_BONUS / (1.0 + self._start_pos / POSITION_SCALE)
        return baseline >= min(map(self.score, others))

    def _new_group(self, start_pos: int) -> int:
        group, self._next_group = self._next_group, self._next_group + 1
        self._keys[group] = {}
        self._stats[group] = [0.0, float(self.timer), float(start_pos)]
        self._order = None
        return group

    def _leave(self, key: BlockKey) -> None:
        """``key`` leaves its group; a group left empty goes (the open one when it closes)."""
        group = self._group.pop(key)
        keys = self._keys[group]
        del keys[key]
        if not keys and group != self._open:
            del self._keys[group], self._stats[group]

    def _decay(self) -> None:
        factor = self.decay_factor
        for stats in self._stats.values():
            stats[0] = float(int(stats[0] * factor))
        resident = self._group
        self._ghost = {k: v * factor for k, v in self._ghost.items() if k in resident or v * factor >= 0.01}
