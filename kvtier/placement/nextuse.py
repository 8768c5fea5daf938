"""Predicted next use of every block, from what its agent is doing.

Owns: :class:`AgentNextUse`, the estimate that
:class:`~kvtier.policies.nextuse.NextUsePolicy` orders a tier by. Each block
belongs to the agent that claimed it last (its context when it stopped or
came back); the block's rank (higher: evicted sooner) is its agent's:

* queued in the engine or running: kept, behind everything else (the
  engine's queue is next); for at most ``busy_horizon_s``, so an agent the
  host never reports again ages out;
* waiting (tool, user, sub-agents): the time its wait started, sooner first
  (a wait that has lasted longer is likely the longer one, as with LRU, and
  agent traces' waits are heavy-tailed), plus ``trust`` x the predicted
  wait (the hint plane's, for a tool; ``user_wait_s`` for a user's turn);
* finished: never used again, evicted first.

A block its agent's latest context no longer holds (a compaction, an old
branch) ranks by when it was last claimed, as LRU would; a block nobody
claimed (a request without an agent's tags) by when it was stored or
touched, plus ``trust`` x ``user_wait_s``: as a user's turn. Ranks are fixed when set (in seconds of the host's
clock), so a tier's order needs no periodic refresh.

Fed by a placement policy's hooks (:meth:`used`, :meth:`waiting`,
:meth:`ended`), live or in replay alike; must not read the future, own a
store or decide what to move. Bounded: blocks no tier's policy holds are
swept once the map doubles, and at most ``max_agents`` agents are
remembered (the least recently claiming forgotten: their blocks then age).
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

from ..keys import BlockKey
from ..policies.nextuse import NEVER, NextUsePolicy

AgentKey = tuple[int, str]


class AgentNextUse:
    """Per-block claim and per-agent rank; see the module docstring."""

    def __init__(self, clock: Callable[[], float], trust: float = 0.0, user_wait_s: float = 60.0,
                 busy_horizon_s: float = 3600.0, max_agents: int = 65536) -> None:
        if not trust >= 0:
            raise ValueError(f"trust={trust!r}: must be >= 0")
        self._clock = clock
        self.trust = trust
        self.user_wait_s = user_wait_s
        self.busy_horizon_s = busy_horizon_s
        self.max_agents = max_agents
        # block -> (agent that claimed it last, that claim's serial, rank once it ages: -time of the claim)
        self._owner: dict[BlockKey, tuple[AgentKey, int, float]] = {}
        self._depth: dict[BlockKey, int] = {}
        self._rank: dict[AgentKey, float] = {}  # agent -> its blocks' rank while its latest claim holds them
        self._serial: dict[AgentKey, int] = {}  # agent -> serial of its latest claim (insertion: least recent first)
        self._policies: list[NextUsePolicy] = []
        self._sweep_at = 1 << 16

    clock = -NEVER  # ranks are not due times: nothing is ever overdue

    def policy(self) -> NextUsePolicy:
        """A tier's eviction policy over this estimate (one per tier)."""
        pol = NextUsePolicy(self)
        self._policies.append(pol)
        return pol

    # ------------------------------------------------------------ the estimate

    def next_use(self, key: BlockKey, unknown: float | None = None) -> float:
        """The rank of ``key``; for a block nobody claimed, ``unknown`` when given
        (the rank it had), else now, as a user's turn ahead (see the module docstring)."""
        claim = self._owner.get(key)
        if claim is None:  # nobody's yet: by when it was stored or touched
            return self.unclaimed_rank() if unknown is None else unknown
        agent, serial, aged = claim
        if self._serial.get(agent) != serial:  # left its agent's context since: ages as LRU would
            return aged
        return self._rank.get(agent, aged)

    def unclaimed_rank(self) -> float:
        """The rank of a block no agent claimed, stored or touched now: a request
        sent without an agent's tags is taken as a user's turn (``user_wait_s``
        ahead, weighed by ``trust``), as an agent that waits on its user is, so
        that a tool wait's hint never ranks an agent behind traffic that only
        lacks tags (the replay tags every request; live, other traffic may not)."""
        return -self._clock() + self.trust * self.user_wait_s

    def depth(self, key: BlockKey) -> int:
        return self._depth.get(key, 0)

    # ------------------------------------------------------------ what agents do

    def used(self, agent: AgentKey, keys: Sequence[BlockKey]) -> None:
        """``agent`` is queued or running with the context ``keys``: they go last."""
        self._rank[agent] = -(self._clock() + self.busy_horizon_s)
        self._claim(agent, keys)

    def waiting(self, agent: AgentKey, keys: Sequence[BlockKey], predicted_s: float | None) -> None:
        """``agent`` stopped with the context ``keys`` and should be back in ``predicted_s``
        (``None``: a user's turn, unpredictable)."""
        predicted = self.user_wait_s if predicted_s is None else predicted_s
        self._rank[agent] = -self._clock() + self.trust * predicted
        self._claim(agent, keys)

    def ended(self, agent: AgentKey, keys: Sequence[BlockKey], dead_from: int = 0, heir: AgentKey | None = None,
              inherited: int = 0) -> None:
        """``agent`` will send nothing more: ``keys[dead_from:]`` (its own blocks, no
        other chain branches from them) are never used again. ``keys[:inherited]``
        came from ``heir`` (a sub-agent's parent), which owns them again; the rest
        before ``dead_from`` is shared and ages as LRU would."""
        self._rank[agent] = NEVER
        if heir is not None and inherited and heir in self._serial:
            owner, serial = self._owner, self._serial[heir]
            for key in keys[:inherited]:
                claim = owner.get(key)
                if claim is not None and claim[0] == agent:
                    owner[key] = (heir, serial, claim[2])
            self._refresh(keys[:inherited])
        self._claim(agent, keys[max(dead_from, inherited):])

    def _claim(self, agent: AgentKey, keys: Sequence[BlockKey]) -> None:
        serials = self._serial
        serial = serials.pop(agent, 0) + 1
        serials[agent] = serial  # (re-inserted: the most recently claiming agent last)
        while len(serials) > self.max_agents:
            old = next(iter(serials))
            del serials[old]
            self._rank.pop(old, None)
        claim = (agent, serial, -self._clock())
        self._owner.update(dict.fromkeys(keys, claim))
        self._depth.update(zip(keys, range(len(keys))))
        if len(self._owner) > self._sweep_at:
            self._sweep()
        self._refresh(keys)

    def _sweep(self) -> None:
        """Forget blocks no tier's policy holds."""
        held = [pol.__contains__ for pol in self._policies]
        self._owner = {k: v for k, v in self._owner.items() if any(h(k) for h in held)}
        self._depth = {k: self._depth[k] for k in self._owner if k in self._depth}
        self._sweep_at = max(1 << 16, 2 * len(self._owner))

    def _refresh(self, keys: Sequence[BlockKey]) -> None:
        for pol in self._policies:
            pol.refresh(keys)


REQUEUE_MAX_BLOCKS = 4096
"""Blocks re-queued after one wait start at most (those of the agents due soonest): bounds a scheduler step."""


def requeue_order(ranks: Mapping[AgentKey, float], top: float) -> list[AgentKey]:
    """The next-use order an LRU HBM can be given from its tail (vLLM's free queue; the
    replay's ``+requeue``): after an agent of rank ``top`` starts waiting, the waiting
    agents ranked no higher (``ranks``: by their next-use rank, in the order their waits
    started), soonest due first; a tie goes to the one that started waiting last, as
    LRU has it. The host re-queues their idle HBM blocks at the tail in the reverse of
    this order (the first here ends up the last evicted)."""
    recency = {a: i for i, a in enumerate(ranks)}
    return sorted((a for a, r in ranks.items() if r <= top), key=lambda a: (ranks[a], -recency[a]))
