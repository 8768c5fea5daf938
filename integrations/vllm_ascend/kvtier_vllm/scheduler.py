"""Scheduler side of the kvtier connector: which blocks kvtier holds, and the
load and store plans of each step.

Owns: a :class:`~kvtier.manager.TierManager` over the DRAM and SSD tiers
(metadata only; the bytes live in the workers), the mapping from vLLM block
hashes to kvtier keys, per-request bookkeeping (keys, blocks already planned
for storing, store jobs whose engine blocks are still being read), the
lookups answered and the load and store plans in flight until every worker
reported them, the session / agent ids a request carries in
``kv_transfer_params``, the placement policy (a :mod:`kvtier.placement`
object, the one the replay runs) with its live context
(:class:`~.placement.EnginePlacement`: HBM holds through vLLM's block pool,
SSD -> DRAM prefetch), and the counters behind :meth:`KVTierScheduler.stats`.
One part per further job, each owned here and told what it needs:
:class:`~.kv_events.TierEvents` (the manager's events: SSD deletions, KV cache
events), :class:`~.lanes.HybridLanes` (KV cache groups' keys, hits and
loads), :class:`~.write_backs.WriteBacks` (exclusive DRAM's watched blocks),
:class:`~.load_plans.LoadPlans` (the load plans in flight, and the keys each brings into a
request's own blocks: a lookup behind one is deferred, not loaded twice),
:class:`~.remote_index.RemoteIndex` (a remote tier: lookups on a thread,
what the store holds, remote writes), :class:`~.approximate.SegmentMasters`
(approximate reuse), :class:`~.rounds.SharedRounds` (shared rounds' holds)
and :class:`~.hint_intake.HintIntake` (agent waits, the hint readers).

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
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.errors import ConfigError
from kvtier.keys import BlockKey, Namespace, chain_foreign_keys
from kvtier.manager import LoadPlan, StorePlan, TierManager, TierSpec
from kvtier.placement import make_placement
from kvtier.placement.surface import surface
from kvtier.sdk.handles import is_approximate_salt
from kvtier.sdk.kv_hints import merged_params
from kvtier.sdk.params import (
    DEFAULT_TENANT,
    request_approximate_segments,
    request_criticality,
    request_max_load_tokens,
    request_tags,
    request_tenant,
    request_tool_wait_s,
    tenant_session,
)
from kvtier.store import reindex_ssd
from kvtier.tiers.codec import LOSSY_CODECS
from kvtier.tiers.lossy import LossyCopies

from . import ssdshare
from .approximate import SegmentMasters
from .hint_intake import HintIntake
from .kv_events import TierEvents
from .lanes import HybridLanes
from .load_plans import LoadPlans
from .metadata import KVTierConnectorMetadata, KVTierWorkerMetadata, LoadJob, PromoteJob
from .placement import EnginePlacement
from .remote_index import RemoteIndex
from .rounds import SharedRounds
from .settings import ConnectorSettings
from .store_plans import StorePlanner
from .write_backs import WriteBacks

log = logging.getLogger(__name__)

EXCLUSIVE_SURFACE = "vllm"
"""The replay's surface for the connector with ``exclusive_dram``, the recommended setup
(kvtier.placement.surface.LIVE); without it the connector is ``vllm-write-through``."""


STATS_EVERY_S = 0.25
"""How often the stats file is rewritten at most while requests run (see :class:`_StatsFile`)."""

# the workers' counts (summed over ranks) -> the scheduler's counters
WORKER_COUNTS = (("skipped_blocks", "store_skipped_backpressure"),
                 ("remote_skipped_blocks", "store_skipped_backpressure_remote"),
                 ("write_backs_missed", "write_back_missed"), ("staging_skipped_stores", "store_skipped_staging"),
                 ("staging_skipped_loads", "load_skipped_staging"))


class _StatsFile:
    """The scheduler's stats file (``stats_path``): rewritten atomically when the counters changed, at
    most every ``STATS_EVERY_S`` while requests run, and at once when none runs (or ``force``), so that
    a reader waiting for the engine to idle reads its last state. A rewrite costs the engine's thread
    about 0.25 ms (JSON, a temporary file and a rename), a tenth of a small model's step: written each
    step, it was part of what a returning request paid in kvtier (bench/agents_e2e.py --model tiny)."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self.dirty = True
        self._lock = threading.Lock()
        self._written = float("-inf")

    def write(self, stats: Callable[[], dict[str, Any]], busy: bool) -> None:
        """Rewrite the file from ``stats()`` if it changed (and, while ``busy``, not too soon)."""
        now = time.monotonic()
        if not self.path or not self.dirty or (busy and now - self._written < STATS_EVERY_S):
            return
        with self._lock:
            self.dirty, self._written = False, now
            text = json.dumps(stats(), sort_keys=True)
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(self.path)), prefix=".kvtier-stats-")
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(tmp, self.path)


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
    # its asynchronous load landed nothing: vLLM freed its blocks and asks again, and the request is computed, not
    # offered a second asynchronous load. vLLM 0.32 keeps such a request among its in-flight prefills, so a second
    # one would reserve the request's whole size on top of its own allocation: a long prompt never fits, and vLLM's
    # waiting loop stops at it with nothing else scheduled (bench/chaos_serve.py's stalled loads: 120 s, once)
    load_failed: bool = False
    # approximate reuse: (block index, master key) of each block inside a declared shared segment; None = exact
    approx: list[tuple[int, int]] | None = None
    approx_loaded: set[int] = field(default_factory=set)  # block indices loaded from another request's copy
    lane_keys: dict[int, list[BlockKey]] = field(default_factory=dict)  # hybrid: other KV cache groups' keys
    params: Any = None  # its kv_transfer_params, with what its vLLM kv_hints envelope adds (kvtier.sdk.kv_hints)
    kv_hints: Any = None  # kvtier.sdk.kv_hints.KvHints read from that envelope, or None
    tenant: str = DEFAULT_TENANT  # whose session it is (HintIntake.tenant): two tenants' sessions of one id differ

    @property
    def agent(self) -> tuple[str, str] | None:
        """(session, agent id), when the request carries both; the session is its tenant's
        (:func:`~kvtier.sdk.params.tenant_session`: the bare id for the default tenant)."""
        if self.session_id is None or self.agent_id is None:
            return None
        return tenant_session(self.tenant, self.session_id), self.agent_id


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
    sync: bool = False  # loaded before this step's forward (sync_dram_loads)


def _recompute_instead(policy: Any, ctx: Any, hit: Any, counters: Counter[str], block_size: int) -> bool:
    """``recompute_when_cheaper``: the placement's ``should_load`` finds recomputing ``hit`` (its DRAM and
    SSD blocks) faster than loading it on the live context ``ctx``; counted."""
    if policy.should_load(ctx, {t: hit.count(t) for t in ("dram", "ssd")}, 0):
        return False
    counters["load_skipped_cheaper"] += 1
    counters["load_skipped_cheaper_tokens"] += hit.num_blocks * block_size
    return True


class KVTierScheduler:
    """The scheduler-side half. One instance per engine (scheduler process).

    ``world_size`` is how many workers report each plan; a block becomes
    readable only when all of them reported it stored.
    """

    def __init__(self, settings: ConnectorSettings, namespace: Namespace, block_size: int, world_size: int,
                 kv_events: bool = False, window_blocks: Sequence[int] = (0,)) -> None:
        cfg = settings.config
        self.settings, self.namespace, self.block_size, self.world_size = settings, namespace, block_size, world_size
        self.policy = make_placement(settings.placement, "kv_connector_extra_config.placement",
                                     settings.placement_params)
        specs = []
        for t in cfg.enabled_tiers:  # the placement's own order (e.g. kvtier's next use) unless one is set
            order = self.policy.eviction_for(t, lambda: self.placement.now)  # (read once placement exists)
            specs.append(TierSpec(t, getattr(cfg, t).capacity_blocks,
                                  getattr(cfg, t).policy if settings.eviction_set or order == "lru" else order))
        # removals are always read (TierEvents: SSD deletes); per-block stored events only for a KV-event feed
        self.manager = TierManager(specs, pin_budget_blocks=cfg.pin_budget_blocks, record_block_events=kv_events)
        self.kv_events = kv_events  # KV cache events of kvtier's tiers for vLLM's publisher (take_kv_events)
        self.counters: Counter[str] = Counter()
        # Lossy values (a lossy tier codec, or cold blocks under cold_codec) and the keys loaded from one, which
        # are never stored again, in any tier (kvtier.tiers.lossy: the rule TieredStore keeps too).
        codecs = {"ssd": cfg.ssd.codec, "remote": settings.remote.codec if settings.remote is not None else "raw"}
        self._lossy = LossyCopies(tier for tier, codec in codecs.items() if codec in LOSSY_CODECS)
        self.events = TierEvents(self.manager, self._lossy, self.counters, block_size, kv_events)
        # KV cache groups (vLLM's hybrid KV cache manager), each a lane of keys of its own
        self.lanes = HybridLanes(window_blocks, namespace, self.manager, self.counters, self._lossy, block_size,
                                 self._keys)
        self.hybrid, self.primary = self.lanes.hybrid, self.lanes.primary
        self._reqs: dict[str, _Req] = {}
        self._matches: dict[str, _Match] = {}
        self._loads: list[LoadJob] = []
        self._load_plans = LoadPlans()  # (and which request's load brings each key into vLLM's blocks)
        self._store_plans: dict[int, StorePlan] = {}
        self._stale_plans: set[int] = set()  # store plans whose bytes went stale (a connector reset) in flight
        self._expired: set[int] = set()  # load plans a worker reported past load_deadline_s, until they complete
        self._job_to_req: dict[int, str] = {}
        self._reports: dict[int, tuple[int, list[bool]]] = {}
        self._gather_reports: Counter[int] = Counter()
        self._release: list[str] = []
        self._job_ids = itertools.count(1)
        self.placement = EnginePlacement(self.manager, block_size, cfg.layout.to_layout().bytes_per_block,
                                         self.counters, hold_budget_fraction=settings.hbm_hold_budget_fraction,
                                         holds_enabled=settings.hbm_hold,
                                         hold_tenant_fraction=settings.hold_tenant_fraction,
                                         tracked_agents_per_tenant=settings.tracked_agents_per_tenant)
        self.placement.hold_groups = self.lanes.hold_groups
        self._promote_plans: dict[int, Any] = {}
        # Exclusive DRAM (one KV cache group): computed blocks are not written through to DRAM but watched in
        # HBM, and planned into DRAM when vLLM hands their slot to another request (see WriteBacks)
        self.exclusive = settings.exclusive_dram and "dram" in self.manager.tier_names and not self.hybrid
        self.write_backs = WriteBacks(self.manager, self.counters, self._lossy, self.events, self._store_plans,
                                      self._job_ids)
        if self.exclusive:  # what the replay models this setup as; HBM in the policy's next-use order
            self.placement.surface = surface(EXCLUSIVE_SURFACE)
            self.placement.next_use = self.policy.next_use_rank
        self.rounds = SharedRounds(self.manager, self.placement, self.counters, block_size, settings.hbm_hold,
                                   self._keys, self.events.pump)
        self.hints = HintIntake(settings, self.placement, self.policy, self.counters, block_size, self._reqs,
                                self._keys, self.events.pump, self.rounds, self._counted)
        self.hint_address = self.hints.address
        self._kv_cache_manager: Any = None
        self._gpu_block_pool: Any = None
        self._stats = _StatsFile(settings.stats_path)
        self.recorder: Any = None
        if settings.record_path:
            from kvtier.recording.requests import RequestRecorder

            self.recorder = RequestRecorder(settings.record_path, block_size, namespace.model.split("|")[0],
                                          max_bytes=settings.record_max_bytes)
            log.info("kvtier: recording served requests as AgentX traces in %s", settings.record_path)
        if "ssd" in self.manager.tier_names:
            self._reindex_ssd()
        self.remote = RemoteIndex(settings, namespace, self.counters, block_size, self._lossy, self.events) \
            if settings.remote is not None else None
        self.stores = StorePlanner(settings, self.manager, self.counters, self._lossy, self.events, self.lanes,
                                   self.write_backs, self.remote, self.exclusive, self._keys, self._store_plans,
                                   self._job_to_req, self._job_ids)
        # approximate reuse: its requests' keys come from a namespace of their own (exact ones never meet them)
        self._approx = SegmentMasters(namespace, block_size, self.counters, self.manager.contains) \
            if settings.approximate_rope is not None else None

    # ------------------------------------------------------------ engine hooks

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        """Keep the engine's KV cache manager: the source of a request's block ids."""
        self._kv_cache_manager = kv_cache_manager
        self.stores.kv_cache_manager = kv_cache_manager

    def bind_gpu_block_pool(self, block_pool: Any) -> None:
        """Keep the engine's block pool: HBM holds (public ``touch`` / ``free_blocks``), free-block stats and,
        with exclusive DRAM, watched blocks (``unpin_blocks``; ``blocks``, the pool's list of blocks by id)."""
        if self.exclusive and not callable(getattr(block_pool, "unpin_blocks", None)):
            raise ConfigError("kv_connector_extra_config.exclusive_dram", True,
                              "this vLLM's BlockPool has no unpin_blocks(blocks, on_reuse) (vLLM 0.32 has; "
                              "exclusive_dram is on by default where it is built): set exclusive_dram: false")
        self._gpu_block_pool = block_pool
        self.write_backs.pool = block_pool
        self.placement.bind_block_pool(block_pool)

    def on_new_request(self, request: Any) -> None:
        """Record a new request, the session / agent ids and hints of its
        ``kv_transfer_params``; a request of a waiting agent ends its wait."""
        st = self._state(request)
        self.counters["requests"] += 1
        agent = st.agent
        if agent is not None:
            self.placement.note_agent(agent, request_tenant(st.params), request_criticality(st.params))
        if self.recorder is not None:
            prompt = int(request.num_prompt_tokens)
            self.recorder.arrived(request.request_id, agent[0] if agent else st.session_id, st.agent_id, prompt,
                                  self._keys(st)[: prompt // self.block_size])
        need = -(-int(request.num_tokens) // self.block_size)
        if self.placement.arrived(request.request_id, agent, need) and agent is not None:
            self.policy.on_wait_end(self.placement, agent, self._keys(st))
            self.placement.wait_ended(agent)

    # ------------------------------------------------------------ lookups

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens past ``num_computed_tokens`` (block aligned) that kvtier can load,
        and whether the load is asynchronous (always, but a DRAM hit under ``sync_dram_loads``).
        Reads the in-memory index only. The last prompt token is never offered: the
        engine must compute at least one token to sample (nor a hit ``_recompute_instead`` skips)."""
        self.placement.settle_order()  # (before this pass allocates: the waits that started last step)
        self._drop_match(request.request_id)  # asked again (its allocation failed, or it was deferred)
        st = self._state(request)
        keys = self._keys(st)
        max_blocks = min(len(keys), (request.num_tokens - 1) // self.block_size)
        start = num_computed_tokens // self.block_size
        self.counters["lookups"] += 1
        cap = request_max_load_tokens(st.params)  # a router's per-request load-or-recompute (vLLM's key)
        if cap is not None and start + cap // self.block_size < max_blocks:
            max_blocks = start + cap // self.block_size
            self.counters["load_capped_by_request"] += 1
        self.counters["load_failed_then_computed"] += st.load_failed
        if max_blocks <= start or st.load_failed:
            return 0, False
        if self.hybrid:
            n = self.lanes.hit(st, start, max_blocks)
            if not n:
                return 0, False
            self._matches[request.request_id] = _Match(start, n)
            return n * self.block_size, True
        if self._load_plans.loader(keys[start]) not in (None, request.request_id):  # another request's load
            self.counters["load_deferred_shared"] += 1  # brings this prefix into HBM: vLLM's prefix cache has
            return None, False  # type: ignore[return-value]  # it next step (loaded once, not once per request)
        shifts: list[int] = []
        if st.approx and self._approx is not None:
            keys, shifts = self._approx.keys_to_load(st.approx, keys)
        hit = self.manager.lookup(keys[start:max_blocks])
        if self.exclusive and self.write_backs.pool is not None and start + hit.num_blocks < max_blocks and \
                self.manager.is_pending(keys[start + hit.num_blocks], "dram") and \
                self._load_plans.wait_on(request.request_id, self.settings.load_deadline_s):
            # its prefix goes on in a block on its way into DRAM (written back this step, or promoted):
            # vLLM asks again next step instead of computing what lands in a moment (load_deadline_s at most)
            self.counters["load_deferred"] += 1
            return None, False  # type: ignore[return-value]
        remote = 0
        if self.remote is not None and self.remote.open and start + hit.num_blocks < max_blocks:
            got = self.remote.hit(request.request_id, keys, start + hit.num_blocks, max_blocks)
            if got is None:
                return None, False  # the store has not answered yet: vLLM asks again next step
            remote = got
        if hit.num_blocks + remote == 0:
            return 0, False
        sync = self.settings.sync_dram_loads and not (remote or shifts) and hit.count("dram") == hit.num_blocks
        if self.settings.recompute_when_cheaper and not (sync or remote or shifts) and \
                _recompute_instead(self.policy, self.placement, hit, self.counters, self.block_size):
            return 0, False
        end = start + hit.num_blocks + remote
        held = tuple(keys[start:start + hit.num_blocks])
        self.manager.acquire(held)
        self._matches[request.request_id] = _Match(start, hit.num_blocks, remote, tuple(keys[start:end]),
                                                   tuple(shifts[start:end]) if any(shifts[start:end]) else (), held,
                                                   sync)
        if sync:
            self.counters["load_sync"] += 1
        return (hit.num_blocks + remote) * self.block_size, not sync

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
        n = num_external_tokens // self.block_size
        if self.hybrid:
            assert group_block_ids is not None
            job, lanes_plan = self.lanes.load_job(st, match.start_block, n, group_block_ids)
            if lanes_plan is not None:
                self._load_plans.add(lanes_plan.plan_id, request.request_id, lanes_plan, ())
                self._note_lossy_loads(job)
            self._load_planned(st, job, n)
            return
        keys = list(match.keys[:n]) if match.keys else self._keys(st)[match.start_block : match.start_block + n]
        targets = tuple(block_ids[match.start_block : match.start_block + n])
        local = min(n, match.num_blocks)
        plan = self.manager.prepare_load(keys[:local]) if local else None
        got = len(plan.keys) if plan is not None else 0
        self.counters["load_short_blocks"] += local - got  # (none: the match was held until now)
        remote = tuple(keys[local:]) if got == local else ()  # the remote run must follow the local one
        if got + len(remote) == 0:  # cannot happen within one step; the worker fails every block
            job = LoadJob(request.request_id, 0, (), (), (), targets, sync=match.sync)
        else:
            tiers = (plan.tiers if plan is not None else ()) + ("remote",) * len(remote)
            slots = tuple(s if t != "ssd" else 0 for s, t in zip(plan.slots, plan.tiers)) if plan is not None else ()
            plan_id = plan.plan_id if plan is not None else self._remote_index().next_id()
            shifts = ()
            if match.shifts:  # the local run (possibly cut short by prepare_load), then the remote one
                shifts = tuple(match.shifts[:got]) + (tuple(match.shifts[local:local + len(remote)]) if remote else ())
                self.counters["approximate_loaded_blocks"] += sum(1 for x in shifts if x)
                rows = list(range(got)) + list(range(local, local + len(remote)))
                st.approx_loaded.update(match.start_block + r for r, x in zip(rows, shifts) if x)
            job = LoadJob(request.request_id, plan_id, (plan.keys if plan is not None else ()) + remote, tiers,
                          slots + (0,) * len(remote), targets, shifts, match.sync)
            self._load_plans.add(plan_id, request.request_id, plan, remote,  # a load of the request's own keys:
                                 () if match.sync or st.approx else job.keys)  # its blocks are cached when it lands
            if self.exclusive and self.write_backs.pool is not None and plan is not None and st.approx is None:
                self.write_backs.load_starts[plan_id] = match.start_block
            self._note_lossy_loads(job)
            if job.shifts:  # a block rotated from a lossy value is lossy under the request's own key too
                self._lossy.derive(self._keys(st)[match.start_block:match.start_block + len(job.keys)], job.keys)
        self._load_planned(st, job, n)

    def _load_planned(self, st: _Req, job: LoadJob, n: int) -> None:
        """``job`` (a load of ``n`` token blocks) goes out with this step's metadata."""
        st.loading = True
        self._loads.append(job)
        self.counters["load_planned_tokens"] += n * self.block_size

    def _remote_index(self) -> RemoteIndex:
        """The remote tier's index (a remote run is only ever matched with one)."""
        assert self.remote is not None
        return self.remote

    def _note_lossy_loads(self, job: LoadJob) -> None:
        """Remember the keys this load reads from a lossy value (never stored again)."""
        self.counters["load_lossy_blocks"] += self._lossy.decoded(job.keys, job.tiers)

    # ------------------------------------------------------------ per step

    def build_connector_meta(self, scheduler_output: Any) -> KVTierConnectorMetadata:
        """This step's loads, stores (blocks full after its forward), releases and SSD deletions; resets the step."""
        self.hints.poll()
        if self.settings.recompute_when_cheaper:
            self.placement.step_started(scheduler_output.num_scheduled_tokens)  # the step cost it weighs loads by
        self.placement.scheduled(scheduler_output.num_scheduled_tokens)  # allocated by now: holds may go
        self.placement.tick()
        self.placement.settle_order()
        if self.remote is not None:
            self.remote.step_started()  # (the next step's lookups may wait for the store again)
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
            job = self.stores.plan(req_id, st, upto)
            if job is not None:
                meta.stores.append(job)
        if self.write_backs.pending:
            job = self.write_backs.job(scheduler_output)
            if job is not None:
                meta.write_backs.append(job)
        meta.ssd_deletes = self.events.take_ssd_deletes()
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
        for name, counter in WORKER_COUNTS:  # (counted once non-zero, as before)
            if getattr(worker_meta, name):
                self.counters[counter] += getattr(worker_meta, name)
        for outcome, n in worker_meta.remote_outcomes.items():  # the workers' store clients: why reads missed
            self.counters[outcome if outcome.startswith("remote_") else f"remote_{outcome}"] += n
        for job_id, n in worker_meta.gathered.items():
            self._gather_reports[job_id] += n
            if self._gather_reports[job_id] >= self.world_size:
                del self._gather_reports[job_id]
                req_id = self._job_to_req.pop(job_id, None)
                st = self._reqs.get(req_id) if req_id is not None else None
                if st is not None:
                    st.pending_jobs.discard(job_id)
        self._expired.update(worker_meta.expired_plans)  # (before their plans complete, below)
        for plan_id, (n, oks) in worker_meta.plans.items():
            seen, acc = self._reports.get(plan_id, (0, [True] * len(oks)))
            acc = [a and b for a, b in zip(acc, oks)]
            if seen + n < self.world_size:
                self._reports[plan_id] = (seen + n, acc)
                continue
            self._reports.pop(plan_id, None)
            self._complete(plan_id, acc)
        self.events.pump()
        self._stats.dirty = True
        self.write_stats()

    def request_finished(self, request: Any) -> bool:
        """Forget ``request``; True (keep its blocks) while a worker still reads
        them for a store, or writes them for a load."""
        st = self._reqs.pop(request.request_id, None)
        self._drop_match(request.request_id)
        if self.remote is not None:
            self.remote.forget_lookup(request.request_id)
        self.placement.finished(request.request_id)
        wait_s = request_tool_wait_s(st.params if st is not None else getattr(request, "kv_transfer_params", None))
        if self.recorder is not None:  # with the full blocks the answer filled that vLLM computed and cached
            bs = self.block_size  # (vLLM hashes a block the last sampled token fills, but never computes it)
            answer = self._keys(st)[int(request.num_prompt_tokens) // bs:int(request.num_computed_tokens) // bs] \
                if st is not None else None
            self.recorder.finished(request.request_id, int(request.num_output_tokens), wait_s is not None,
                                   answer_keys=answer)
        if st is not None:
            self.hints.request_done(st, wait_s)
            if st.approx and self._approx is not None:
                self._approx.register(st.approx, st.keys, st.approx_loaded)
            if self.hints.following:  # rounds are announced by a hint server (hosted, or followed)
                self.rounds.served(st)
        self._stats.dirty = True
        self.write_stats()  # at once when it was the last live request: the engine may idle now
        if st is None or not (st.pending_jobs or st.loading):
            return False
        self.counters["delayed_frees"] += 1
        if st.pending_jobs:
            self._release.append(request.request_id)  # freed when the workers report it sent
        # a request with a load in flight is freed by the engine when the load reports finished
        return True

    def shutdown(self) -> None:
        """Give back every HBM hold; stop the hosted hint server or the watcher, if any; write the recording."""
        self.placement.release_all()
        if self.recorder is not None:
            self.recorder.close()
            self.counters.update(self.recorder.counters)
            self._stats.dirty = True
        self.write_stats(force=True)
        self.hints.close()
        if self.remote is not None and self.remote.open:
            self.remote.close()

    def has_pending_work(self) -> bool:
        """Whether plans are still out (so the engine keeps stepping to collect them)."""
        return bool(self._store_plans or self._load_plans or self._release or self._job_to_req
                    or self._promote_plans or (self.remote is not None and self.remote.writes))

    def reset(self) -> bool:
        """Drop every stored block (vLLM's ``reset_prefix_cache(reset_connector=True)``: after a weight update and on
        sleep); the workers delete SSD values next step. False when a block could not be dropped (a load or store in
        flight). With ``keep_tiers_on_reset`` (the weights never change) only what refers to vLLM's HBM goes."""
        self.rounds.release_all()  # round pins would keep stale blocks in the tiers
        self.placement.release_all()  # stale KV must go, waiting agents or not
        for req_id in list(self._matches):  # a held lookup (its allocation failed) would keep stale blocks
            self._drop_match(req_id)
        self.write_backs.reset()
        self.counters["resets"] += 1
        if self.settings.keep_tiers_on_reset:
            self.counters["resets_kept_tiers"] += 1
            return True
        if self._approx is not None:
            self._approx.clear()
        if self.remote is not None:
            self.remote.known.clear()  # the shared store is other engines' too: this engine only forgets it
        self._stale_plans.update(self._store_plans)  # in flight: they land, but nobody reads them
        for tier in self.manager.tier_names:
            self.manager.evict(tier, self.manager.capacity_blocks(tier))
        self.events.pump()
        return all(self.manager.ready_blocks(t) == 0 for t in self.manager.tier_names)

    # ------------------------------------------------------------ stats

    def stats(self) -> dict[str, Any]:
        """Counters (tokens and blocks), tier use and, when bound, free HBM blocks."""
        m = self.manager
        out: dict[str, Any] = {"counters": dict(self.counters), "placement": self.policy.name,
                               "placement_params": dict(self.settings.placement_params),
                               "pending_plans": len(self._store_plans) + len(self._load_plans)
                               + len(self._promote_plans) + (len(self.remote.writes) if self.remote else 0)}
        out["tiers"] = {t: {"capacity_blocks": m.capacity_blocks(t), "ready_blocks": m.ready_blocks(t)}
                        for t in m.tier_names}
        if self._gpu_block_pool is not None:
            out["hbm_free_blocks"] = int(self._gpu_block_pool.get_num_free_blocks())
        holds = self.placement.holds
        if holds is not None:
            out["hbm_hold"] = {"budget_blocks": holds.budget_blocks, "held_blocks": holds.held_blocks,
                               "peak_blocks": holds.peak_blocks}
        out["live_sessions"] = len({st.session_id for st in self._reqs.values() if st.session_id})
        out["live_requests"] = len(self._reqs)
        out["tracked_agents"] = self.placement.num_tracked_agents
        out["pinned_blocks"] = m.num_pinned()
        if self.recorder is not None:
            out["record"] = dict(self.recorder.counters)
        if self.remote is not None and self.remote.open:
            out["remote"] = self.remote.stats()
        w = self.hints.watcher
        if w is not None:  # a followed hint server: views received, reconnects, why the stream last broke
            out["hint_watch"] = {"views": w.views, "reconnects": w.reconnects, "last_error": w.last_error}
        return out

    def _counted(self) -> None:
        """Counters changed outside a worker report: the stats file is rewritten next time."""
        self._stats.dirty = True

    def write_stats(self, force: bool = False) -> None:
        """Rewrite ``stats_path`` when counters changed: at once with ``force`` or no request
        live, else at most every ``STATS_EVERY_S`` (:class:`_StatsFile`)."""
        self._stats.write(self.stats, busy=bool(self._reqs) and not force)

    # ------------------------------------------------------------ internals

    def _state(self, request: Any) -> _Req:
        st = self._reqs.get(request.request_id)
        if st is None:
            params = getattr(request, "kv_transfer_params", None)
            self.hints.check_params(request.request_id, params)
            kv_hints = self.hints.read_kv_hints(request, params)
            params = merged_params(params, kv_hints)
            st = self._reqs[request.request_id] = _Req(request, *request_tags(params), params=params,
                                                       kv_hints=kv_hints, tenant=self.hints.tenant(params))
            spans = request_approximate_segments(params)
            if spans is not None or is_approximate_salt(getattr(request, "cache_salt", None)):
                st.approx = self._segment_blocks(request, spans or [])
            self.hints.arrived(st)  # vLLM's own session id names it where kvtier's tags do not; prefix breaks
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

    def _move_up(self, req_id: str, plan: LoadPlan, start: int, num_ok: int) -> None:
        """Exclusive DRAM: the first ``num_ok`` blocks of a load now live in the request's
        HBM blocks from ``start`` on (:meth:`.write_backs.WriteBacks.moved_up`)."""
        st = self._reqs.get(req_id)
        if st is None or num_ok <= 0 or self._kv_cache_manager is None:
            return
        self.write_backs.moved_up(self._kv_cache_manager.get_block_ids(req_id)[0][start:start + num_ok], plan,
                                  num_ok, st.keys[start - 1] if start else None)

    def _complete(self, plan_id: int, oks: list[bool]) -> None:
        if plan_id in self._stale_plans:  # written from blocks of before a connector reset
            self._stale_plans.discard(plan_id)
            oks = [False] * len(oks)
        if plan_id in self._expired:  # a load past load_deadline_s (on any rank): failed, counted once per plan;
            self._expired.discard(plan_id)  # its blocks are dropped as after a failed check, or the request's
            self.counters["load_expired_blocks"] += len(oks)  # retry would plan the same load and wait again
        if plan_id in self._store_plans:
            plan = self._store_plans.pop(plan_id)
            self.manager.complete_store(plan, oks)
            good = sum(oks)
            self.counters[f"stored_blocks_{plan.tier}"] += good
            self.counters[f"store_failed_blocks_{plan.tier}"] += len(oks) - good
        elif self.remote is not None and plan_id in self.remote.writes:
            self.remote.complete_write(plan_id, oks)
        elif plan_id in self._promote_plans:
            self.placement.promotion_done(self._promote_plans.pop(plan_id), oks, None)
        elif plan_id in self.lanes.loads:
            req_id, lanes_plan, _ = self._load_plans.pop(plan_id)
            assert lanes_plan is not None
            self.lanes.complete_load(plan_id, lanes_plan, oks)
            self.load_finished((req_id,))
        elif plan_id in self._load_plans:
            req_id, load, remote = self._load_plans.pop(plan_id)
            local = len(load.keys) if load is not None else 0
            if load is not None:
                self.manager.complete_load(load, oks[:local])
            num_ok = oks.index(False) if False in oks else len(oks)
            start = self.write_backs.load_starts.pop(plan_id, None)
            if start is not None and load is not None:
                self._move_up(req_id, load, start, min(num_ok, local))
            for tier in (load.tiers if load is not None else ())[:num_ok]:
                self.counters[f"hit_tokens_{tier}"] += self.block_size
            if remote:  # (a remote run is only ever planned with a remote tier)
                self._remote_index().loaded(remote, num_ok - local, len(oks) - num_ok)
            self.counters["hit_tokens"] += num_ok * self.block_size
            self.counters["load_failed_blocks"] += len(oks) - num_ok
            self.load_finished((req_id,), failed=num_ok == 0)

    def load_finished(self, req_ids: Iterable[str], failed: bool = False) -> None:
        """The engine reports these requests' asynchronous loads as done (``failed``: landed nothing)."""
        for req_id in req_ids:
            st = self._reqs.get(req_id)
            if st is not None:
                st.loading, st.load_failed = False, st.load_failed or failed

    def take_kv_events(self) -> list[tuple[Any, ...]]:
        """KV cache events since the last call (:meth:`.kv_events.TierEvents.take`); empty unless ``kv_events``."""
        return self.events.take()

    def _reindex_ssd(self) -> None:
        """Warm restart: index rank 0's blocks on SSD as ``TieredStore`` does (:func:`kvtier.store.reindex_ssd`)."""
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
