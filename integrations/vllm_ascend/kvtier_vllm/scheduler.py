"""Scheduler side of the kvtier connector: which blocks kvtier holds, and the
load and store plans of each step.

Owns: a :class:`~kvtier.manager.TierManager` over the DRAM and SSD tiers
(metadata only; the bytes live in the workers), the mapping from vLLM block
hashes to kvtier keys, per-request bookkeeping (keys, blocks already planned
for storing, store jobs whose engine blocks are still being read), the
session / agent ids and hints a request carries in ``kv_transfer_params``,
the placement policy (a :mod:`kvtier.placement` object, the one the replay
runs) with its live context (:class:`~.placement.EnginePlacement`: HBM holds
through vLLM's block pool, SSD -> DRAM prefetch), and the counters behind
:meth:`KVTierScheduler.stats`. With a remote tier (a Mooncake Store shared by
engines): which of a request's blocks past the local hits the store holds,
asked on a lookup thread, and the remote writes of every new block. With
``approximate_shifted_segments``: the index of segment masters (a declared
shared segment's block -> the copy a request computed and its position) and
the keys of approximate requests, derived in a namespace of their own. With
a hint server: the shared rounds announced there, each a reference count of
the agents still to be served, whose shared prefix stays held in HBM and
pinned in the tiers until it reaches zero.

Must not touch tensors or do I/O on the scheduler's hot path: lookups read
the in-memory index only, so a slow SSD never stalls a scheduling step (the
SSD directory is scanned once, at start, to re-index a warm restart). The
remote store is asked off the step, on a thread: a step waits at most
``remote_lookup_wait_ms`` for the answer, then tells vLLM to ask again
later (the request waits; nothing else does). Must not trust a block until
every worker reported its store ok.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import tempfile
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field, replace
from typing import Any

from kvtier.errors import ConfigError
from kvtier.events import BlockRemoved, BlockStored, StoreFailed
from kvtier.keys import BlockKey, Namespace, chain_foreign_keys
from kvtier.manager import LoadPlan, StorePlan, TierManager, TierSpec
from kvtier.placement import ToolWait, make_placement
from kvtier.placement.base import TURN_END_GAP_S
from kvtier.placement.surface import surface
from kvtier.sdk.handles import (
    is_approximate_salt,
    request_approximate_segments,
    request_criticality,
    request_round,
    request_tags,
    request_tool_wait_s,
)
from kvtier.store import reindex_ssd
from kvtier.tiers.codec import LOSSY_CODECS
from kvtier.tiers.lossy import LossyCopies

from . import remoteshare, ssdshare
from .approximate import SegmentMasters
from .metadata import KVTierConnectorMetadata, KVTierWorkerMetadata, LoadJob, PromoteJob, StoreJob, TierWrite
from .placement import EnginePlacement
from .settings import ConnectorSettings

log = logging.getLogger(__name__)

EXCLUSIVE_SURFACE = "vllm"
"""The replay's surface for the connector with ``exclusive_dram``, the recommended setup
(kvtier.placement.surface.LIVE); without it the connector is ``vllm-write-through``."""


@dataclass(slots=True)
class _Req:
    """What the scheduler side remembers about one live request."""

    request: Any  # vllm.v1.request.Request
    session_id: str | None
    agent_id: str | None
    keys: list[BlockKey] = field(default_factory=list)
    num_planned_blocks: int = 0  # leading blocks already planned for storing (or skipped)
    pending_jobs: set[int] = field(default_factory=set)  # store jobs still reading engine blocks
    loading: bool = False  # an asynchronous load is in flight
    # approximate reuse: (block index, master key) of each block inside a declared shared segment; None = exact
    approx: list[tuple[int, int]] | None = None
    approx_loaded: set[int] = field(default_factory=set)  # block indices loaded from another request's copy
    lane_keys: dict[int, list[BlockKey]] = field(default_factory=dict)  # hybrid: other KV cache groups' keys


@dataclass(frozen=True, slots=True)
class _Match:
    """A lookup answered by get_num_new_matched_tokens, used by update_state_after_alloc:
    ``num_blocks`` from DRAM / SSD, then ``num_remote`` from the remote tier."""

    start_block: int
    num_blocks: int
    num_remote: int = 0
    keys: tuple[BlockKey, ...] = ()  # approximate reuse: the keys to load (segment masters in place of own)
    shifts: tuple[int, ...] = ()  # and by how many positions each block's keys turn
    held: tuple[BlockKey, ...] = ()  # the local hit, referenced until its load is planned (see _drop_match)


@dataclass(slots=True)
class _RemoteLookup:
    """A question to the remote store in flight: which of blocks ``lo:hi`` it holds."""

    lo: int
    hi: int
    future: Future[list[bool]]
    started_s: float
    keys: tuple[BlockKey, ...] = ()


REMOTE_LOOKUP_GIVE_UP_S = 2.0  # a store that has not answered by then counts as a miss (remote_lookup_timeouts)
REMOTE_KNOWN_MAX = 1 << 20  # keys remembered as in the remote store (not written again)
REMOTE_FAILED_TTL_S = 60.0  # a key whose remote load failed is not offered again for this long
REMOTE_FAILED_MAX = 1 << 16
ROUND_HOLD_MAX_S = 600.0  # a shared round's hold and pins end after this long even if its agents never all come
ROUND_UNANNOUNCED_S = 60.0  # a round seen in requests but never announced is forgotten after this long
ROUNDS_MAX = 4096  # shared rounds tracked at once (the oldest forgotten first, their holds given back)


@dataclass(slots=True)
class _Round:
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


class KVTierScheduler:
    """The scheduler-side half. One instance per engine (scheduler process).

    ``world_size`` is how many workers report each plan; a block becomes
    readable only when all of them reported it stored.
    """

    def __init__(self, settings: ConnectorSettings, namespace: Namespace, block_size: int, world_size: int,
                 kv_events: bool = False, window_blocks: Sequence[int] = (0,)) -> None:
        cfg = settings.config
        self.settings = settings
        self.namespace = namespace
        # KV cache groups (vLLM's hybrid KV cache manager): per group 0 (full attention) or the blocks its
        # sliding window reads before a reuse point. Each group is a lane of keys of its own; the first
        # full-attention group's keys are the request's keys (placement, recording, KV events)
        self.lanes = tuple(window_blocks)
        self.hybrid = len(self.lanes) > 1
        self.primary = self.lanes.index(0)
        self._lane_ns = {g: replace(namespace, tenant=f"{namespace.tenant}\x1fkv-cache-group-{g}")
                         for g in range(len(self.lanes)) if g != self.primary}
        self._hybrid_loads: dict[int, tuple[int, int]] = {}  # load plan id -> (token blocks offered, blocks read)
        self.block_size = block_size
        self.world_size = world_size
        self.policy = make_placement(settings.placement, "kv_connector_extra_config.placement",
                                     settings.placement_params)
        specs = []
        for t in cfg.enabled_tiers:  # the placement's own order (e.g. kvtier's next use) unless one is set
            order = self.policy.eviction_for(t, lambda: self.placement.now)  # (read once placement exists)
            specs.append(TierSpec(t, getattr(cfg, t).capacity_blocks,
                                  getattr(cfg, t).policy if settings.eviction_set or order == "lru" else order))
        # removals are always read (_pump_events: SSD deletes); per-block stored events only for a KV-event feed
        self.manager = TierManager(specs, pin_budget_blocks=cfg.pin_budget_blocks, record_block_events=kv_events)
        # KV cache events of kvtier's tiers for vLLM's publisher (take_kv_events); with them on, what a
        # BlockStored needs of each planned block: (vLLM hash, parent vLLM hash, token ids), while it is stored
        self.kv_events = kv_events
        self._event_meta: dict[BlockKey, tuple[Any, Any, list[int]]] = {}
        self._kv_events: list[tuple[Any, ...]] = []
        self.counters: Counter[str] = Counter()
        self._reqs: dict[str, _Req] = {}
        self._matches: dict[str, _Match] = {}
        self._loads: list[LoadJob] = []
        self._load_plans: dict[int, tuple[str, LoadPlan | None, tuple[BlockKey, ...]]] = {}  # + its remote keys
        self._store_plans: dict[int, StorePlan] = {}
        self._job_to_req: dict[int, str] = {}
        self._reports: dict[int, tuple[int, list[bool]]] = {}
        self._gather_reports: Counter[int] = Counter()
        self._release: list[str] = []
        self._ssd_deletes: list[int] = []
        self._job_ids = itertools.count(1)
        self.placement = EnginePlacement(self.manager, block_size, cfg.layout.to_layout().bytes_per_block,
                                         self.counters, hold_budget_fraction=settings.hbm_hold_budget_fraction,
                                         holds_enabled=settings.hbm_hold)
        self.placement.hold_groups = (self.primary, tuple((g, w) for g, w in enumerate(self.lanes) if g != self.primary))
        self._promote_plans: dict[int, Any] = {}
        # Exclusive DRAM (settings.exclusive_dram; one KV cache group): computed blocks are not written through
        # to DRAM. Each is watched in HBM instead (BlockPool.unpin_blocks' on_reuse): engine block id -> (key,
        # parent). When vLLM hands the slot to another request, the block is planned into DRAM and copied out
        # before that step's forward; a load out of DRAM moves the block (the DRAM copy is dropped once the
        # loaded HBM block is watched). Store plans of write-backs waiting for the next step's metadata, and
        # store plans whose bytes went stale (a connector reset) while in flight.
        self.exclusive = settings.exclusive_dram and "dram" in self.manager.tier_names and not self.hybrid
        self._watched: dict[int, tuple[BlockKey, BlockKey | None]] = {}
        self._write_backs: list[tuple[int, BlockKey, BlockKey | None, StorePlan]] = []
        self._stale_plans: set[int] = set()
        self._load_starts: dict[int, int] = {}  # exclusive: load plan id -> the request's first block loaded
        if self.exclusive:  # what the replay models this setup as; HBM in the policy's next-use order
            self.placement.surface = surface(EXCLUSIVE_SURFACE)
            self.placement.next_use = self.policy.next_use_rank
        # (session, agent) -> its latest finished context (keys, vLLM hashes), for tool calls the hint server announces
        self._last_ctx: OrderedDict[tuple[str, str], tuple[list[BlockKey], list[Any]]] = OrderedDict()
        self._hints: Any = None
        self._graph_cache: dict[tuple[str, str], tuple[float, str | None]] = {}
        self._ended_agents: set[tuple[str, str]] = set()
        self.hint_address: str | None = None
        self._next_poll_s = 0.0
        if settings.hint_server:
            from kvtier.agents import AgentGraph
            from kvtier.hints.server import BackgroundHintServer

            # a tool never seen yet is predicted from all tools' waits (the request-stream hints' agents have no type)
            self._hints = BackgroundHintServer(graph=AgentGraph(global_fallback=True))
            self.hint_address = self._hints.start(settings.hint_server)
            self.placement.graph_reader = self._graph_facts
            log.info("kvtier: hint server hosted in the scheduler process at %s", self.hint_address)
        self._watcher: Any = None
        if settings.hint_watch:
            from kvtier.sdk.watch import AgentsWatcher

            self._watcher = AgentsWatcher(settings.hint_watch, token=settings.hint_watch_token)
            self.placement.graph_reader = self._graph_facts
            log.info("kvtier: following the hint server at %s", settings.hint_watch)
        self._kv_cache_manager: Any = None
        self._gpu_block_pool: Any = None
        self._stats_lock = threading.Lock()
        self._stats_dirty = True
        self.recorder: Any = None
        if settings.record_path:
            from kvtier.recording.requests import RequestRecorder

            self.recorder = RequestRecorder(settings.record_path, block_size, namespace.model.split("|")[0],
                                          max_bytes=settings.record_max_bytes)
            log.info("kvtier: recording served requests as AgentX traces in %s", settings.record_path)
        # Lossy values (a lossy tier codec, or cold blocks under cold_codec) and the keys loaded from one, which
        # are never stored again, in any tier (kvtier.tiers.lossy: the rule TieredStore keeps too).
        codecs = {"ssd": cfg.ssd.codec, "remote": settings.remote.codec if settings.remote is not None else "raw"}
        self._lossy = LossyCopies(tier for tier, codec in codecs.items() if codec in LOSSY_CODECS)
        if "ssd" in self.manager.tier_names:
            self._reindex_ssd()
        self._remote: Any = None
        self._remote_pool: ThreadPoolExecutor | None = None
        self._remote_lookups: dict[str, _RemoteLookup] = {}
        self._remote_known: OrderedDict[BlockKey, None] = OrderedDict()  # in the store: not written again
        # keys whose remote load failed (corrupt, foreign, gone) -> until when they are not offered: vLLM
        # reschedules a failed load, and the store would answer "present" again
        self._remote_failed: OrderedDict[BlockKey, float] = OrderedDict()
        # remote writes in flight: plan id -> (keys, their KV-event metadata); ids < 0, apart from the manager's
        self._remote_stores: dict[int, tuple[list[BlockKey], list[Any]]] = {}
        self._remote_ids = itertools.count(-1, -1)
        if settings.remote is not None:
            self._remote = remoteshare.acquire(settings.remote, namespace, cfg.layout.to_layout())
            self._remote_pool = ThreadPoolExecutor(1, thread_name_prefix="kvtier-remote-lookup")
        # approximate reuse: its requests' keys come from a namespace of their own (exact ones never meet them)
        self._approx = SegmentMasters(namespace, block_size, self.counters, self.manager.contains) \
            if settings.approximate_rope is not None else None
        # shared rounds: (session, round id) -> what requests said of them; the hint server's announcements
        self._rounds: OrderedDict[tuple[str, str], _Round] = OrderedDict()
        self._announced: dict[tuple[str, str], tuple[str, ...]] = {}

    # ------------------------------------------------------------ engine hooks

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        """Keep the engine's KV cache manager: the source of a request's block ids."""
        self._kv_cache_manager = kv_cache_manager

    def bind_gpu_block_pool(self, block_pool: Any) -> None:
        """Keep the engine's block pool: HBM holds (public ``touch`` / ``free_blocks``), free-block stats and,
        with exclusive DRAM, watched blocks (``unpin_blocks``; ``blocks``, the pool's list of blocks by id)."""
        if self.exclusive and not callable(getattr(block_pool, "unpin_blocks", None)):
            raise ConfigError("kv_connector_extra_config.exclusive_dram", True,
                              "this vLLM's BlockPool has no unpin_blocks(blocks, on_reuse) (vLLM 0.32 has): "
                              "leave exclusive_dram off")
        self._gpu_block_pool = block_pool
        self.placement.bind_block_pool(block_pool)

    def on_new_request(self, request: Any) -> None:
        """Record a new request, the session / agent ids and hints of its
        ``kv_transfer_params``; a request of a waiting agent ends its wait."""
        st = self._state(request)
        self.counters["requests"] += 1
        agent = self._agent(st)
        if agent is not None:
            crit = request_criticality(getattr(request, "kv_transfer_params", None))
            if crit is not None:
                self.placement.criticalities[agent] = crit
        if self.recorder is not None:
            prompt = int(request.num_prompt_tokens)
            self.recorder.arrived(request.request_id, st.session_id, st.agent_id, prompt,
                                  self._keys(st)[: prompt // self.block_size])
        need = -(-int(request.num_tokens) // self.block_size)
        if self.placement.arrived(request.request_id, agent, need) and agent is not None:
            self.policy.on_wait_end(self.placement, agent, self._keys(st))
            self.placement.wait_ended(agent)

    # ------------------------------------------------------------ lookups

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens past ``num_computed_tokens`` (block aligned) that kvtier can load,
        and whether the load is asynchronous (always, when there are any). Reads
        the in-memory index only. The last prompt token is never offered: the
        engine must compute at least one token to sample."""
        self.placement.settle_order()  # (before this pass allocates: the waits that started last step)
        self._drop_match(request.request_id)  # asked again (its allocation failed, or it was deferred)
        st = self._state(request)
        keys = self._keys(st)
        max_blocks = min(len(keys), (request.num_tokens - 1) // self.block_size)
        start = num_computed_tokens // self.block_size
        self.counters["lookups"] += 1
        if max_blocks <= start:
            return 0, False
        if self.hybrid:
            return self._lanes_hit(st, start, max_blocks)
        shifts: list[int] = []
        if st.approx and self._approx is not None:
            keys, shifts = self._approx.keys_to_load(st.approx, keys)
        hit = self.manager.lookup(keys[start:max_blocks])
        if self.exclusive and start + hit.num_blocks < max_blocks and \
                self.manager.is_pending(keys[start + hit.num_blocks], "dram"):
            # its prefix goes on in a block on its way into DRAM (written back this step, or promoted):
            # vLLM asks again next step instead of computing what lands in a moment
            self.counters["load_deferred"] += 1
            return None, False  # type: ignore[return-value]
        remote = 0
        if self._remote is not None and start + hit.num_blocks < max_blocks:
            got = self._remote_hit(request.request_id, keys, start + hit.num_blocks, max_blocks)
            if got is None:
                return None, False  # the store has not answered yet: vLLM asks again next step
            remote = got
        if hit.num_blocks + remote == 0:
            return 0, False
        end = start + hit.num_blocks + remote
        held = tuple(keys[start:start + hit.num_blocks])
        self.manager.acquire(held)
        self._matches[request.request_id] = _Match(start, hit.num_blocks, remote, tuple(keys[start:end]),
                                                   tuple(shifts[start:end]) if any(shifts[start:end]) else (), held)
        return (hit.num_blocks + remote) * self.block_size, True

    def _drop_match(self, req_id: str) -> _Match | None:
        """Forget ``req_id``'s answered lookup, releasing its hit. The hit is referenced
        from the lookup until the load is planned (or the request is asked again, or
        ends): in between, vLLM allocates the request's blocks, and with
        ``exclusive_dram`` each HBM block it reuses is written back to DRAM, which could
        otherwise evict a block just matched (the load then came back short and vLLM
        recomputed what it had counted as a hit). Released, the blocks go back into
        their tier's order as just used: a lookup that finds them counts as a use."""
        match = self._matches.pop(req_id, None)
        if match is not None and match.held:
            self.manager.release(match.held)
        return match

    def _lanes_hit(self, st: _Req, start: int, max_blocks: int) -> tuple[int, bool]:
        """A hybrid model's hit past block ``start``: the longest run every
        full-attention group holds, cut back until every sliding-window group
        holds its window before the hit point (its blocks before ``start`` are
        vLLM's own hit, in HBM)."""
        end = max_blocks
        for g, w in enumerate(self.lanes):
            if not w:
                end = min(end, start + self.manager.lookup(self._lane_keys(st, g)[start:end]).num_blocks)
        while end > start and not all(self._window_held(st, g, w, start, end) for g, w in enumerate(self.lanes) if w):
            end -= 1
        if end <= start:
            return 0, False
        self._matches[st.request.request_id] = _Match(start, end - start)
        return (end - start) * self.block_size, True

    def _window_held(self, st: _Req, lane: int, window: int, start: int, end: int) -> bool:
        keys = self._lane_keys(st, lane)[max(start, end - window):end]
        return self.manager.lookup(keys).num_blocks == len(keys)

    def _lane_blocks(self, st: _Req, start: int, end: int) -> list[tuple[int, int, list[BlockKey]]]:
        """Per KV cache group, primary first: (group, first block, keys of blocks
        ``first:end``) to move for blocks ``start:end``: every block of a
        full-attention group, the window before ``end`` of a sliding-window one."""
        order = [self.primary] + [g for g in range(len(self.lanes)) if g != self.primary]
        out = []
        for g in order:
            lo = start if not self.lanes[g] else max(start, end - self.lanes[g])
            out.append((g, lo, self._lane_keys(st, g)[lo:end]))
        return out

    def _lane_keys(self, st: _Req, lane: int) -> list[BlockKey]:
        """Keys of the request's full blocks in KV cache group ``lane`` (the primary
        group's are :meth:`_keys`; another group's chain in a namespace of its own)."""
        if lane == self.primary:
            return self._keys(st)
        keys = st.lane_keys.setdefault(lane, [])
        hashes = st.request.block_hashes
        if len(hashes) > len(keys):
            keys.extend(chain_foreign_keys(self._lane_ns[lane], hashes[len(keys):], keys[-1] if keys else None))
        return keys

    def _remote_hit(self, req_id: str, keys: list[BlockKey], lo: int, hi: int) -> int | None:
        """How many of blocks ``lo:hi`` the remote store holds, as a leading run;
        ``None`` while its answer is still out. The question goes to the lookup
        thread; this step waits at most ``remote_lookup_wait_ms`` for it."""
        assert self._remote_pool is not None and self.settings.remote is not None
        q = self._remote_lookups.get(req_id)
        wait = 0.0
        if q is None or (q.lo, q.hi, q.keys) != (lo, hi, tuple(keys[lo:hi])):  # (approximate keys can change)
            q = self._remote_lookups[req_id] = _RemoteLookup(
                lo, hi, self._remote_pool.submit(self._remote.contains_many, keys[lo:hi]), time.monotonic(),
                tuple(keys[lo:hi]))
            self.counters["remote_lookups"] += 1
            wait = self.settings.remote.lookup_wait_s
        try:
            found = q.future.result(timeout=wait)
        except FutureTimeout:
            if time.monotonic() - q.started_s < REMOTE_LOOKUP_GIVE_UP_S:
                self.counters["remote_lookup_deferred"] += 1
                return None
            self.counters["remote_lookup_timeouts"] += 1
            found = []
        except Exception as exc:  # the store's client failing is a miss, never a failed step
            log.warning("kvtier: remote lookup failed: %s", exc)
            self.counters["remote_errors"] += 1
            found = []
        del self._remote_lookups[req_id]
        n = found.index(False) if False in found else len(found)
        if self._remote_failed:
            now = time.monotonic()
            for i, key in enumerate(keys[lo : lo + n]):
                until = self._remote_failed.get(key)
                if until is not None and until > now:
                    n = i
                    self.counters["remote_lookup_failed_skips"] += 1
                    break
        for key in keys[lo + n : lo + len(found)]:  # gone from the store (evicted, or the master restarted)
            self._remote_known.pop(key, None)
        return n

    def hit_sources(self, request: Any) -> dict[str, int]:
        """Tokens of ``request``'s planned load per tier (``dram`` / ``ssd`` / ``remote``)."""
        out: Counter[str] = Counter()
        for job in self._loads:
            if job.req_id == request.request_id:
                for tier in job.tiers:
                    out[tier] += self.block_size
        return dict(out)

    def update_state_after_alloc(self, request: Any, block_ids: Sequence[int], num_external_tokens: int,
                                 group_block_ids: Sequence[Sequence[int]] | None = None) -> None:
        """Plan the load of ``num_external_tokens`` into the request's new blocks
        (``block_ids``: the first group's; ``group_block_ids``: every group's)."""
        match = self._drop_match(request.request_id)  # (the load plan references what it reads)
        if num_external_tokens == 0 or match is None:
            return
        st = self._state(request)
        if self.hybrid:
            assert group_block_ids is not None
            self._plan_lanes_load(st, match.start_block, num_external_tokens // self.block_size, group_block_ids)
            return
        n = num_external_tokens // self.block_size
        keys = list(match.keys[:n]) if match.keys else self._keys(st)[match.start_block : match.start_block + n]
        targets = tuple(block_ids[match.start_block : match.start_block + n])
        local = min(n, match.num_blocks)
        plan = self.manager.prepare_load(keys[:local]) if local else None
        got = len(plan.keys) if plan is not None else 0
        self.counters["load_short_blocks"] += local - got  # (none: the match was held until now)
        remote = tuple(keys[local:]) if got == local else ()  # the remote run must follow the local one
        if got + len(remote) == 0:  # cannot happen within one step; the worker fails every block
            job = LoadJob(request.request_id, 0, (), (), (), targets)
        else:
            tiers = (plan.tiers if plan is not None else ()) + ("remote",) * len(remote)
            slots = tuple(s if t != "ssd" else 0 for s, t in zip(plan.slots, plan.tiers)) if plan is not None else ()
            plan_id = plan.plan_id if plan is not None else next(self._remote_ids)
            shifts = ()
            if match.shifts:  # the local run (possibly cut short by prepare_load), then the remote one
                shifts = tuple(match.shifts[:got]) + (tuple(match.shifts[local:local + len(remote)]) if remote else ())
                self.counters["approximate_loaded_blocks"] += sum(1 for x in shifts if x)
                rows = list(range(got)) + list(range(local, local + len(remote)))
                st.approx_loaded.update(match.start_block + r for r, x in zip(rows, shifts) if x)
            job = LoadJob(request.request_id, plan_id, (plan.keys if plan is not None else ()) + remote, tiers,
                          slots + (0,) * len(remote), targets, shifts)
            self._load_plans[plan_id] = (request.request_id, plan, remote)
            if self.exclusive and plan is not None and st.approx is None:
                self._load_starts[plan_id] = match.start_block
            self._note_lossy_loads(job)
            if job.shifts:  # a block rotated from a lossy value is lossy under the request's own key too
                self._lossy.derive(self._keys(st)[match.start_block:match.start_block + len(job.keys)], job.keys)
        st.loading = True
        self._loads.append(job)
        self.counters["load_planned_tokens"] += n * self.block_size

    def _plan_lanes_load(self, st: _Req, start: int, n: int, group_block_ids: Sequence[Sequence[int]]) -> None:
        """A hybrid model's load of blocks ``start:start + n``: every group's blocks in
        one job, primary group first; sliding-window groups only inside the window."""
        keys: list[BlockKey] = []
        targets: list[int] = []
        for g, lo, lane in self._lane_blocks(st, start, start + n):
            keys += lane
            targets += group_block_ids[g][lo : start + n]
            if self.lanes[g]:
                self.counters["load_window_skipped_blocks"] += n - len(lane)
        plan = self.manager.prepare_load(keys)
        req_id = st.request.request_id
        if plan is None:
            job = LoadJob(req_id, 0, (), (), (), tuple(targets))
        else:
            job = LoadJob(req_id, plan.plan_id, plan.keys, plan.tiers,
                          tuple(s if t != "ssd" else 0 for s, t in zip(plan.slots, plan.tiers)), tuple(targets))
            self._load_plans[plan.plan_id] = (req_id, plan, ())
            self._hybrid_loads[plan.plan_id] = (n, len(keys))
            self._note_lossy_loads(job)
        st.loading = True
        self._loads.append(job)
        self.counters["load_planned_tokens"] += n * self.block_size

    def _note_lossy_loads(self, job: LoadJob) -> None:
        """Remember the keys this load reads from a lossy value (never stored again)."""
        self.counters["load_lossy_blocks"] += self._lossy.decoded(job.keys, job.tiers)

    def _store_runs(self, new: list[BlockKey], parent: BlockKey | None) -> list[tuple[list[BlockKey], BlockKey | None]]:
        """``new`` (a chain after ``parent``) as runs of keys that may be stored, each with
        the key before it: keys loaded from a lossy value are left out (counted)."""
        if not self._lossy.any_copies():
            return [(new, parent)]
        runs: list[tuple[list[BlockKey], BlockKey | None]] = []
        before = parent
        for key, ok in zip(new, self._lossy.storable(new)):
            if not ok:
                self.counters["store_skipped_lossy_blocks"] += 1
            elif runs and runs[-1][0][-1] == before:
                runs[-1][0].append(key)
            else:
                runs.append(([key], before))
            before = key
        return runs

    # ------------------------------------------------------------ per step

    def build_connector_meta(self, scheduler_output: Any) -> KVTierConnectorMetadata:
        """This step's loads, stores (blocks that become full in this step's
        forward), releases and SSD deletions. Resets the per-step state."""
        self.poll_hints()
        self.placement.scheduled(scheduler_output.num_scheduled_tokens)  # allocated by now: holds may go
        self.placement.tick()
        self.placement.settle_order()
        meta = KVTierConnectorMetadata(loads=self._loads, release=self._release)
        for plan in self.placement.take_promotions():
            self._promote_plans[plan.plan_id] = plan
            meta.promotions.append(PromoteJob(plan.plan_id, tuple(int(k) for k in plan.keys), plan.dst_slots))
        self._loads, self._release = [], []
        for req_id, num_new in scheduler_output.num_scheduled_tokens.items():
            st = self._reqs.get(req_id)
            if st is None or st.loading:
                continue
            upto = (st.request.num_computed_tokens + num_new) // self.block_size
            job = self._plan_store(req_id, st, upto)
            if job is not None:
                meta.stores.append(job)
        if self._write_backs:
            job = self._write_back_job(scheduler_output)
            if job is not None:
                meta.write_backs.append(job)
        meta.ssd_deletes, self._ssd_deletes = self._ssd_deletes, []
        meta.preempted = sorted(getattr(scheduler_output, "preempted_req_ids", None) or ())
        return meta

    def update_connector_output(self, worker_meta: KVTierWorkerMetadata | None) -> None:
        """Apply the workers' results: complete store and load plans once every
        worker reported, and forget store jobs whose blocks every worker read. (vLLM calls
        this after freeing the step's finished requests: their agents' HBM blocks go in order.)"""
        self.placement.settle_order()
        if worker_meta is None:
            return
        self.counters["worker_cpu_us"] += worker_meta.busy_us
        if worker_meta.skipped_blocks:
            self.counters["store_skipped_backpressure"] += worker_meta.skipped_blocks
        if worker_meta.remote_skipped_blocks:
            self.counters["store_skipped_backpressure_remote"] += worker_meta.remote_skipped_blocks
        for outcome, n in worker_meta.remote_outcomes.items():  # the workers' store clients: why reads missed
            self.counters[outcome if outcome.startswith("remote_") else f"remote_{outcome}"] += n
        if worker_meta.write_backs_missed:
            self.counters["write_back_missed"] += worker_meta.write_backs_missed
        if worker_meta.staging_skipped_stores:
            self.counters["store_skipped_staging"] += worker_meta.staging_skipped_stores
        if worker_meta.staging_skipped_loads:
            self.counters["load_skipped_staging"] += worker_meta.staging_skipped_loads
        for job_id, n in worker_meta.gathered.items():
            self._gather_reports[job_id] += n
            if self._gather_reports[job_id] >= self.world_size:
                del self._gather_reports[job_id]
                req_id = self._job_to_req.pop(job_id, None)
                st = self._reqs.get(req_id) if req_id is not None else None
                if st is not None:
                    st.pending_jobs.discard(job_id)
        for plan_id, (n, oks) in worker_meta.plans.items():
            seen, acc = self._reports.get(plan_id, (0, [True] * len(oks)))
            acc = [a and b for a, b in zip(acc, oks)]
            if seen + n < self.world_size:
                self._reports[plan_id] = (seen + n, acc)
                continue
            self._reports.pop(plan_id, None)
            self._complete(plan_id, acc)
        self._pump_events()
        self._stats_dirty = True
        self.write_stats()

    def request_finished(self, request: Any) -> bool:
        """Forget ``request``; True (keep its blocks) while a worker still reads
        them for a store, or writes them for a load."""
        st = self._reqs.pop(request.request_id, None)
        self._drop_match(request.request_id)
        self._remote_lookups.pop(request.request_id, None)
        self.placement.finished(request.request_id)
        wait_s = request_tool_wait_s(getattr(request, "kv_transfer_params", None))
        if self.recorder is not None:
            self.recorder.finished(request.request_id, int(request.num_output_tokens), wait_s is not None)
        if st is not None:
            self._agent_waits(st, wait_s)
            if st.approx and self._approx is not None:
                self._approx.register(st.approx, st.keys, st.approx_loaded)
            self._round_served(st)
        if st is None or not (st.pending_jobs or st.loading):
            return False
        self.counters["delayed_frees"] += 1
        if st.pending_jobs:
            self._release.append(request.request_id)  # freed when the workers report it sent
        # a request with a load in flight is freed by the engine when the load reports finished
        return True

    def _agent_waits(self, st: _Req, wait_s: float | None) -> None:
        """A tagged request finished: its agent now waits, on a tool for ``wait_s``
        (``kvtier_tool_wait_s`` in its ``kv_transfer_params``) or else on its user or
        on nothing, for it may be done (cause ``turn_end``, predicted
        :data:`TURN_END_GAP_S`). With a hint server the framework (or the
        request-stream middleware) announces the turn's tool calls only after this:
        the ``turn_end`` wait starts all the same, and a tool call announced later
        re-times it (``_apply_hints``, counted in ``waits_retimed``). Without it the
        agent would stay busy in kvtier's next-use order until its session expired,
        its context kept behind every agent that does come back.
        The placement policy decides (hold its HBM blocks, order its host copies,
        schedule a prefetch). The context is remembered for tool calls a hint
        server announces."""
        agent = self._agent(st)
        if agent is None:
            return
        keys = self._keys(st)
        hashes = list(st.request.block_hashes[: len(keys)])
        if (self._hints is not None or self._watcher is not None) and keys:
            self._last_ctx[agent] = (keys, hashes)
            self._last_ctx.move_to_end(agent)
            while len(self._last_ctx) > self.MAX_TRACKED_AGENTS:
                self._last_ctx.popitem(last=False)
        if not keys:
            return
        if any((o.session_id, o.agent_id) == agent for o in self._reqs.values()):
            self.counters["waits_not_started_busy"] += 1  # another request of the agent runs: it does not wait
            return
        finishing = -(-int(st.request.num_tokens) // self.block_size)
        if wait_s is not None:
            self._start_wait(agent, keys, hashes, wait_s, finishing)
        else:
            self._start_wait(agent, keys, hashes, TURN_END_GAP_S, finishing, "turn_end")

    MAX_TRACKED_AGENTS = 4096

    def _start_wait(self, agent: tuple[str, str], keys: list[BlockKey], hashes: list[Any], wait_s: float,
                    finishing_blocks: int, cause: str = "tool") -> None:
        self.placement.waiting_starts(agent, keys, hashes, finishing_blocks, tool=cause == "tool")
        try:
            self.policy.on_wait_start(self.placement, ToolWait(agent, tuple(keys), cause, wait_s))
        finally:
            self.placement.waiting_started()
        self.counters["tool_waits" if cause == "tool" else "user_waits"] += 1
        self._pump_events()

    def _agent(self, st: _Req) -> tuple[str, str] | None:
        return (st.session_id, st.agent_id) if st.session_id is not None and st.agent_id is not None else None

    def _graph_facts(self, agent: tuple[str, str]) -> tuple[float, str | None] | None:
        """(criticality, parent id) of ``agent`` from the hosted hint server's DAG, as
        last polled (``poll_hints``); ``None`` for an agent it does not know."""
        return self._graph_cache.get(agent)

    def poll_hints(self) -> None:
        """With a hint server (hosted here, or followed with ``hint_watch``): start the wait of every agent it has a
        tool call in flight for (its predicted return; 10 s without one), or re-time the ``turn_end`` wait its
        request's end started (``waits_retimed``: the call is announced after the response), refresh
        the agents' criticalities and parents, and tell the policy which agents and
        sessions ended (it retires their private blocks in DRAM / SSD). At most
        every 50 ms; called each step."""
        if self._hints is None and self._watcher is None:  # the common case: no clock read on the scheduler step
            return
        now = time.monotonic()
        if now < self._next_poll_s:
            return
        self._next_poll_s = now + 0.05
        got = self._read_hosted(now) if self._hints is not None else self._read_watched()
        if got is not None:
            self._apply_hints(now, *got)

    def _read_watched(self) -> tuple[list[tuple[str, str, float | None]], dict[tuple[str, str], tuple[float, str | None]],
                                     set[tuple[str, str]], dict[tuple[str, str], tuple[str, ...]] | None] | None:
        """The newest view of a separate hint server (``hint_watch``); never waits."""
        snap = self._watcher.latest()
        if snap is None:
            return None
        calls = [(k[0], k[1], a.returns_at_s) for k, a in snap.agents.items() if a.tool_in_flight]
        facts = {k: (a.criticality, a.parent_id) for k, a in snap.agents.items()}
        ended = {k for k, a in snap.agents.items() if a.ended}
        return calls, facts, ended, snap.rounds

    def _read_hosted(self, now: float) -> tuple[list[tuple[str, str, float | None]],
                                                dict[tuple[str, str], tuple[float, str | None]],
                                                set[tuple[str, str]], dict[tuple[str, str], tuple[str, ...]]] | None:
        graph = self._hints.server.graph

        def read() -> tuple[list[tuple[str, str, float | None]], dict[tuple[str, str], tuple[float, str | None]],
                            set[tuple[str, str]], dict[tuple[str, str], tuple[str, ...]]]:
            calls = [(s.session_id, c.agent_id, c.predicted_return_s) for s, c in graph.tool_calls_in_flight()]
            facts: dict[tuple[str, str], tuple[float, str | None]] = {}
            ended: set[tuple[str, str]] = set()
            rounds: dict[tuple[str, str], tuple[str, ...]] = {}
            for s in graph.sessions():
                for rid, rnd in s.rounds.items():
                    rounds[(s.session_id, rid)] = rnd.agent_ids
                crit = graph.criticalities(s.tenant, s.session_id, now)
                for aid, a in s.agents.items():
                    facts[(s.session_id, aid)] = (float(crit.get(aid, 0.0)), a.parent_id)
                    if a.ended_s is not None:
                        ended.add((s.session_id, aid))
            scored.append(graph.history.error())
            return calls, facts, ended, rounds

        scored: list[Any] = []
        try:
            got = self._hints.call(read, timeout_s=1.0)
            self._note_prediction_error(scored[0])
            return got
        except Exception as exc:  # a stuck hint loop must not stop the scheduler
            log.warning("kvtier: reading the hosted hint server failed: %s", exc)
            return None

    def _note_prediction_error(self, err: Any) -> None:
        """The hosted server's tool-wait predictions scored so far, as counters:
        ``tool_wait_predictions`` and ``tool_wait_abs_error_ms`` (their ratio is the mean
        absolute error) and ``tool_wait_under_predictions`` (the tool came back later)."""
        new = err.num_predictions - self.counters["tool_wait_predictions"]
        if new <= 0:
            return
        self.counters["tool_wait_predictions"] += new
        total_ms = round(err.mean_abs_error_s * err.num_predictions * 1000)
        self.counters["tool_wait_abs_error_ms"] += max(0, total_ms - self.counters["tool_wait_abs_error_ms"])
        under = round(err.under_fraction * err.num_predictions)
        self.counters["tool_wait_under_predictions"] += max(0, under - self.counters["tool_wait_under_predictions"])
        self._stats_dirty = True

    def _apply_hints(self, now: float, calls: list[tuple[str, str, float | None]],
                     facts: dict[tuple[str, str], tuple[float, str | None]], ended: set[tuple[str, str]],
                     rounds: dict[tuple[str, str], tuple[str, ...]] | None = None) -> None:
        if rounds is not None:
            self._announce_rounds(rounds)
        before = self._graph_cache
        self._graph_cache = facts
        for agent in sorted(ended - self._ended_agents):
            known = self._last_ctx.get(agent)
            if known:
                self.policy.on_agent_end(self.placement, agent, tuple(known[0]))
                self.counters["agents_ended"] += 1
        self._ended_agents = ended
        for sid in sorted({a[0] for a in before} - {a[0] for a in facts}):
            self.policy.on_session_end(self.placement, sid)
            self.counters["sessions_ended"] += 1
        self._pump_events()
        # an agent with a request in the engine is not waiting, whatever the server says: its call's end may
        # not have reached the server yet (a wait started then would hold a running agent's blocks)
        busy = {(st.session_id, st.agent_id) for st in self._reqs.values()} if calls else set()
        for sid, aid, returns_s in calls:
            agent = (sid, aid)
            known = self._last_ctx.get(agent)
            if agent in busy:
                continue
            if known and not self.placement.is_waiting(agent, tool=True):
                keys, hashes = known
                if self.placement.is_waiting(agent):  # on its turn's end: the call announced since re-times it
                    self.counters["waits_retimed"] += 1
                self._start_wait(agent, keys, hashes,
                                 max(0.01, returns_s - now) if returns_s is not None else 10.0, 0)

    # ------------------------------------------------------------ shared rounds

    def _round_served(self, st: _Req) -> None:
        """A finished request of a shared round (``kvtier_round_id``): learn the round's
        shared prefix from it (the first one), count its agent as served, settle. Only
        with a hint server (hosted, or followed), where rounds are announced."""
        tag = request_round(getattr(st.request, "kv_transfer_params", None))
        if tag is None or st.session_id is None or st.agent_id is None or (self._hints is None
                                                                           and self._watcher is None):
            return
        rkey = (st.session_id, tag[0])
        rnd = self._rounds.get(rkey)
        if rnd is None:
            n = tag[1] // self.block_size
            keys = self._keys(st)[:n]
            rnd = self._rounds[rkey] = _Round(list(keys), list(st.request.block_hashes[: len(keys)]),
                                              announced=self._announced.get(rkey, ()), created_s=self.placement.now)
            while len(self._rounds) > ROUNDS_MAX:
                self._release_round(self._rounds.popitem(last=False)[1])
        rnd.served.add(st.agent_id)
        self._settle_round(rnd)

    def _announce_rounds(self, rounds: dict[tuple[str, str], tuple[str, ...]]) -> None:
        """The hint server's rounds in progress (hosted or followed). A round no longer there ended:
        given back and forgotten (one never announced, after ``ROUND_UNANNOUNCED_S``)."""
        self._announced = rounds
        now = self.placement.now
        for rkey, rnd in list(self._rounds.items()):
            rnd.announced = rounds.get(rkey, ())
            if rkey in rounds:
                self._settle_round(rnd)
            elif rnd.held or rnd.done or now - rnd.created_s > ROUND_UNANNOUNCED_S:
                if rnd.held:
                    self.counters["shared_round_ended_early"] += 1
                self._release_round(rnd)
                del self._rounds[rkey]

    def _settle_round(self, rnd: _Round) -> None:
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
                if self.placement.holds is not None and self.settings.hbm_hold:
                    tag = self._round_tag(rnd)
                    self.counters["shared_round_hbm_blocks"] += self.placement.holds.hold(
                        tag, rnd.hashes, now + ROUND_HOLD_MAX_S)
            new = [k for k in rnd.keys if k not in rnd.pinned and self.manager.contains(k)]  # stored by now
            if new:
                if self.manager.pin(new, max(1.0, rnd.held_s + ROUND_HOLD_MAX_S - now)) is None:
                    self.counters["shared_round_pin_refused"] += 1
                else:
                    rnd.pinned.update(new)
                self._pump_events()
        elif rnd.held or (rnd.announced and not pending):
            if rnd.held and pending:
                self.counters["shared_round_expired"] += 1
            self._release_round(rnd)
            rnd.done = True

    def _release_round(self, rnd: _Round) -> None:
        """Give back the round's HBM hold and its pins (a key another held round also
        pinned stays pinned)."""
        if not rnd.held:
            return
        rnd.held = False
        self.counters["shared_round_releases"] += 1
        if self.placement.holds is not None:
            self.placement.holds.release(self._round_tag(rnd))
        others = set().union(*(r.pinned for r in self._rounds.values() if r is not rnd and r.held))
        self.manager.unpin([k for k in rnd.pinned if k not in others])
        rnd.pinned.clear()
        self._pump_events()

    @staticmethod
    def _round_tag(rnd: _Round) -> BlockKey:
        """The HBM hold's tag of a round (apart from every block key an agent's hold uses)."""
        return BlockKey(id(rnd) | (1 << 127))

    def shutdown(self) -> None:
        """Give back every HBM hold; stop the hosted hint server or the watcher, if any;
        write the recording out."""
        self.placement.release_all()
        if self.recorder is not None:
            self.recorder.close()
            self.counters.update(self.recorder.counters)
            self._stats_dirty = True
            self.write_stats()
        if self._watcher is not None:
            self._watcher.close()
            self._watcher = None
        if self._hints is not None:
            self._hints.stop()
            self._hints = None
        if self._remote is not None:
            assert self._remote_pool is not None
            self._remote_pool.shutdown(wait=True)
            remoteshare.release(self._remote)
            self._remote = None

    def has_pending_work(self) -> bool:
        """Whether plans are still out (so the engine keeps stepping to collect them)."""
        return bool(self._store_plans or self._load_plans or self._release or self._job_to_req
                    or self._promote_plans or self._remote_stores)

    def reset(self) -> bool:
        """Drop every stored block (vLLM calls this on ``reset_prefix_cache(reset_connector=True)``,
        e.g. after a weight update, when stored KV is stale); SSD values are deleted by the
        workers next step. False when a block could not be dropped (a load or store in flight)."""
        for rnd in list(self._rounds.values()):  # round pins would keep stale blocks in the tiers
            self._release_round(rnd)
        self._rounds.clear()
        if self._approx is not None:
            self._approx.clear()
        self.placement.release_all()  # stale KV must go, waiting agents or not
        self._remote_known.clear()  # the shared store is other engines' too: this engine only forgets it
        for req_id in list(self._matches):  # a held lookup (its allocation failed) would keep stale blocks
            self._drop_match(req_id)
        for _, _, _, plan in self._write_backs:  # (vLLM reset its prefix cache first: every watched block came)
            self.manager.complete_store(plan, False)
        self._write_backs.clear()
        self._watched.clear()
        self._stale_plans.update(self._store_plans)  # in flight: they land, but nobody reads them
        for tier in self.manager.tier_names:
            self.manager.evict(tier, self.manager.capacity_blocks(tier))
        self._pump_events()
        self.counters["resets"] += 1
        return all(self.manager.ready_blocks(t) == 0 for t in self.manager.tier_names)

    # ------------------------------------------------------------ stats

    def stats(self) -> dict[str, Any]:
        """Counters (tokens and blocks), tier use and, when bound, free HBM blocks."""
        m = self.manager
        out: dict[str, Any] = {"counters": dict(self.counters), "placement": self.policy.name,
                               "placement_params": dict(self.settings.placement_params),
                               "pending_plans": len(self._store_plans) + len(self._load_plans)
                               + len(self._promote_plans) + len(self._remote_stores)}
        out["tiers"] = {t: {"capacity_blocks": m.capacity_blocks(t), "ready_blocks": m.ready_blocks(t)}
                        for t in m.tier_names}
        if self._gpu_block_pool is not None:
            out["hbm_free_blocks"] = int(self._gpu_block_pool.get_num_free_blocks())
        holds = self.placement.holds
        if holds is not None:
            out["hbm_hold"] = {"budget_blocks": holds.budget_blocks, "held_blocks": holds.held_blocks,
                               "peak_blocks": holds.peak_blocks}
        sessions = Counter(st.session_id for st in self._reqs.values() if st.session_id)
        out["live_sessions"] = len(sessions)
        if self.recorder is not None:
            out["record"] = dict(self.recorder.counters)
        if self._remote is not None:  # the store client's own outcomes (shared with rank 0's worker in one process)
            out["remote"] = {"master": self.settings.remote.master, "counters": dict(self._remote.counters),
                             "known_blocks": len(self._remote_known)}
        return out

    def write_stats(self) -> None:
        """Rewrite ``stats_path`` (atomically) when counters changed."""
        path = self.settings.stats_path
        if not path or not self._stats_dirty:
            return
        with self._stats_lock:
            self._stats_dirty = False
            text = json.dumps(self.stats(), sort_keys=True)
            directory = os.path.dirname(os.path.abspath(path))
            fd, tmp = tempfile.mkstemp(dir=directory, prefix=".kvtier-stats-")
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(tmp, path)

    # ------------------------------------------------------------ internals

    def _state(self, request: Any) -> _Req:
        st = self._reqs.get(request.request_id)
        if st is None:
            params = getattr(request, "kv_transfer_params", None)
            session_id, agent_id = request_tags(params)
            st = self._reqs[request.request_id] = _Req(request, session_id, agent_id)
            spans = request_approximate_segments(params)
            if spans is not None or is_approximate_salt(getattr(request, "cache_salt", None)):
                st.approx = self._segment_blocks(request, spans or [])
        return st

    def _segment_blocks(self, request: Any, spans: list[tuple[int, int]]) -> list[tuple[int, int]] | None:
        """The request's segment blocks (:meth:`SegmentMasters.segment_blocks`); ``None`` (served
        exact) when approximate reuse is off."""
        if self._approx is None:
            self.counters["approximate_refused_off"] += 1
            return None
        return self._approx.segment_blocks(request, spans)

    def _keys(self, st: _Req) -> list[BlockKey]:
        """Keys of the request's full blocks so far (extended as it decodes)."""
        hashes = st.request.block_hashes
        if len(hashes) > len(st.keys):
            parent = st.keys[-1] if st.keys else None
            ns = self.namespace if st.approx is None or self._approx is None else self._approx.namespace
            st.keys.extend(chain_foreign_keys(ns, hashes[len(st.keys):], parent))
        return st.keys

    def _plan_store(self, req_id: str, st: _Req, upto: int) -> StoreJob | None:
        keys = self._keys(st)
        upto = min(upto, len(keys))
        start = st.num_planned_blocks
        if upto <= start or self._kv_cache_manager is None:
            return None
        st.num_planned_blocks = upto
        new = keys[start:upto]
        parent = keys[start - 1] if start else None
        if self.kv_events:
            self._note_event_meta(st, keys, start, upto)
        # what to store, per KV cache group: (runs of (keys, key before, chained)), and per row of the job
        # its key, engine block id (the first group's are read only if something is stored) and chain parent
        ids: list[int] = []
        if self.hybrid:
            groups = self._kv_cache_manager.get_block_ids(req_id)
            units: list[tuple[list[BlockKey], BlockKey | None, bool]] = []
            new, parents = [], []
            for g, lo, lane in self._lane_blocks(st, start, upto):
                if self.lanes[g]:  # a window: independent blocks, stored only inside it
                    self.counters["store_window_skipped_blocks"] += upto - start - len(lane)
                    kept = [k for k, ok in zip(lane, self._lossy.storable(lane)) if ok]
                    units += [(kept, None, False)] if kept else []
                    lane_parents: list[BlockKey | None] = [None] * len(lane)
                else:
                    before = self._lane_keys(st, g)[start - 1] if start else None
                    units += [(run, b, True) for run, b in self._store_runs(lane, before)]
                    lane_parents = [before, *lane[:-1]]
                new += lane
                ids += groups[g][lo:upto]
                parents += lane_parents
        else:
            units = [(run, before, True) for run, before in self._store_runs(new, parent)]
            parents = [parent, *new[:-1]]
        watching = self.exclusive and self._gpu_block_pool is not None  # (else written through, as without)
        if watching:
            self._watch(self._kv_cache_manager.get_block_ids(req_id)[0][start:upto], new, parents)
        plans: list[tuple[int, str, Sequence[BlockKey], Sequence[int]]] = []  # (plan id, tier, keys, slots)
        pin_ttl_s = 0.0  # an agent's blocks are soft-pinned in the remote store
        # cold blocks (their agent then waits long) go to the slow tiers with the lossy codec
        cold = self.settings.cold.codec_for(request_tool_wait_s(getattr(st.request, "kv_transfer_params", None))) \
            if self.settings.cold is not None else None
        for run, before, chained in units:
            for tier in self.manager.tier_names:
                if watching and tier == "dram":
                    continue  # it goes down when HBM evicts it
                plan = self.manager.prepare_store(tier, run, before, chain=chained)
                if plan is not None and plan.keys:
                    plans.append((plan.plan_id, plan.tier, plan.keys, plan.slots))
                    self._store_plans[plan.plan_id] = plan
                    if tier == "ssd" and cold:
                        self._lossy.wrote("ssd", plan.keys)
                        self.counters["store_cold_blocks"] += len(plan.keys)
        self._pump_events()
        if self._remote is not None:
            remote = [k for k, ok in zip(new, self._lossy.storable(new)) if ok and k not in self._remote_known]
            if remote and cold:
                self._lossy.wrote("remote", remote)
            if remote:
                pid = next(self._remote_ids)
                meta = [self._event_meta.get(k) for k in remote] if self.kv_events else []
                self._remote_stores[pid] = (remote, meta)
                plans.append((pid, "remote", remote, (0,) * len(remote)))
                pin_ttl_s = self.settings.remote.pin_ttl_s if self._agent(st) is not None else 0.0
        if not plans:
            return None
        if not self.hybrid:
            ids = self._kv_cache_manager.get_block_ids(req_id)[0][start:upto]
        index = {k: i for i, k in enumerate(new)}
        rows = sorted({index[k] for p in plans for k in p[2]})
        pos = {r: j for j, r in enumerate(rows)}
        writes = tuple(TierWrite(pid, tier, tuple(pos[index[k]] for k in ks), slots,
                                 pin_ttl_s if tier == "remote" else 0.0, (cold or "") if tier in ("ssd", "remote") else "")
                       for pid, tier, ks, slots in plans)
        job = StoreJob(
            job_id=next(self._job_ids), req_id=req_id,
            block_ids=tuple(ids[r] for r in rows),
            keys=tuple(new[r] for r in rows),
            parents=tuple(parents[r] for r in rows),
            writes=writes,
        )
        st.pending_jobs.add(job.job_id)
        self._job_to_req[job.job_id] = req_id
        return job

    # ------------------------------------------------------------ exclusive DRAM

    def _watch(self, block_ids: Sequence[int], keys: Sequence[BlockKey], parents: Sequence[BlockKey | None]) -> None:
        """Be told (:meth:`_on_reuse`) when vLLM hands these engine blocks to another request.
        The request holds them, so ``touch`` then ``unpin_blocks`` leaves their reference
        counts and places in the free queue as they were. O(blocks)."""
        pool = self._gpu_block_pool
        if not block_ids or pool is None:
            return
        blocks = [pool.blocks[i] for i in block_ids]
        pool.touch(blocks)
        pool.unpin_blocks(blocks, self._on_reuse)
        self._watched.update(zip(block_ids, zip(keys, parents)))

    def _on_reuse(self, block: Any) -> None:
        """vLLM's block pool hands ``block`` out again (inside ``get_new_blocks``, in this
        scheduling pass): the block it held goes down to DRAM, unless DRAM has it (refreshed)
        or it came from a lossy value. The copy leaves before this step's forward."""
        entry = self._watched.pop(block.block_id, None)
        if entry is None:
            return
        key, parent = entry
        mgr = self.manager
        plan = None
        if self._lossy.is_copy(key) or mgr.is_pending(key, "dram"):
            pass
        elif mgr.contains(key, "dram"):
            mgr.touch((key,), "dram")
            self.counters["write_back_present"] += 1
        else:
            plan = mgr.prepare_store("dram", (key,), parent)
            if plan is None or not plan.keys:
                plan = None
                self.counters["write_back_no_room"] += 1
        if plan is not None:
            self._write_backs.append((block.block_id, key, parent, plan))
        elif self.kv_events:  # (a block only HBM held: what its KV event would have said goes)
            self._forget_if_gone(key)

    def _write_back_job(self, scheduler_output: Any) -> StoreJob | None:
        """This step's write-backs as one job the workers copy out before the forward. A
        block vLLM zeroes or copies into before the forward (``new_block_ids_to_zero``,
        ``kv_cache_block_copies``) has lost its bytes by then: its write fails."""
        wbs, self._write_backs = self._write_backs, []
        lost = set(getattr(scheduler_output, "new_block_ids_to_zero", None) or ())
        lost.update(c.dst_block_id for c in getattr(scheduler_output, "kv_cache_block_copies", None) or ())
        keep = []
        for wb in wbs:
            if wb[0] in lost:
                self.manager.complete_store(wb[3], False)
                self.counters["write_back_lost"] += 1
            else:
                keep.append(wb)
                self._store_plans[wb[3].plan_id] = wb[3]
        self._pump_events()
        if not keep:
            return None
        self.counters["write_back_blocks"] += len(keep)
        return StoreJob(job_id=next(self._job_ids), req_id="", block_ids=tuple(wb[0] for wb in keep),
                        keys=tuple(wb[1] for wb in keep), parents=tuple(wb[2] for wb in keep),
                        writes=tuple(TierWrite(wb[3].plan_id, "dram", (i,), wb[3].slots) for i, wb in enumerate(keep)))

    def _move_up(self, req_id: str, plan: LoadPlan, start: int, num_ok: int) -> None:
        """Exclusive DRAM: the first ``num_ok`` blocks of a load now live in the request's
        HBM blocks from ``start`` on: watch them there and drop their DRAM copies (a
        copy another load still reads stays)."""
        st = self._reqs.get(req_id)
        if st is None or num_ok <= 0 or self._kv_cache_manager is None:
            return
        keys = list(plan.keys[:num_ok])
        parents = [st.keys[start - 1] if start else None, *keys[:-1]]
        self._watch(self._kv_cache_manager.get_block_ids(req_id)[0][start:start + num_ok], keys, parents)
        dram = [k for k, t in zip(keys, plan.tiers) if t == "dram"]
        self.counters["dram_moved_blocks"] += self.manager.remove(dram, "dram")

    def _complete(self, plan_id: int, oks: list[bool]) -> None:
        if plan_id in self._stale_plans:  # written from blocks of before a connector reset
            self._stale_plans.discard(plan_id)
            oks = [False] * len(oks)
        if plan_id in self._store_plans:
            plan = self._store_plans.pop(plan_id)
            self.manager.complete_store(plan, oks)
            good = sum(oks)
            self.counters[f"stored_blocks_{plan.tier}"] += good
            self.counters[f"store_failed_blocks_{plan.tier}"] += len(oks) - good
        elif plan_id in self._remote_stores:
            self._remote_stored(*self._remote_stores.pop(plan_id), oks)
        elif plan_id in self._promote_plans:
            self.placement.promotion_done(self._promote_plans.pop(plan_id), oks, None)
        elif plan_id in self._hybrid_loads:
            self._complete_lanes_load(plan_id, oks)
        elif plan_id in self._load_plans:
            req_id, plan, remote = self._load_plans.pop(plan_id)
            local = len(plan.keys) if plan is not None else 0
            if plan is not None:
                self.manager.complete_load(plan, oks[:local])
            num_ok = oks.index(False) if False in oks else len(oks)
            start = self._load_starts.pop(plan_id, None)
            if start is not None and plan is not None:
                self._move_up(req_id, plan, start, min(num_ok, local))
            for tier in (plan.tiers if plan is not None else ())[:num_ok]:
                self.counters[f"hit_tokens_{tier}"] += self.block_size
            if num_ok > local:
                self.counters["hit_tokens_remote"] += (num_ok - local) * self.block_size
                self._remember_remote(remote[: num_ok - local])
            if len(oks) > num_ok >= local and remote:
                self.counters["remote_load_failed_blocks"] += len(oks) - num_ok
                bad = remote[num_ok - local]  # the blocks after it failed with it
                self._remote_known.pop(bad, None)
                self._remote_failed[bad] = time.monotonic() + REMOTE_FAILED_TTL_S
                self._remote_failed.move_to_end(bad)
                while len(self._remote_failed) > REMOTE_FAILED_MAX:
                    self._remote_failed.popitem(last=False)
            self.counters["hit_tokens"] += num_ok * self.block_size
            self.counters["load_failed_blocks"] += len(oks) - num_ok
            st = self._reqs.get(req_id)
            if st is not None:
                st.loading = False

    def _complete_lanes_load(self, plan_id: int, oks: list[bool]) -> None:
        """A hybrid model's load: its token blocks are hits only if every group's
        blocks loaded (vLLM recomputes a request whose load failed in full)."""
        req_id, plan, _ = self._load_plans.pop(plan_id)
        n, total = self._hybrid_loads.pop(plan_id)
        assert plan is not None
        self.manager.complete_load(plan, oks)
        if len(oks) == total and all(oks):
            for tier in plan.tiers[:n]:  # the primary group's blocks come first
                self.counters[f"hit_tokens_{tier}"] += self.block_size
            self.counters["hit_tokens"] += n * self.block_size
        else:
            self.counters["load_failed_requests"] += 1
        self.counters["load_failed_blocks"] += total - sum(oks)
        st = self._reqs.get(req_id)
        if st is not None:
            st.loading = False

    def _remote_stored(self, keys: list[BlockKey], meta: list[Any], oks: list[bool]) -> None:
        """Every worker reported a remote write: count it, remember the keys written
        (not written again) and, with KV events on, publish them (medium STORAGE,
        locality REMOTE). A failed write makes this engine forget what it knew of
        the store (it may have restarted empty)."""
        good = [k for k, ok in zip(keys, oks) if ok]
        self.counters["stored_blocks_remote"] += len(good)
        self.counters["store_failed_blocks_remote"] += len(keys) - len(good)
        if len(good) < len(keys):
            self._remote_known.clear()
        self._remember_remote(good)
        for key in good:  # a fresh, complete value: offer it again
            self._remote_failed.pop(key, None)
        if self.kv_events:
            stored = [("stored", "remote", *m) for m, ok in zip(meta, oks) if ok and m is not None]
            self._kv_events += _parents_first(stored)

    def _remember_remote(self, keys: Iterable[BlockKey]) -> None:
        known = self._remote_known
        for key in keys:
            known[key] = None
            known.move_to_end(key)
        while len(known) > REMOTE_KNOWN_MAX:
            known.popitem(last=False)

    def load_finished(self, req_ids: Iterable[str]) -> None:
        """The engine reports these requests' asynchronous loads as done."""
        for req_id in req_ids:
            st = self._reqs.get(req_id)
            if st is not None:
                st.loading = False

    def _pump_events(self) -> None:
        stored: list[tuple[Any, ...]] = []
        for event in self.manager.take_events():
            if isinstance(event, BlockRemoved) and event.tier == "ssd":
                self._ssd_deletes.append(int(event.key))
                self._lossy.forget_value(event.key, "ssd")  # gone: a later computation of it may be stored
                self._lossy.forget_copy(event.key)
                self.counters["ssd_deleted_blocks"] += 1
            if self.kv_events and isinstance(event, (BlockStored, BlockRemoved)):
                self._kv_event(event, stored)
            elif self.kv_events and isinstance(event, StoreFailed):
                self._forget_if_gone(event.key)
        if stored:
            self._kv_events += _parents_first(stored)

    def _note_event_meta(self, st: _Req, keys: list[BlockKey], start: int, upto: int) -> None:
        """Remember what a KV event of blocks ``start:upto`` of ``st`` says (no prompt
        text leaves the engine: vLLM's own events carry these token ids too)."""
        hashes, tokens, bs = st.request.block_hashes, st.request.all_token_ids, self.block_size
        for i in range(start, upto):
            if keys[i] not in self._event_meta:
                self._event_meta[keys[i]] = (hashes[i], hashes[i - 1] if i else None,
                                             list(tokens[i * bs : (i + 1) * bs]))

    def _kv_event(self, event: BlockStored | BlockRemoved, stored: list[tuple[Any, ...]]) -> None:
        """One manager event of the DRAM or SSD tier as a KV cache event for vLLM:
        ``("stored", tier, hash, parent hash, token ids)`` (into ``stored``, ordered
        parents first by the caller) or ``("removed", tier, hash)``. Blocks without
        a vLLM hash (re-indexed from an earlier run's SSD) have none."""
        meta = self._event_meta.get(event.key)
        if meta is None or event.tier not in ("dram", "ssd"):
            return
        if isinstance(event, BlockStored):
            stored.append(("stored", event.tier, *meta))
            return
        self._kv_events.append(("removed", event.tier, meta[0]))
        self._forget_if_gone(event.key)

    def _forget_if_gone(self, key: BlockKey) -> None:
        """Drop a block's event metadata once no tier holds it or is storing it."""
        m = self.manager
        if not m.tiers_of(key) and not any(m.is_pending(key, t) for t in m.tier_names):
            self._event_meta.pop(key, None)

    def take_kv_events(self) -> list[tuple[Any, ...]]:
        """KV cache events since the last call (see :meth:`_kv_event`); empty unless ``kv_events``."""
        self._pump_events()
        events, self._kv_events = self._kv_events, []
        return events

    def _reindex_ssd(self) -> None:
        """Warm restart: index the blocks rank 0 already holds on SSD, with the
        same re-index as ``TieredStore`` (:func:`kvtier.store.reindex_ssd`)."""
        cfg = self.settings.config
        path = self.settings.rank_ssd_path(0, self.namespace.tp_size)
        assert path is not None
        tier = ssdshare.acquire(path, self.namespace, cfg.layout.to_layout(), cfg)
        try:
            count, purged = reindex_ssd(tier, self.manager)
            self._lossy.wrote("ssd", (e.key for e in tier.scan() if e.codec in LOSSY_CODECS))
        finally:
            ssdshare.release(tier)
        self.manager.take_events()
        self.counters["ssd_reindexed_blocks"] = count
        self.counters["ssd_purged_unreadable_values"] = purged


def _parents_first(stored: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """``("stored", tier, hash, parent, ...)`` events reordered so that a block comes
    after its parent when both are in the list (the manager reports a chain tail
    first; a router indexing by parent needs the parent first). O(n)."""
    present = {(e[1], e[2]) for e in stored}
    children: dict[tuple[str, Any], list[tuple[Any, ...]]] = {}
    roots = []
    for e in stored:
        if (e[1], e[3]) in present:
            children.setdefault((e[1], e[3]), []).append(e)
        else:
            roots.append(e)
    out, todo = [], roots[::-1]
    while todo:
        e = todo.pop()
        out.append(e)
        todo.extend(children.pop((e[1], e[2]), [])[::-1])
    return out + [e for kids in children.values() for e in kids]  # a cycle cannot happen; kept, not lost

