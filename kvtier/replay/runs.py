"""A request in flight and a session being replayed, as the replay's modules share them.

Owns: :class:`Run` (one request from its arrival to its last token: what it hit, what it
loads, what it holds) and :class:`SessionRun` (a session's agents: who runs, who is next).
Plain records: the simulator (:mod:`.sim`) changes them; admission, prefetches and the fleet
read them. Must not import the simulator or hold logic beyond their own fields.
"""

from __future__ import annotations

from typing import Any

from ..keys import BlockKey
from .model import Agent, Request, Session


class Run:
    """A request in flight."""

    __slots__ = (
        "sess", "agent", "req", "keys", "ready_s", "prefill_left", "ctx_tokens", "decode_left",
        "first_token_s", "held", "store_plan", "computed_keys", "loads_pending", "load_ready_s",
        "hit", "computed_tokens", "uncached", "reserved", "prefetch", "skipped", "take", "holding",
        "step_wait",
    )

    def __init__(self, sess: "SessionRun", agent: Agent, req: Request, ready_s: float) -> None:
        self.sess, self.agent, self.req, self.ready_s = sess, agent, req, ready_s
        self.keys: tuple[BlockKey, ...] = req.block_ids  # trace ids are the replay's block keys
        self.prefill_left = 0
        self.ctx_tokens = 0
        self.decode_left = 0
        self.first_token_s = 0.0
        self.held: BlockKey | None = None  # the chain tail referenced in HBM (protects its prefix)
        self.store_plan: Any = None
        self.computed_keys: tuple[BlockKey, ...] = ()
        self.loads_pending = 0
        self.load_ready_s = 0.0
        self.hit = {"hbm": 0, "dram": 0, "ssd": 0}
        self.computed_tokens = 0
        self.uncached = False
        self.reserved = 0  # HBM blocks reserved for the decode
        self.prefetch: Any = None  # a prefetches.Prefetch for this request that arrived in time
        self.skipped = False  # in SimConfig.skip_requests: never admitted, never recorded
        self.take = 0  # scheduler "vllm": prompt tokens the pass being admitted schedules for it
        # scheduler "vllm": admitted with a load from a lower tier, not running yet (vLLM's
        # WAITING_FOR_REMOTE_KVS): it takes no running slot until the load is done and a slot is free
        self.holding = False
        # scheduler "vllm": its load is reported done at the end of the engine step after its admission, at the
        # earliest (vLLM's worker loads during that step's forward and reports finished loads after it)
        self.step_wait = False


class SessionRun:
    __slots__ = ("idx", "session", "start_s", "next_index", "finished", "running", "agents_left", "children_of",
                 "sid")

    def __init__(self, idx: int, session: Session, start_s: float) -> None:
        self.idx, self.session, self.start_s = idx, session, start_s
        self.next_index = {a.agent_id: 0 for a in session.agents}  # next request to issue
        self.finished = {a.agent_id: not a.requests for a in session.agents}
        self.running: set[str] = set()
        self.agents_left = sum(1 for a in session.agents if a.requests)
        self.children_of: dict[str, list[Agent]] = {}
        self.sid = str(idx)  # the session id the hint plane knows it by
        for a in session.agents[1:]:
            self.children_of.setdefault(a.parent_id or "", []).append(a)
