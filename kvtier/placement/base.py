"""Placement policies: what to keep, offload or drop, and when — one object for live and replay.

Owns: the placement interface (:class:`PlacementContext`, :class:`ToolWait`,
:class:`PlacementPolicy`), the baseline policies and the registry of every
policy by name. Must not import the simulator, an engine or a store: the
replay simulator (``kvtier.replay.sim``) and the live vLLM connector
(``kvtier_vllm.placement``) each implement the context, and drive the same
policy objects.
Each one names the eviction policy of every tier (run unchanged by the
TierManager), whether blocks are written through to the lower tiers as they
are computed (LMCache / vLLM CPU offloading) and what to do when an agent
stops for a tool call. They decide through the narrow :class:`PlacementContext`
(pin, unpin, offload, discard) and never touch the simulator's state, so the
same objects can drive a live store.

Baselines:

* ``lru`` — HBM only, LRU: vLLM automatic prefix caching.
* ``lru-dram`` — LRU in every tier, write-through to DRAM (and SSD when
  enabled), loads on HBM misses: LMCache / vLLM CPU offloading.
* ``arc``, ``s3fifo`` — the same tiers with ARC or S3-FIFO eviction.
* ``ttl`` — Continuum (arXiv 2511.02230): on a tool call, pin the agent's
  KV in HBM for a TTL chosen from the tool-duration distribution seen so far
  (the quantile where keeping stops paying), over ``lru-dram``.
* ``minwaste`` — InferCept (arXiv 2402.01869): on a tool call choose
  preserve / swap / discard, whichever wastes the least memory-time, with
  no write-through (swap is an explicit HBM → DRAM move).
* ``belady-hbm`` — offline optimum of HBM eviction by next use (HBM only, like
  ``lru``), with the future recorded by an ``lru`` pass. With one session at
  a time every policy serves the same order, the recorded future is exact
  and Belady is the bound on HBM hits no online policy beats (tested). With
  several live sessions the order moves with each policy's timing; the
  future is then the recorded timeline shifted by each session's drift, an
  estimate. (Per-tier Belady is not optimal for a hierarchy, so it is not
  offered as a bound on DRAM/SSD reuse: the bound every result shows is
  Belady over all tiers' capacity as one tier, see ``kvtier.replay.run``.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

from ..keys import BlockKey
from ..manager import MovePlan, TierManager


class PlacementContext(Protocol):
    """What a placement policy may see and do (the simulator or a live store implements it).

    Implemented by the replay (:class:`kvtier.replay.sim.Simulator`, on the surface its
    ``--surface`` names) and by the live vLLM connector (``kvtier_vllm.placement.EnginePlacement``,
    the ``vllm`` / ``vllm-write-through`` surfaces); ``tests/engine/test_placement_context_conformance.py``
    runs one suite against both. Counts are blocks, times seconds. An agent key is ``(session,
    agent id)``: the session's index in the replay, its id string live.
    """

    now: float
    """The time in seconds: simulated in the replay, ``time.monotonic()`` live (its origin means nothing)."""

    block_size: int
    """Tokens per block."""

    hbm_capacity_blocks: int
    """HBM blocks of the engine (live: vLLM's GPU blocks less its null block; 0 until the pool is bound)."""

    def pin(self, keys: Sequence[BlockKey], ttl_s: float) -> bool:
        """Keep ``keys``' HBM copies from eviction for ``ttl_s``, within a budget all pins share (half of HBM
        by default); False when refused (nothing cached, ``ttl_s <= 0``, over budget, holds off).
        Replay: the chain up to its deepest HBM block. Live: the longest cached prefix, and only of keys a
        waiting agent's context gave the connector (their vLLM block hashes)."""
        ...

    def unpin(self, keys: Sequence[BlockKey]) -> None:
        """Give back the pins taken with ``keys`` (pins also lapse at their TTL). Replay: at once; live:
        after the next scheduler step (once vLLM allocated the request that came back)."""
        ...

    def offload(self, keys: Sequence[BlockKey], dst: str) -> int:
        """Swap ``keys``' HBM copies out to ``dst``; returns the blocks counted as in ``dst`` (0 for a tier not
        enabled). Replay on ``full``: frees the HBM copies, moving those ``dst`` lacks (they land later).
        Where HBM cannot be freed (vLLM surfaces, live) nothing moves: it counts the copies ``dst`` holds
        already (replay: of the keys in HBM; live: of all ``keys``)."""
        ...

    def discard(self, keys: Sequence[BlockKey]) -> int:
        """Free ``keys``' idle HBM copies at once (recomputed when needed); returns the blocks freed.
        Always 0 live and on the vLLM surfaces: vLLM frees no idle cached block sooner."""
        ...

    def transfer_time_s(self, num_blocks: int, link: str) -> float:
        """Predicted seconds to move ``num_blocks`` over ``link`` (``"hbm->dram"``; ``ssd->hbm`` is both hops):
        a transfer model fitted to completed transfers over a prior; 0.0 for none, non-decreasing in
        ``num_blocks``. Live knows only ``hbm<->dram``, ``dram<->ssd`` and ``ssd->hbm`` (``KeyError`` else)
        and fits only ``ssd->dram`` (its promotions): the others stay at its PCIe 5 / NVMe priors."""
        ...

    def recompute_time_s(self, num_tokens: int) -> float:
        """Predicted seconds to prefill ``num_tokens`` again (0.0 for none), as if no context were cached.
        Replay: its hardware profile's model. Live: where the connector times the engine's steps
        (``recompute_when_cheaper``), the prefill rate fitted from them (seconds = fixed cost + tokens /
        rate); else, and until enough steps were seen, a constant rate (``prefill_tokens_per_s``, 20,000)."""
        ...

    def queued_transfer_s(self, link: str) -> float:
        """Seconds until the copies queued on ``link`` now are done (``ssd->hbm``: its busier hop's): what
        a copy issued now waits behind. Replay: its modelled links' FIFO queues. Live: 0.0 (the
        connector's lanes report completions, not their queues; modelled only)."""
        ...

    def prefill_ahead_s(self) -> float:
        """Seconds of prefill that requests admitted before one admitted now have still to run (their
        chunks take each step's token budget first: a request admitted now waits behind them whether
        it loads or recomputes). Replay: the admitted requests' prefill left, each against its own
        context. Live: 0.0 (the connector sees steps one at a time, not the prefill queued behind
        them; modelled only)."""
        ...

    def load_wait_s(self) -> float:
        """Seconds a load delays its request besides the transfer. Live: one engine step like the one running
        (its fixed cost alone while the engine idles), fitted from its steps (vLLM runs a request whose KV
        loads asynchronously a step later; 0.0 until fitted). Replay: a step like the one running under
        ``--scheduler vllm`` (its loads are done at a step's end), 0.0 under ``plain``."""
        ...

    def running_blocks(self) -> int:
        """HBM blocks in use by running requests. Replay: their blocks and decode reserves, pins apart.
        Live: vLLM's KV usage, every referenced block, those held by pins included."""
        ...

    def tool_history_s(self) -> Sequence[float]:
        """Durations of the latest tool waits (at most 512), oldest first. Replay: each tool's true duration;
        live: from a tool wait's start to its agent's next request (user waits left out)."""
        ...

    def private_start(self, keys: Sequence[BlockKey]) -> int:
        """Index where ``keys``' private suffix begins: blocks before it are a prefix
        other chains branch from. Live the index is kvtier's DRAM / SSD tiers' only (a
        branch vLLM's HBM alone holds is not seen); the replay's has HBM too."""
        ...

    # The agent-aware part (hint plane, prefetch, timers).

    def blocks_in(self, keys: Sequence[BlockKey], tier: str) -> int:
        """How many of ``keys`` are readable in ``tier`` (0 for a tier not enabled). HBM live: the length of
        the cached prefix of the keys a waiting agent's context gave (a gap ends the count; a hybrid model's
        other KV cache groups' blocks are added, so it may exceed ``len(keys)``); the replay counts every key."""
        ...

    def touch(self, keys: Sequence[BlockKey]) -> None:
        """Make ``keys``' idle HBM copies the most recently used (they are due next). Replay: where the
        surface refreshes HBM (``hbm_refresh``); live: the cached prefix a waiting agent's context gave,
        re-queued at the tail of vLLM's free queue (``touch`` + ``free_blocks``)."""
        ...

    def call_at(self, t: float, fn: Callable[..., None], *args: object) -> None:
        """Call ``fn(*args)`` once at time ``t`` (on :attr:`now`'s clock); a time gone by runs at the next
        pass. Replay: an event at ``t`` in simulated time. Live: on the first scheduler step at or after
        ``t`` (none run while vLLM takes no steps)."""
        ...

    def prefetch(self, agent_key: tuple[int, str], keys: Sequence[BlockKey]) -> float | None:
        """Promote ``keys``' lower-tier blocks ahead of the agent's return; returns when they should be there
        (:attr:`now`'s clock), ``None`` when nothing moves or one is in flight for the agent. Replay: only
        for a waiting agent, into the surface's ``prefetch_to`` (HBM on ``full``, held until the request is
        admitted). Live: SSD -> DRAM only (nothing loads into HBM without a request)."""
        ...

    def stage(self, keys: Sequence[BlockKey]) -> int:
        """The request arriving now (called from ``on_wait_end``) has the context
        ``keys``: if the engine's scheduling pass leaves it queued, promote the
        SSD blocks of its cached prefix into DRAM while others compute, so its
        load reads DRAM when it is admitted. Returns the blocks promoted at once
        (0 where that waits for the pass, as in both implementations)."""
        ...

    def drop(self, keys: Sequence[BlockKey]) -> int:
        """Remove ``keys`` (dead KV: nobody reads it again) wherever the host may; returns the copies removed,
        over all tiers. Replay on ``full``: every tier. Live and on the vLLM surfaces: DRAM / SSD only (the
        HBM copies stay until vLLM evicts them)."""
        ...

    def deprioritize(self, keys: Sequence[BlockKey], tiers: Sequence[str] = ("hbm",)) -> int:
        """Make ``keys``' idle copies in ``tiers`` the next victims there (tail first); returns the copies
        offered. HBM only where the surface reorders it (the replay's ``full``): live it is skipped."""
        ...

    def retire(self, keys: Sequence[BlockKey]) -> int:
        """Dead KV (its agent ended): the next victims in every enabled tier, readable until the room is
        needed; returns the copies offered. Live HBM is left alone; the replay, on a surface that can free
        but not reorder HBM, frees the idle HBM copies (counted too)."""
        ...

    def count(self, name: str, n: int = 1) -> None:
        """Add ``n`` to the host's counter ``name`` (decisions by reason, ...): replay results, connector stats."""
        ...

    def criticality(self, agent_key: tuple[int, str]) -> float:
        """In [0, 1], 1.0 on the session's longest expected remaining path (the hint plane's DAG). An agent
        the DAG does not know: 0.0 in the replay, 1.0 live (its own critical path). Live a request's
        ``kvtier_criticality`` comes first, then the hint server's DAG as last polled."""
        ...

    def hbm_pressure(self) -> float:
        """HBM in use plus what the first 16 queued requests need, over :attr:`hbm_capacity_blocks`: 0.0 idle,
        above 1.0 when the queue wants more (not clamped). In use: on the replay's ``full`` every used block,
        idle cached ones included; on the vLLM surfaces and live, blocks referenced by requests and pins
        (live less the finishing request's, which vLLM frees next)."""
        ...

    def waiting_demand_blocks(self) -> int:
        """HBM blocks the first 16 requests waiting for admission need. Replay: prompt and output tokens;
        live: the prompt's, of requests that arrived and vLLM has not scheduled yet."""
        ...

    def tiers_enabled(self) -> tuple[str, ...]:
        """The enabled tiers, fastest first: ``"hbm"``, then ``"dram"`` / ``"ssd"`` where present. Replay:
        those the policy uses (``lower_tiers``) with a capacity; live: those the connector configures."""
        ...

    def is_waiting(self, agent_key: tuple[int, str]) -> bool:
        """True while the agent waits (tool, user, sub-agents) for its next request; False for an unknown
        agent. Live: from the wait the scheduler started to its next request's arrival (``tool=True``
        there: tool waits only); an agent that never returns stays waiting until forgotten."""
        ...

    def parent_of(self, agent_key: tuple[int, str]) -> str | None:
        """The agent's parent id on the hint plane's DAG; ``None`` for a root or an agent it does not know
        (live without a hint server: always)."""
        ...

    def remaining_path_s(self, session: int) -> float:
        """The session's expected remaining time (its critical path on the hint plane's DAG); 0.0 for an
        unknown or finished session. Replay only: live always 0.0. No policy reads it."""
        ...


def ssd_promotion(mgr: TierManager, keys: Sequence[BlockKey]) -> MovePlan | None:
    """The move of the SSD-only blocks of ``keys``' cached prefix into DRAM, SSD
    copy kept (``None``: none, or no SSD and DRAM tiers). How both
    :class:`PlacementContext` implementations carry out ``stage`` (and the
    live one its prefetch)."""
    if "ssd" not in mgr.tier_names or "dram" not in mgr.tier_names:
        return None
    hit = mgr.lookup(keys)
    ssd = hit.tier_names.index("ssd")
    on_ssd = [k for k, t in zip(keys, hit.tier_indices) if t == ssd]
    return mgr.prepare_move(on_ssd, "ssd", "dram", keep_source=True) if on_ssd else None


UNPREDICTED_GAP_S = 10.0
"""The wait a policy is told to expect when nobody predicted one (a user's turn, a tool
before any history): the replay's and the live connector's alike."""

TURN_END_GAP_S = 116.0
"""The wait a policy is told to expect after a turn that announced no tool call, where
nothing has said whether the agent is done (live: every such turn's end, with hints in
``kv_transfer_params`` only, from the request-stream middleware, which reports no ends,
and with the SDK's hint server until its agent end or tool call, reported after the
response, ends or re-times the wait). The median, over the dev traces' tuning half, of
what follows an ``end_turn``: a user's turn (385, its true gap) or the agent's end (77,
never); ``tests/test_replay_readers.py`` recomputes it. The replay knows which of the
two it is (a user's turn, :data:`UNPREDICTED_GAP_S` with ``user_wait_s`` in the
next-use order, or ``on_agent_end``), as a client that reports agent ends makes it
known live, unless told the ends are unknown (``--agent-ends unknown``: then it starts
these waits as the connector does). A user's turn expected at 60 s left agents done
with their last turn outliving agents on tool waits of 40-60 s, and hints then did harm.
Replayed that way (``--surface vllm --agent-ends unknown``, tuning half, DRAM 2x HBM),
116 s computed the least prefill of four values: for 116 / 60 / 300 / 900 s, 19.47 /
19.54 / 19.48 / 19.49M at conc 8 with ``--hbm-fraction 0.25``, and 23.72 / 23.77 /
23.89 / 23.88M at conc 16 on that HBM."""


@dataclass(frozen=True, slots=True)
class ToolWait:
    """An agent just finished a request and will wait ``gap_s`` (known to the
    policy only as a prediction) before its next one."""

    agent_key: tuple[int, str]
    keys: tuple[BlockKey, ...]  # the agent's context blocks (prompt + output) in HBM order
    cause: str  # "tool" | "user" | "subagent_join" | "turn_end" (a user's turn or the end: unknown, live)
    predicted_gap_s: float


class PlacementPolicy:
    """Base: no tool-wait action; subclasses override the hooks they need."""

    name = "base"
    eviction = "lru"
    write_through = True
    lower_tiers: tuple[str, ...] = ("dram", "ssd")  # tiers below HBM it uses, where enabled
    needs_oracle = False
    replay_only = ""  # why the live connector cannot run it (a peer's model), or "" where it can
    # Exclusive DRAM: "evict" writes a block to DRAM when HBM evicts it (a victim
    # cache), not as it is computed; DRAM copies of what HBM holds are the first to
    # go, so the two tiers add up. Where the engine lets no connector copy a block
    # out on eviction (Surface.hbm_victim_write), write-through as before.
    write_back_dram: str | None = None

    def eviction_for(self, tier: str, clock: Callable[[], float] | None = None) -> object:
        """The eviction policy of ``tier``: a registered name, or (given the host's
        ``clock``) a policy object built over the placement's own estimate."""
        return self.eviction

    def next_use_rank(self, key: BlockKey) -> float | None:
        """Where ``key`` stands in the policy's order by predicted next use (higher: evicted
        sooner), for a host that orders its own HBM (the live connector's free queue);
        ``None`` for a policy without that order."""
        return None

    def on_wait_start(self, ctx: PlacementContext, wait: ToolWait) -> None:
        """An agent starts waiting (tool call, user, sub-agents)."""

    def on_wait_end(self, ctx: PlacementContext, agent_key: tuple[int, str], keys: Sequence[BlockKey]) -> None:
        """The agent's next request is ready (its wait ended)."""

    def on_agent_end(self, ctx: PlacementContext, agent_key: tuple[int, str], keys: Sequence[BlockKey]) -> None:
        """The agent finished its last request (``keys``: its final context)."""

    def on_session_end(self, ctx: PlacementContext, session: int) -> None:
        """Every agent of the session finished."""

    def admit_lower(self, ctx: PlacementContext, tier: str, agent_key: tuple[int, str] | None,
                    num_blocks: int) -> int:
        """How many of ``num_blocks`` freshly computed blocks of ``agent_key`` (a prefix of them,
        in chain order) to write through to ``tier``: all of them by default, 0 for none."""
        return num_blocks

    def should_load(self, ctx: PlacementContext, num_blocks_by_tier: dict[str, int], context_tokens: int) -> bool:
        """Load blocks found in lower tiers (True) or recompute them (False)? Default: load when the
        bytes are in HBM before the engine would have recomputed them. A load takes ``load_wait_s``,
        the copies queued ahead on its links and its own transfers; recomputing takes the prefill
        queued for requests admitted before (``prefill_ahead_s``, which a loading request waits behind
        anyway) and these tokens. So behind a queue of prefill a load hides, and on a busy
        link recomputing wins."""
        tiers = [t for t, n in num_blocks_by_tier.items() if n]
        load_s = (ctx.load_wait_s() + max((ctx.queued_transfer_s(f"{t}->hbm") for t in tiers), default=0.0)
                  + sum(ctx.transfer_time_s(num_blocks_by_tier[t], f"{t}->hbm") for t in tiers))
        num_tokens = sum(num_blocks_by_tier.values()) * ctx.block_size
        return load_s < ctx.recompute_time_s(num_tokens) + ctx.prefill_ahead_s()


class LRU(PlacementPolicy):
    name = "lru"
    write_through = False
    lower_tiers = ()


class LRUDram(PlacementPolicy):
    name = "lru-dram"


class ARC(PlacementPolicy):
    name = "arc"
    eviction = "arc"


class S3FIFO(PlacementPolicy):
    name = "s3fifo"
    eviction = "s3fifo"


class TTL(PlacementPolicy):
    """Continuum-style TTL pinning across tool calls.

    TTL = the smallest observed tool duration ``d`` such that a fraction
    ``quantile`` of tools return within ``d``, capped at ``max_ttl_s``; before
    enough history, ``prior_ttl_s``. Pins share a budget (the manager's).
    """

    name = "ttl"

    def __init__(self, quantile: float = 0.7, prior_ttl_s: float = 10.0, max_ttl_s: float = 120.0,
                 min_history: int = 8) -> None:
        self.quantile, self.prior_ttl_s, self.max_ttl_s, self.min_history = quantile, prior_ttl_s, max_ttl_s, min_history

    def ttl_s(self, history: Sequence[float]) -> float:
        if len(history) < self.min_history:
            return self.prior_ttl_s
        ordered = sorted(history)
        return min(self.max_ttl_s, ordered[int(self.quantile * (len(ordered) - 1))])

    def on_wait_start(self, ctx: PlacementContext, wait: ToolWait) -> None:
        if wait.cause == "tool":
            ctx.pin(wait.keys, self.ttl_s(ctx.tool_history_s()))

    def on_wait_end(self, ctx: PlacementContext, agent_key: tuple[int, str], keys: Sequence[BlockKey]) -> None:
        ctx.unpin(keys)


class MinWaste(PlacementPolicy):
    """InferCept-style preserve / swap / discard by least wasted memory-time.

    Only the agent's private blocks are considered: a prefix other agents
    branch from is never moved or dropped. With ``C`` those blocks, ``T`` the
    predicted wait, ``M`` the blocks of running requests: preserve wastes
    ``C*T``; discard wastes the memory of the whole batch while ``C`` is
    recomputed, ``(C+M)*t_recompute``; swap wastes ``C*(t_out+t_in)``.
    Swap volume per pause is bounded by what the host link moves in
    ``swap_window_s`` (about one engine iteration; InferCept likewise limits
    swapping to what it can hide under compute): the chain's tail is swapped
    and the rest is preserved.
    """

    name = "minwaste"
    write_through = False
    lower_tiers = ("dram",)  # swap space

    def __init__(self, swap_window_s: float = 0.1) -> None:
        self.swap_window_s = swap_window_s

    def on_wait_start(self, ctx: PlacementContext, wait: ToolWait) -> None:
        if wait.cause != "tool" or not wait.keys:
            return
        keys = wait.keys[ctx.private_start(wait.keys):]
        if not keys:
            return
        t = wait.predicted_gap_s
        choice = self._least_waste(ctx, len(keys), t)
        if choice == "swap":
            per_block = ctx.transfer_time_s(1, "hbm->dram")
            n = min(len(keys), max(1, int(self.swap_window_s / per_block))) if per_block > 0 else len(keys)
            ctx.offload(keys[len(keys) - n :], "dram")
            keys = keys[: len(keys) - n]
            choice = "preserve" if keys else ""  # what the link cannot move now stays
        if choice == "preserve":
            ctx.pin(keys, t)
        elif choice == "discard":
            ctx.discard(keys)

    def _least_waste(self, ctx: PlacementContext, c: int, t: float) -> str:
        waste = {
            "preserve": c * t,
            "discard": (c + ctx.running_blocks()) * ctx.recompute_time_s(c * ctx.block_size),
            "swap": c * (ctx.transfer_time_s(c, "hbm->dram") + ctx.transfer_time_s(c, "dram->hbm")),
        }
        return min(waste, key=waste.__getitem__)

    def on_wait_end(self, ctx: PlacementContext, agent_key: tuple[int, str], keys: Sequence[BlockKey]) -> None:
        ctx.unpin(keys)


class Belady(PlacementPolicy):
    name = "belady-hbm"
    eviction = "belady"
    write_through = False
    lower_tiers = ()
    needs_oracle = True

