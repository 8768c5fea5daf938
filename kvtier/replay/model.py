"""The in-memory workload model every trace reader produces and replay consumes.

Owns: the shape of a workload (sessions → agent trees → requests), the
dependency rules a discrete-event simulator follows, and re-blocking a
workload to another block size. Pure values: no I/O, no clock, no engine.

Dependency rules (what a simulator does with a :class:`Session`):

* A closed-loop session starts at :attr:`Session.start_s` (``0.0`` unless the
  replay staggers sessions itself) with request 0 of its root agent.
* Request ``i > 0`` of an agent is ready when request ``i - 1`` of the same
  agent has finished *and* every sub-agent named in its
  :attr:`Request.depends_on` has finished its last request; it is then sent
  :attr:`Request.gap_s` seconds later (tool execution or human think time).
* A sub-agent with ``spawn_after = k`` starts when request ``k`` of its parent
  has finished; its request 0 is sent ``gap_s`` after that. ``spawn_after``
  ``None`` on a sub-agent means it starts with the session.
* A sub-agent with ``join_before = j`` is waited for by request ``j`` of its
  parent (that request lists it in ``depends_on``); ``None`` means nobody
  waits for it (a background / async agent).
* Open-loop workloads (``Workload.open_loop``) ignore all of this: each request
  is sent at its :attr:`Request.arrival_s`.

Block ids: ``Request.block_ids`` are the ids of the *full* input blocks of the
request at ``Workload.block_size`` tokens per block, in prompt order, so
``len(block_ids) <= input_tokens // block_size``. The tokens of a trailing
partial block have no id (engines cache only full blocks); a trace that lists
an id for it (Mooncake does) has that id kept apart, in
:attr:`Request.partial_block`, which nothing caches: only analysis that
mirrors another tool's definition of a hit rate reads it. Ids are plain
``int`` values unique across the whole workload: two requests hold the same
KV block exactly when they list the same id at the same position. A shared
leading run of ids is a reusable prefix.

>>> r0 = Request(0, 130, 5, (1, 2), 0.0, "start", "tool_use", 0.0)
>>> r1 = Request(1, 200, 5, (1, 2, 3), 2.0, "tool", "end_turn", 9.0)
>>> w = Workload("w", 64, (Session("s", (Agent("root", None, "main", (r0, r1)),)),), False)
>>> w.num_requests(), w.total_input_tokens(), w.num_distinct_blocks()
(2, 330, 3)
>>> r0_128, r1_128 = reblock(w, 128).sessions[0].root.requests
>>> r0_128.block_ids == r1_128.block_ids  # the odd third block is not a full 128-token block
True
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, replace
from hashlib import shake_128
from typing import Any, Iterator, Literal, NewType, Sequence

BlockId = NewType("BlockId", int)
"""A trace block id, unique across one :class:`Workload` (plain ``int``)."""

GapCause = Literal["start", "tool", "user", "subagent_join"]
"""Why a request waits ``gap_s`` after its dependency finished.

``start``: first request of an agent (or an open-loop request);
``tool``: the previous request stopped with ``tool_use`` (tool execution);
``user``: the previous request ended the turn (human think time);
``subagent_join``: the request waits for sub-agents (gap counted from the
last of them finishing)."""

GAP_CAUSES: tuple[str, ...] = ("start", "tool", "user", "subagent_join")
ROOT_AGENT_ID = "root"

_ID_MASK = (1 << 63) - 1


@dataclass(frozen=True, slots=True)
class Request:
    """One LLM call of one agent.

    ``index`` is the position in its agent's ``requests``. ``arrival_s`` is
    the time the trace sent it, from the start of its session (closed loop:
    informational, the replay paces by ``gap_s``; open loop: the send time).
    ``api_time_s`` is how long the recording server took, when known.
    ``partial_block``: the id a trace listed for the trailing partial block
    (Mooncake lists one), at the trace's own block size; ``None`` when none
    was listed or the workload was re-blocked. Never cached or simulated.
    ``answer_block_ids``: the full blocks the answer filled after the
    prompt's, as the recording engine cached them (kvtier's recorder writes
    them); ``None`` when not recorded, and the replay then takes the next
    request's blocks up to the answer's end as the answer's.
    """

    index: int
    input_tokens: int
    output_tokens: int
    block_ids: tuple[BlockId, ...]
    gap_s: float
    gap_cause: GapCause
    stop: str
    arrival_s: float
    depends_on: tuple[str, ...] = ()
    model: str = ""
    kind: str = "n"
    api_time_s: float | None = None
    partial_block: BlockId | None = None
    answer_block_ids: tuple[BlockId, ...] | None = None


@dataclass(frozen=True, slots=True)
class Agent:
    """A root agent or a sub-agent and its requests, in send order.

    ``spawn_after``: index of the parent request after whose completion this
    agent starts (``None``: the root, or a sub-agent started with the
    session). ``join_before``: index of the parent request that waits for it
    (``None``: the root, or a background agent nobody waits for).
    """

    agent_id: str
    parent_id: str | None
    agent_type: str
    requests: tuple[Request, ...]
    spawn_after: int | None = None
    join_before: int | None = None
    status: str = ""

    @property
    def is_root(self) -> bool:
        return self.parent_id is None


@dataclass(frozen=True, slots=True)
class Session:
    """One agent tree: ``agents[0]`` is the root, sub-agents follow in trace order."""

    session_id: str
    agents: tuple[Agent, ...]
    start_s: float = 0.0
    source: str = ""
    recorded_at_s: float | None = None  # unix time the trace began, when recorded (kvtier.recording)

    @property
    def root(self) -> Agent:
        return self.agents[0]

    def agent(self, agent_id: str) -> Agent:
        """The agent named ``agent_id``; ``KeyError`` naming the valid ids otherwise. O(agents)."""
        for a in self.agents:
            if a.agent_id == agent_id:
                return a
        valid = [a.agent_id for a in self.agents]
        raise KeyError(f"no agent {agent_id!r} in session {self.session_id!r}; agents: {valid}")

    def children(self, agent_id: str) -> tuple[Agent, ...]:
        """Direct sub-agents of ``agent_id``, in trace order."""
        return tuple(a for a in self.agents if a.parent_id == agent_id)

    def num_requests(self) -> int:
        return sum(len(a.requests) for a in self.agents)

    def has_subagents(self) -> bool:
        return len(self.agents) > 1

    def num_distinct_blocks(self) -> int:
        """Distinct block ids this session reads (its footprint). O(block ids)."""
        return len({b for a in self.agents for r in a.requests for b in r.block_ids})


@dataclass(frozen=True, slots=True)
class Workload:
    """Everything a replay needs: sessions at one block size.

    ``open_loop``: requests are sent at ``arrival_s`` (Mooncake); otherwise
    closed loop, paced by dependencies and ``gap_s`` (AgentX / Weka).
    ``declared_dag``: the application declares its agent graph up front
    (TokenCake's front-end API), so the hint plane knows how many requests
    each agent will make; recorded traces do not.
    """

    name: str
    block_size: int
    sessions: tuple[Session, ...]
    open_loop: bool
    declared_dag: bool = False

    def iter_requests(self) -> Iterator[tuple[Session, Agent, Request]]:
        """Every request with its session and agent, in workload order."""
        for s in self.sessions:
            for a in s.agents:
                for r in a.requests:
                    yield s, a, r

    def num_requests(self) -> int:
        return sum(s.num_requests() for s in self.sessions)

    def total_input_tokens(self) -> int:
        return sum(r.input_tokens for _, _, r in self.iter_requests())

    def total_output_tokens(self) -> int:
        return sum(r.output_tokens for _, _, r in self.iter_requests())

    def distinct_blocks(self) -> frozenset[BlockId]:
        """The working set: every block id any request reads. O(total block ids)."""
        out: set[BlockId] = set()
        for _, _, r in self.iter_requests():
            out.update(r.block_ids)
        return frozenset(out)

    def num_distinct_blocks(self) -> int:
        return len(self.distinct_blocks())

    def window_share(self, window_tokens: int) -> float:
        """The share of the distinct blocks that lie within ``window_tokens``
        tokens before a reuse point: what a sliding-window layer must keep of
        this workload's KV for every reuse to hit (1.0 when there are no blocks).

        A reuse point is a request's last full block (the next turn resumes
        there) or a block two requests continue differently (a shared prefix
        ends there); the ``ceil(window_tokens / block_size)`` blocks ending at
        one are within its window. O(total block ids).

        >>> r = lambda i, ids: Request(i, 64 * len(ids), 1, ids, 0.0, "start", "end_turn", 0.0)
        >>> a = Agent("root", None, "main", (r(0, (1, 2, 3, 4, 5, 6)), r(1, (1, 2, 3, 4, 5, 6, 7, 8))))
        >>> b = Agent("root", None, "main", (r(0, (1, 2, 9)),))
        >>> w = Workload("w", 64, (Session("a", (a,)), Session("b", (b,))), False)
        >>> w.window_share(128)  # 2-block windows end at 2 (a branch), 6, 8 and 9: blocks 1, 2, 5-9
        0.7777777777777778
        """
        if window_tokens <= 0:
            raise ValueError(f"window_tokens must be > 0, got {window_tokens}")
        window_blocks = -(-window_tokens // self.block_size)
        next_of: dict[BlockId, BlockId] = {}
        branches: set[BlockId] = set()
        for _, _, r in self.iter_requests():
            ids = r.block_ids
            for block, nxt in zip(ids, ids[1:]):
                if next_of.setdefault(block, nxt) != nxt:
                    branches.add(block)
        distinct: set[BlockId] = set()
        kept: set[BlockId] = set()
        for _, _, r in self.iter_requests():
            ids = r.block_ids
            distinct.update(ids)
            left = window_blocks  # the last block is a reuse point
            for block in reversed(ids):
                if block in branches:
                    left = window_blocks
                if left > 0:
                    kept.add(block)
                    left -= 1
        return len(kept) / len(distinct) if distinct else 1.0

    def reblock(self, new_block_size: int) -> Workload:
        """Same as :func:`reblock` (``reblock(self, new_block_size)``)."""
        return reblock(self, new_block_size)

    def check_invariants(self) -> None:
        """Assert the dependency and block-id rules of the module docstring."""
        assert self.block_size > 0, self.block_size
        seen_sessions: set[str] = set()
        for s in self.sessions:
            assert s.session_id not in seen_sessions, s.session_id
            seen_sessions.add(s.session_id)
            _check_session(s, self.block_size)


def _check_session(s: Session, block_size: int) -> None:
    assert s.agents and s.agents[0].is_root, s.session_id
    by_id = {a.agent_id: a for a in s.agents}
    assert len(by_id) == len(s.agents), f"duplicate agent ids in {s.session_id}"
    joined_by: dict[str, int] = {}
    for a in s.agents:
        for i, r in enumerate(a.requests):
            assert r.index == i, (s.session_id, a.agent_id, i)
            assert r.input_tokens >= 0 and r.output_tokens >= 0, r
            assert len(r.block_ids) <= r.input_tokens // block_size, (s.session_id, a.agent_id, i)
            assert r.gap_s >= 0 and r.gap_cause in GAP_CAUSES, r
            for dep in r.depends_on:
                assert by_id[dep].parent_id == a.agent_id, (dep, a.agent_id)
                joined_by[dep] = i
        if a.is_root:
            assert a is s.agents[0] and a.spawn_after is None and a.join_before is None
            continue
        parent = by_id[a.parent_id]
        n = len(parent.requests)
        assert a.spawn_after is None or 0 <= a.spawn_after < n, a
        assert a.join_before is None or 0 <= a.join_before < n, a
        if a.join_before is not None and a.spawn_after is not None:
            assert a.join_before > a.spawn_after, a
    for a in s.agents:
        assert joined_by.get(a.agent_id) == a.join_before, (s.session_id, a.agent_id)


# ---------------------------------------------------------------------------
# Re-blocking


def reblock(workload: Workload, new_block_size: int) -> Workload:
    """``workload`` with block ids at ``new_block_size`` tokens per block.

    * Merging (``new`` a multiple ``m`` of the old size) is exact: each group
      of ``m`` consecutive full blocks becomes one block whose id is derived
      from the ``m`` constituent ids, so requests that shared ``j * m``
      leading old blocks share exactly ``j`` leading new blocks. A trailing
      group of fewer than ``m`` ids is dropped (only full blocks have ids).
    * Splitting (the old size a multiple ``m`` of ``new``) gives each old
      block ``m`` children derived from ``(old id, part)``. Tokens that were a
      partial old block stay without ids (the source never named them), so
      ``len(block_ids)`` may be below ``input_tokens // new_block_size``.

    New ids are 63-bit and depend only on the ids they derive from, never on
    order, process or the rest of the workload (a splitmix64 chain for ids in
    ``[0, 2**63)``, SHAKE-128 for any other int). Any other size raises
    ``ValueError`` naming both sizes. O(total ids): each request reuses the
    mapped prefix it shares with its agent's previous request, and ids are
    derived in one vectorised batch.
    """
    old = workload.block_size
    if not isinstance(new_block_size, int) or isinstance(new_block_size, bool) or new_block_size <= 0:
        raise ValueError(f"new_block_size={new_block_size!r}: must be a positive int (workload block_size={old})")
    if new_block_size == old:
        return workload
    if new_block_size % old == 0:
        mapper: _Reblocker = _Merger(new_block_size // old)
    elif old % new_block_size == 0:
        mapper = _Splitter(old // new_block_size)
    else:
        raise ValueError(
            f"cannot re-block from block_size={old} to new_block_size={new_block_size}: "
            f"neither is a multiple of the other"
        )
    agents = [a for s in workload.sessions for a in s.agents]
    mapper.prepare(agents)
    mapped = iter([mapper.map_agent(a) for a in agents])
    sessions = tuple(replace(s, agents=tuple(next(mapped) for _ in s.agents)) for s in workload.sessions)
    return replace(workload, block_size=new_block_size, sessions=sessions)


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of ``a`` and ``b``.

    O(n) in C for the usual append-only case, O(n log n) slice compares otherwise.
    """
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _new_suffixes(agent: Agent) -> Iterator[tuple[int, tuple[int, ...]]]:
    """``(kept, ids)`` per request: ids[:kept] is shared with the previous request."""
    prev: tuple[int, ...] = ()
    for r in agent.requests:
        yield common_prefix_len(prev, r.block_ids), r.block_ids
        prev = r.block_ids


_SPLIT_TAG = 0x6B76_7469_6572_5350  # "kvtierSP"
_MERGE_TAG = 0x6B76_7469_6572_4D47  # "kvtierMG"


def _mix64_np(x: Any) -> Any:
    """splitmix64 finaliser (:func:`kvtier.keys.mix64`) on a numpy uint64 array
    (wrapping arithmetic)."""
    import numpy as np

    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _in_range(i: int) -> bool:
    return 0 <= i <= _ID_MASK


def _shake_ids(tag: int, source: object, count: int) -> tuple[BlockId, ...]:
    digest = shake_128(f"{tag:x}|{source!r}".encode()).digest(8 * count)
    return tuple(BlockId(v & _ID_MASK) for v in struct.unpack(f">{count}Q", digest))


class _Reblocker:
    """Maps each request's ids, reusing the mapped prefix shared with the previous request."""

    def prepare(self, agents: Sequence[Agent]) -> None:
        """Derive, in one batch, the ids of every group the workload will ask for."""
        raise NotImplementedError

    def map_ids(self, src: tuple[int, ...], kept: int, prev_dst: tuple[BlockId, ...]) -> tuple[BlockId, ...]:
        raise NotImplementedError

    def map_agent(self, agent: Agent) -> Agent:
        out: list[Request] = []
        prev_dst: tuple[BlockId, ...] = ()
        for r, (kept, src) in zip(agent.requests, _new_suffixes(agent)):
            prev_dst = self.map_ids(src, kept, prev_dst)
            out.append(replace(r, block_ids=prev_dst, partial_block=None, answer_block_ids=None))
        return replace(agent, requests=tuple(out))


class _Merger(_Reblocker):
    def __init__(self, factor: int) -> None:
        self.factor = factor
        self.group_to_id: dict[tuple[int, ...], BlockId] = {}

    def prepare(self, agents: Sequence[Agent]) -> None:
        m = self.factor
        groups: set[tuple[int, ...]] = set()
        for a in agents:
            for kept, src in _new_suffixes(a):
                groups.update(src[j * m : (j + 1) * m] for j in range(kept // m, len(src) // m))
        fast = [g for g in groups if all(map(_in_range, g))]
        for g in groups.difference(fast):
            self.group_to_id[g] = _shake_ids(_MERGE_TAG, g, 1)[0]
        if fast:
            import numpy as np

            cols = np.array(fast, dtype=np.uint64).reshape(len(fast), m)
            h = _mix64_np(cols[:, 0] ^ np.uint64(_MERGE_TAG))
            for j in range(1, m):
                h = _mix64_np(h ^ cols[:, j])
            self.group_to_id.update(zip(fast, (h & np.uint64(_ID_MASK)).tolist()))

    def map_ids(self, src: tuple[int, ...], kept: int, prev_dst: tuple[BlockId, ...]) -> tuple[BlockId, ...]:
        m, ids = self.factor, self.group_to_id
        keep = kept // m
        return prev_dst[:keep] + tuple(ids[src[j * m : (j + 1) * m]] for j in range(keep, len(src) // m))


class _Splitter(_Reblocker):
    def __init__(self, factor: int) -> None:
        self.factor = factor
        self.children: dict[int, tuple[BlockId, ...]] = {}

    def prepare(self, agents: Sequence[Agent]) -> None:
        ids: set[int] = set()
        for a in agents:
            for kept, src in _new_suffixes(a):
                ids.update(src[kept:])
        fast = [i for i in ids if _in_range(i)]
        for i in ids.difference(fast):
            self.children[i] = _shake_ids(_SPLIT_TAG, i, self.factor)
        if fast:
            import numpy as np

            base = _mix64_np(np.array(fast, dtype=np.uint64) ^ np.uint64(_SPLIT_TAG))
            parts = np.arange(1, self.factor + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
            kids = _mix64_np(base[:, None] ^ parts[None, :]) & np.uint64(_ID_MASK)
            self.children.update(zip(fast, map(tuple, kids.tolist())))

    def map_ids(self, src: tuple[int, ...], kept: int, prev_dst: tuple[BlockId, ...]) -> tuple[BlockId, ...]:
        children = self.children
        new: list[BlockId] = []
        for block_id in src[kept:]:
            new.extend(children[block_id])
        return prev_dst[: kept * self.factor] + tuple(new)
