"""Shared rounds: a prefix several agents of a round read, held until they all came.

Owns: the rounds seen in finished requests (``kvtier_round_id``: (session, round
id) -> the round's shared prefix and the agents served so far; at most
``ROUNDS_MAX``, the oldest forgotten first), the hint server's announcements of
the rounds in progress (each one's agents), and per round the reference count
behind its hold: while announced agents are still to be served, the prefix is
held in HBM (the placement's holds) and pinned in the tiers, at most
``ROUND_HOLD_MAX_S``; given back when none is left, or the round ends. Must not
read the hint server (the scheduler's hint intake hands the announcements in),
import vLLM, or plan any load or store.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvtier.keys import BlockKey
from kvtier.manager import TierManager
from kvtier.sdk.params import request_round

from .placement import EnginePlacement

ROUND_HOLD_MAX_S = 600.0  # a shared round's hold and pins end after this long even if its agents never all come
ROUND_UNANNOUNCED_S = 60.0  # a round seen in requests but never announced is forgotten after this long
ROUNDS_MAX = 4096  # shared rounds tracked at once (the oldest forgotten first, their holds given back)

RoundKey = tuple[str, str]
"""(session id, round id)."""


@dataclass(slots=True)
class Round:
    """A shared round seen in requests (``kvtier_round_id``): its shared prefix and
    the agents served so far. ``announced``: its agents, from the hint server."""

    keys: list[BlockKey]
    hashes: list[Any]
    served: set[str] = field(default_factory=set)
    announced: tuple[str, ...] = ()
    created_s: float = 0.0
    held: bool = False  # an HBM hold and tier pins are out
    held_s: float = 0.0  # since when
    pinned: set[BlockKey] = field(default_factory=set)
    done: bool = False  # given back: not held again while the round is announced


class SharedRounds:
    """The shared rounds (see the module doc). ``keys_of(st)``: the keys of a request's
    full blocks; ``pump()``: read the manager's events after pins change."""

    def __init__(self, manager: TierManager, placement: EnginePlacement, counters: Counter[str], block_size: int,
                 hbm_hold: bool, keys_of: Callable[[Any], list[BlockKey]], pump: Callable[[], None]) -> None:
        self.manager = manager
        self.placement = placement
        self.counters = counters
        self.block_size = block_size
        self.hbm_hold = hbm_hold
        self._keys_of = keys_of
        self._pump = pump
        self.tracked: OrderedDict[RoundKey, Round] = OrderedDict()
        self.announced: dict[RoundKey, tuple[str, ...]] = {}

    def served(self, st: Any) -> None:
        """A finished request (the scheduler's record of it) of a shared round: learn the round's
        shared prefix from it (the first one), count its agent as served, settle."""
        tag = request_round(st.params)
        if tag is None or st.agent is None:
            return
        rkey = (st.agent[0], tag[0])  # (its tenant's session, round id), as the hint server's rounds are read
        rnd = self.tracked.get(rkey)
        if rnd is None:
            n = tag[1] // self.block_size
            keys = self._keys_of(st)[:n]
            rnd = self.tracked[rkey] = Round(list(keys), list(st.request.block_hashes[: len(keys)]),
                                             announced=self.announced.get(rkey, ()), created_s=self.placement.now)
            while len(self.tracked) > ROUNDS_MAX:
                self._release(self.tracked.popitem(last=False)[1])
        rnd.served.add(st.agent_id)
        self._settle(rnd)

    def announce(self, rounds: dict[RoundKey, tuple[str, ...]]) -> None:
        """The hint server's rounds in progress (hosted or followed). A round no longer there ended:
        given back and forgotten (one never announced, after ``ROUND_UNANNOUNCED_S``)."""
        self.announced = rounds
        now = self.placement.now
        for rkey, rnd in list(self.tracked.items()):
            rnd.announced = rounds.get(rkey, ())
            if rkey in rounds:
                self._settle(rnd)
            elif rnd.held or rnd.done or now - rnd.created_s > ROUND_UNANNOUNCED_S:
                if rnd.held:
                    self.counters["shared_round_ended_early"] += 1
                self._release(rnd)
                del self.tracked[rkey]

    def release_all(self) -> None:
        """Give back every round's hold and pins and forget the rounds (a connector reset)."""
        for rnd in list(self.tracked.values()):
            self._release(rnd)
        self.tracked.clear()

    def _settle(self, rnd: Round) -> None:
        """Hold the round's shared prefix while announced agents are still to be served
        (the reference count), at most ``ROUND_HOLD_MAX_S``; give it back when none is.
        A round given back stays known (done) while announced: it is not held again."""
        if rnd.done:
            return
        now = self.placement.now
        pending = set(rnd.announced) - rnd.served
        if pending and rnd.keys and not (rnd.held and now - rnd.held_s > ROUND_HOLD_MAX_S):
            if not rnd.held:
                rnd.held, rnd.held_s = True, now
                self.counters["shared_round_holds"] += 1
                if self.placement.holds is not None and self.hbm_hold:
                    tag = self._tag(rnd)
                    self.counters["shared_round_hbm_blocks"] += self.placement.holds.hold(
                        tag, rnd.hashes, now + ROUND_HOLD_MAX_S)
            new = [k for k in rnd.keys if k not in rnd.pinned and self.manager.contains(k)]  # stored by now
            if new:
                if self.manager.pin(new, max(1.0, rnd.held_s + ROUND_HOLD_MAX_S - now)) is None:
                    self.counters["shared_round_pin_refused"] += 1
                else:
                    rnd.pinned.update(new)
                self._pump()
        elif rnd.held or (rnd.announced and not pending):
            if rnd.held and pending:
                self.counters["shared_round_expired"] += 1
            self._release(rnd)
            rnd.done = True

    def _release(self, rnd: Round) -> None:
        """Give back the round's HBM hold and its pins (a key another held round also
        pinned stays pinned)."""
        if not rnd.held:
            return
        rnd.held = False
        self.counters["shared_round_releases"] += 1
        if self.placement.holds is not None:
            self.placement.holds.release(self._tag(rnd))
        others = set().union(*(r.pinned for r in self.tracked.values() if r is not rnd and r.held))
        self.manager.unpin([k for k in rnd.pinned if k not in others])
        rnd.pinned.clear()
        self._pump()

    @staticmethod
    def _tag(rnd: Round) -> BlockKey:
        """The HBM hold's tag of a round (apart from every block key an agent's hold uses)."""
        return BlockKey(id(rnd) | (1 << 127))
