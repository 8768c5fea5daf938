"""Orchestration of ``kvtier replay``: points, sweeps, references, SLO capacity search, the JSON report.

Owns: turning a :class:`ReplaySpec` into simulator runs (one per policy,
concurrency and HBM capacity, in worker processes when ``jobs > 1``; on a
fleet of engines, :mod:`kvtier.replay.fleet`, when the spec asks for one), the
capacity check for requests larger than HBM, the tuning / evaluation split
of a trace set, Belady's two-pass oracle, the two references every result
is judged against, and the report dictionary. Must not parse command lines
or print tables (``kvtier.cli`` and :mod:`kvtier.replay.report` do).

References, computed once per (conc, capacity) on the same workload, the
same skipped requests and the same admission order as the policies:

* ``floor``: an unbounded cache (HBM of unlimited size, LRU): what must be
  computed whatever the policy (first uses, and what concurrent requests
  compute at once).
* ``bound``: Belady (evict the farthest next use) over the total capacity the
  policies are offered, HBM + DRAM + SSD, as one tier: no placement over
  those tiers computes less (with a cold codec, ``--cold-codec``, DRAM and
  SSD count the blocks its ratio makes them hold). Its future comes from a
  first pass of plain LRU over that same single tier (reported too, as
  ``lru_one_tier``). Exact when every policy serves requests in one order
  (conc 1, sessions without agents running in parallel); otherwise the
  future is the first pass's timeline shifted by each session's drift, an
  estimate (``bound_exact``).

Both references cache in one large tier but admit requests as an engine with
the policies' HBM would (``SimConfig.running_limit_blocks``: the running
requests' blocks fit in that HBM), since every policy runs requests only from
HBM. Without that limit they would run more requests at once than any
policy can, and requests prefilling the same new prefix at once each compute
it: a "bound" above what a policy with less memory computes.

Both also report their later-turn TTFT p99: with that admission, the floor's
is the wait for HBM that no placement removes. The SLO capacity search adds
the floor's own capacity for the same reason.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable

from .. import __version__
from ..errors import ConfigError, KVTierError
from ..provenance import provenance
from .belady import DriftOracle, NextUseOracle
from .codec import ColdCodec
from .fleet import DEFAULT_REMOTE_GBPS
from .model import Session, Workload
from ..placement import make_placement
from .report import summarize
from .sim import SimConfig, Simulator

DEFAULT_POLICIES = ("lru", "lru-dram", "arc", "s3fifo", "ttl", "minwaste", "tokencake", "kvflow", "kvtier",
                    "belady-hbm")
SPLITS = ("all", "tune", "eval")
UNBOUNDED_BLOCKS = 1 << 40  # the floor's HBM: slots are taken lazily, so this costs nothing
FLOOR = "floor"  # SLO capacity rows: the floor's own (see slo_capacities)
CONFIG = "config"  # the policy of a config file (kvtier replay --config), with its constants

Progress = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class ReplaySpec:
    """Everything one ``kvtier replay`` invocation runs.

    HBM capacity: ``hbm_blocks`` if set, else ``hbm_fraction`` of the
    working set (:meth:`working_set_blocks`), else what the profile's HBM
    holds after the weights. DRAM defaults to twice the HBM blocks; SSD is
    off unless set. A fleet (``engines > 1`` or ``remote_blocks > 0``) gives
    every engine these capacities, and ``hbm_fraction`` is of one engine's
    share: the working set of ``conc / engines`` sessions. ``profile`` is
    fitted to ``workload`` on construction (:meth:`~kvtier.replay.profiles.Profile.fitted_to`:
    a sliding-window hybrid's block bytes follow the workload's windows).
    """

    workload: Workload
    profile: Any
    policies: tuple[str, ...] = DEFAULT_POLICIES
    concs: tuple[int, ...] = (8,)
    hbm_blocks: tuple[int, ...] | None = None
    hbm_fractions: tuple[float, ...] | None = None
    dram_blocks: int | None = None
    ssd_blocks: int = 0
    seed: int = 0
    warmup_s: float = 0.0
    gap_cap_s: float | None = None
    max_batch_tokens: int = 8192
    max_sessions: int | None = None
    time_scale: float = 1.0
    trace_name: str = "embedded"
    extra: dict[str, Any] = field(default_factory=dict)
    skip_oversized: bool = False
    admission: str = "fcfs"
    surface: str = "full"  # what the engine lets placement do (kvtier.placement.surface)
    agent_ends: bool = True  # the policy learns agents' ends (a hint server's); False: kv_transfer_params only
    tool_waits: str = "predicted"  # or "predicted-stream" (the request-stream chain), "announced" (true lengths)
    scheduler: str = "vllm"  # admission within the step's token budget, blocks cached at allocation; or "plain"
    load_rule: str = "surface"  # load or recompute a lower-tier hit (kvtier.placement.loadrule)
    max_running: int = 256  # requests the engine runs at once (vLLM's max_num_seqs)
    recorded_starts: bool = False  # closed loop: sessions start at their recorded starts (SimConfig.recorded_starts)
    references: bool = True
    jobs: int = 1
    slo_ttft_p99_s: float | None = None  # SLO capacity search: later-turn TTFT p99 bound (s)
    slo_interactivity: float | None = None  # ... and p50 interactivity floor (tokens/s/user)
    slo_max_conc: int = 256
    config_policy: str | None = None  # what the CONFIG policy name runs (a config file's placement section)
    config_params: dict[str, float] = field(default_factory=dict)
    # a fleet (kvtier.replay.fleet): engines, routing, the shared remote tier; capacities are per engine
    engines: int = 1
    routing: str = "round-robin"
    remote_blocks: int = 0
    remote_gbps: float = DEFAULT_REMOTE_GBPS
    # the codec of the cold tiers (kvtier.replay.codec): DRAM and SSD capacities stay byte budgets in raw blocks
    cold_codec: ColdCodec | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "profile", self.profile.fitted_to(self.workload))

    @property
    def fleet(self) -> bool:
        """Whether points run on a :class:`~kvtier.replay.fleet.FleetSimulator` (several
        engines or a remote tier) rather than one :class:`Simulator`."""
        return self.engines > 1 or self.remote_blocks > 0

    def working_set_blocks(self, conc: int | None = None) -> int:
        """Blocks that would make every reuse a hit: the distinct blocks of ``conc``
        sessions of mean footprint live at once (closed loop; ``conc`` defaults to
        the largest in :attr:`concs`), capped by the workload's distinct blocks.
        Open loop: all distinct blocks (any request may share with any other)."""
        w = self.workload
        distinct = w.num_distinct_blocks()
        if w.open_loop or not w.sessions:
            return distinct
        conc = conc if conc is not None else max(self.concs)
        mean_footprint = sum(s.num_distinct_blocks() for s in w.sessions) / len(w.sessions)
        return min(distinct, max(1, round(conc * mean_footprint)))

    def capacities(self, conc: int | None = None) -> list[int]:
        if self.hbm_blocks:
            return list(self.hbm_blocks)
        if self.hbm_fractions:
            # a fleet: each engine's share, conc / engines sessions of mean footprint
            conc = conc if conc is not None else max(self.concs)
            working_set = self.working_set_blocks(conc / self.engines if self.engines > 1 else conc)
            return [max(1, int(f * working_set)) for f in self.hbm_fractions]
        return [self.profile.hbm_kv_capacity_blocks(self.workload.block_size)]


def sim_config(spec: ReplaySpec, conc: int, hbm_blocks: int) -> SimConfig:
    dram = spec.dram_blocks if spec.dram_blocks is not None else 2 * hbm_blocks
    skip = frozenset(o.request_id for o in find_oversized(spec, hbm_blocks)) if spec.skip_oversized else frozenset()
    return SimConfig(hbm_blocks=hbm_blocks, dram_blocks=dram, ssd_blocks=spec.ssd_blocks, conc=conc,
                     max_batch_tokens=spec.max_batch_tokens, warmup_s=spec.warmup_s, gap_cap_s=spec.gap_cap_s,
                     max_sessions=spec.max_sessions, time_scale=spec.time_scale, skip_requests=skip,
                     admission=spec.admission, surface=spec.surface, cold_codec=spec.cold_codec,
                     agent_ends=spec.agent_ends, tool_waits=spec.tool_waits, scheduler=spec.scheduler,
                     load_rule=spec.load_rule, max_running=spec.max_running, recorded_starts=spec.recorded_starts)


# ------------------------------------------------------------ capacity check


@dataclass(frozen=True, slots=True)
class Oversized:
    """A request whose prompt and answer need more HBM blocks than there are."""

    request_id: tuple[int, str, int]  # (session index, agent id, request index), as the simulator names it
    session_id: str  # the trace's id (its file name for AgentX/Weka traces)
    need_blocks: int

    @property
    def path(self) -> str:
        return f"session {self.session_id!r}, agent {self.request_id[1]!r}, request {self.request_id[2]}"


class OversizedRequestsError(KVTierError):
    """Requests that no engine could run at the HBM capacity given (the message says which and what to do)."""


def _sessions(spec: ReplaySpec) -> list[Session]:
    w = spec.workload
    return list(w.sessions[: spec.max_sessions] if spec.max_sessions else w.sessions)


def find_oversized(spec: ReplaySpec, hbm_blocks: int) -> list[Oversized]:
    """Every request needing more than ``hbm_blocks`` (prompt + answer), in workload order."""
    bs = spec.workload.block_size
    out = []
    for idx, session in enumerate(_sessions(spec)):
        for agent in session.agents:
            for req in agent.requests:
                need = -(-(req.input_tokens + req.output_tokens) // bs)
                if need > hbm_blocks:
                    out.append(Oversized((idx, agent.agent_id, req.index), session.session_id, need))
    return out


def check_capacity(spec: ReplaySpec) -> dict[str, Any]:
    """Refuse (raise :class:`OversizedRequestsError`) when some request cannot fit in
    HBM at a capacity of ``spec``, unless ``spec.skip_oversized``; returns what
    is skipped per capacity (for the report)."""
    report: dict[str, Any] = {}
    total = sum(s.num_requests() for s in _sessions(spec))
    for hbm in spec.capacities():
        over = find_oversized(spec, hbm)
        if not over:
            continue
        worst = max(over, key=lambda o: o.need_blocks)
        sessions = len({o.request_id[0] for o in over})
        what = (f"{len(over):,} of {total:,} requests (in {sessions} of {len(_sessions(spec))} sessions) need more "
                f"than the {hbm:,} HBM blocks given; the largest, {worst.path}, needs {worst.need_blocks:,} blocks")
        if not spec.skip_oversized:
            raise OversizedRequestsError(
                f"kvtier replay: {what}. No engine can run such a request. Give --hbm-blocks "
                f"{worst.need_blocks} or more (or a larger --hbm-fraction), or --skip-oversized to skip them "
                f"(alike for every policy, the floor and the bound) and count them.")
        report[str(hbm)] = {"skipped_requests": len(over), "sessions": sessions,
                            "largest": {"path": worst.path, "need_blocks": worst.need_blocks},
                            "message": what}
    return report


def split_workload(workload: Workload, half: str) -> Workload:
    """The tuning or evaluation half of a trace set, by a fixed rule: sessions
    sorted by id, the 1st, 3rd, 5th, ... form the tuning half (``tune``), the
    2nd, 4th, ... the evaluation half (``eval``); ``all`` keeps every session."""
    if half not in SPLITS:
        raise ConfigError("--split", half, f"valid: {', '.join(SPLITS)}")
    if half == "all":
        return workload
    ordered = sorted(workload.sessions, key=lambda s: s.session_id)
    keep = {id(s) for s in ordered[(0 if half == "tune" else 1)::2]}
    return replace(workload, sessions=tuple(s for s in workload.sessions if id(s) in keep))


# ------------------------------------------------------------------- points


def _parallel_free(session: Session) -> bool:
    """True when at most one agent of ``session`` can have a request live at a time."""
    for a in session.agents[1:]:
        if a.join_before is None or a.spawn_after is None:
            return False  # a background agent, or one started with the session, runs beside its parent
        if a.join_before > a.spawn_after + 1:
            return False  # the parent sends requests while the sub-agent runs
    spans = sorted((a.parent_id, a.spawn_after, a.join_before) for a in session.agents[1:])
    return all(not (p == q and j > s2) for (p, _, j), (q, s2, _) in zip(spans, spans[1:]))


def bound_is_exact(spec: ReplaySpec, conc: int) -> bool:
    """Whether every policy serves the requests in one order, so the recorded future is exact."""
    return conc == 1 and not spec.workload.open_loop and all(_parallel_free(s) for s in _sessions(spec))


def tiers_offered(cfg: SimConfig) -> tuple[str, ...]:
    return ("hbm",) + tuple(t for t in ("dram", "ssd") if cfg.tier_blocks(t) > 0)


def total_blocks(cfg: SimConfig) -> int:
    """Blocks the tiers offered hold together (with a cold codec, what its ratio makes of DRAM and SSD)."""
    return cfg.hbm_blocks + cfg.tier_blocks("dram") + cfg.tier_blocks("ssd")


def codec_fields(cfg: SimConfig) -> dict[str, Any]:
    """A point's cold codec and the capacities it gives (only with ``--cold-codec``): the
    byte budgets stay in ``dram_blocks`` / ``ssd_blocks`` (raw blocks); the
    ``*_effective`` ones are the blocks those tiers hold."""
    c = cfg.cold_codec
    if c is None:
        return {}
    return {"cold_codec": c.name, "cold_codec_ratio": 1.0 if c.identity else c.ratio,
            "cold_codec_tiers": list(c.tiers), "codec_cores": c.cores,
            "dram_blocks_effective": cfg.tier_blocks("dram"), "ssd_blocks_effective": cfg.tier_blocks("ssd")}


def reference_point(spec: ReplaySpec, conc: int, hbm_blocks: int) -> dict[str, Any]:
    """The floor, the bound and LRU over one tier of the same total capacity (see the module doc)."""
    cfg = sim_config(spec, conc, hbm_blocks)
    total = total_blocks(cfg)  # a cold codec's ratio included: the bound gets the blocks the policies get
    start = time.perf_counter()
    # both cache in one large tier but run no more requests at once than the policies' HBM holds
    floor = Simulator(spec.workload, floor_config(cfg), make_placement("lru"), spec.profile).run()
    one_tier = replace(cfg, hbm_blocks=total, dram_blocks=0, ssd_blocks=0, running_limit_blocks=cfg.hbm_blocks,
                       cold_codec=None)
    order: list = []
    lru = Simulator(spec.workload, one_tier, make_placement("lru"), spec.profile, order_log=order).run()
    exact = bound_is_exact(spec, conc)
    oracle = NextUseOracle(order) if exact else DriftOracle(order)
    bound = Simulator(spec.workload, one_tier, make_placement("belady-hbm"), spec.profile, oracle=oracle).run()

    def computed(res: Any) -> int:
        recs = [r for r in res.records if r.measured] or res.records
        return sum(r.computed_tokens for r in recs)

    def ttft_p99(res: Any) -> float | None:
        return summarize(res, policy="", conc=conc, hbm_blocks=hbm_blocks,
                         num_chips=spec.profile.num_chips)["ttft_p99_later_turns_s"]

    return {"conc": conc, "hbm_blocks": hbm_blocks, "total_blocks": total,
            "tiers_offered": list(tiers_offered(cfg)),
            "floor_prefill_tokens": computed(floor), "bound_prefill_tokens": computed(bound),
            "lru_one_tier_prefill_tokens": computed(lru), "bound_exact": exact,
            # what no placement can beat under this admission: the queue for HBM alone
            "floor_ttft_p99_later_turns_s": ttft_p99(floor), "bound_ttft_p99_later_turns_s": ttft_p99(bound),
            "wall_s": time.perf_counter() - start}


def floor_config(cfg: SimConfig) -> SimConfig:
    """The floor's engine: a cache that never evicts, running no more requests
    at once than ``cfg``'s HBM holds (the same admission as every policy)."""
    return replace(cfg, hbm_blocks=UNBOUNDED_BLOCKS, dram_blocks=0, ssd_blocks=0, running_limit_blocks=cfg.hbm_blocks,
                   cold_codec=None)


def with_references(row: dict[str, Any], ref: dict[str, Any]) -> dict[str, Any]:
    """``row`` with the references of its (conc, capacity) and its ratios to them."""
    c = row["prefill_tokens_computed"]
    out = dict(row)
    for key in ("floor_prefill_tokens", "bound_prefill_tokens", "lru_one_tier_prefill_tokens", "bound_exact",
                "floor_ttft_p99_later_turns_s", "bound_ttft_p99_later_turns_s"):
        out[key] = ref[key]
    out["computed_over_bound"] = c / ref["bound_prefill_tokens"] if ref["bound_prefill_tokens"] else None
    out["computed_over_floor"] = c / ref["floor_prefill_tokens"] if ref["floor_prefill_tokens"] else None
    return out


def _placement(spec: ReplaySpec, policy_name: str) -> Any:
    if policy_name == CONFIG:
        return make_placement(spec.config_policy, "placement.policy", spec.config_params)
    return make_placement(policy_name)


def fleet_fields(spec: ReplaySpec, result: Any) -> dict[str, Any]:
    """A fleet point's own figures (modelled): engines, routing, the remote tier and its links' bytes."""
    remote = spec.remote_blocks > 0
    return {"engines": spec.engines, "routing": spec.routing, "remote": remote, "remote_blocks": spec.remote_blocks,
            "remote_gbps": spec.remote_gbps if remote else None,
            "remote_bytes_written": result.bytes_moved.get("hbm->remote", 0),
            "remote_bytes_read": result.bytes_moved.get("remote->hbm", 0),
            "prefill_tokens_hit_remote": result.counters.get("remote_hit_blocks", 0) * spec.workload.block_size,
            "handed_over": result.counters.get("handed_over", 0), "modelled": True}


def run_point(spec: ReplaySpec, policy_name: str, conc: int, hbm_blocks: int,
              progress: Progress | None = None) -> dict[str, Any]:
    """Replay one (policy, conc, capacity) point; returns its ``results`` entry
    (without references: :func:`run_replay` adds them)."""
    cfg = sim_config(spec, conc, hbm_blocks)
    if policy_name == FLOOR:  # the floor's engine, with LRU (it never evicts)
        cfg, policy = floor_config(cfg), make_placement("lru")
    elif policy_name == CONFIG:
        if spec.config_policy is None:
            raise ValueError("policy 'config' needs ReplaySpec.config_policy (kvtier replay --config)")
        policy = make_placement(spec.config_policy, "placement.policy", spec.config_params)
    else:
        policy = make_placement(policy_name)
    label = f"{policy_name} conc={conc} hbm={hbm_blocks}"
    start = time.perf_counter()  # includes belady's recording pass
    oracle = None
    if policy.needs_oracle:  # pass 1 records the order requests are served in
        order: list = []
        Simulator(spec.workload, cfg, make_placement("lru"), spec.profile, order_log=order).run()
        # one session at a time: the order is the same under every policy and the
        # recorded future exact; otherwise shift it by each session's drift
        oracle = NextUseOracle(order) if bound_is_exact(spec, conc) else DriftOracle(order)

    def tick(done: int, total: int) -> None:
        if progress is not None:
            progress(f"[replay] {label}: {done}/{total} requests")

    if spec.fleet:
        from .fleet import FleetConfig, FleetSimulator

        fleet = FleetSimulator(spec.workload, cfg, lambda: _placement(spec, policy_name), spec.profile,
                               FleetConfig(spec.engines, spec.routing, spec.remote_blocks, spec.remote_gbps))
        result, tiers_used = fleet.run(), list(fleet.engines[0].mgr.tier_names) + (["remote"] if fleet.remote else [])
    else:
        sim = Simulator(spec.workload, cfg, policy, spec.profile, oracle=oracle, progress=tick)
        result, tiers_used = sim.run(), list(sim.mgr.tier_names)
    wall = time.perf_counter() - start
    row = summarize(result, policy=policy_name, conc=conc, hbm_blocks=hbm_blocks, num_chips=spec.profile.num_chips)
    row["dram_blocks"], row["ssd_blocks"] = cfg.dram_blocks, cfg.ssd_blocks
    row |= codec_fields(cfg)
    row["tiers_offered"] = list(tiers_offered(cfg)) + (["remote"] if spec.remote_blocks > 0 else [])
    row["tiers_used"] = tiers_used
    if spec.fleet:
        row |= fleet_fields(spec, result)
    row["admission"] = cfg.admission
    row["surface"] = cfg.surface
    row["agent_ends"] = "reported" if cfg.agent_ends else "unknown"
    row["tool_waits"] = cfg.tool_waits
    row["scheduler"] = cfg.scheduler
    row["load_rule"] = cfg.load_rule
    row["skipped_requests"] = result.counters.get("skipped_requests", 0)
    row["wall_s"] = wall
    row["block_touches_per_s"] = result.block_touches / wall if wall > 0 else None
    if progress is not None:
        progress(f"[replay] {label}: done in {wall:.1f}s ({row['block_touches_per_s'] or 0:,.0f} block touches/s)")
    return row


_WORKER_SPEC: ReplaySpec | None = None  # the spec forked worker processes inherit


def _task(kind: str, policy: str, conc: int, hbm: int) -> dict[str, Any]:
    assert _WORKER_SPEC is not None
    return _run_task(_WORKER_SPEC, (kind, policy, conc, hbm))


def _run_task(spec: ReplaySpec, task: tuple[str, str, int, int]) -> dict[str, Any]:
    kind, policy, conc, hbm = task
    if kind == "ref":
        return reference_point(spec, conc, hbm)
    if kind == "slo":
        return slo_capacity(spec, policy, hbm, spec.slo_ttft_p99_s, spec.slo_interactivity, spec.slo_max_conc)
    return run_point(spec, policy, conc, hbm)


def run_points(spec: ReplaySpec, tasks: Iterable[tuple[str, str, int, int]],
               on_done: Callable[[tuple[str, str, int, int], dict[str, Any]], None]) -> None:
    """Run ``tasks`` (kind ``"point"`` or ``"ref"``, policy, conc, capacity), in
    ``spec.jobs`` forked worker processes when more than one; ``on_done`` is
    called in this process as each finishes."""
    global _WORKER_SPEC
    tasks = list(tasks)
    jobs = min(spec.jobs, len(tasks))
    if jobs <= 1 or "fork" not in multiprocessing.get_all_start_methods():
        for t in tasks:
            on_done(t, _run_task(spec, t))
        return
    _WORKER_SPEC = spec
    try:
        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork")) as pool:
            pending: dict[Future, tuple[str, str, int, int]] = {pool.submit(_task, *t): t for t in tasks}
            while pending:
                done, _ = wait(pending, return_when=FIRST_COMPLETED)
                for fut in done:
                    on_done(pending.pop(fut), fut.result())
    finally:
        _WORKER_SPEC = None


def default_jobs() -> int:
    return max(1, min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


def run_replay(spec: ReplaySpec, progress: Progress | None = None,
               on_point: Callable[[int, int, float], None] | None = None) -> dict[str, Any]:
    """Every (policy, conc, capacity) point of ``spec``, each with its references;
    returns the full JSON report. ``on_point(done, total, elapsed_s)`` after each
    finished run (progress bars)."""
    skipped = check_capacity(spec)
    grid = [(hbm, conc) for hbm in spec.capacities() for conc in spec.concs]
    tasks = [("ref", "", conc, hbm) for hbm, conc in grid] if spec.references else []
    tasks += [("point", pol, conc, hbm) for hbm, conc in grid for pol in spec.policies]
    rows: dict[tuple[str, int, int], dict[str, Any]] = {}
    refs: dict[tuple[int, int], dict[str, Any]] = {}
    start = time.perf_counter()

    def done(task: tuple[str, str, int, int], result: dict[str, Any]) -> None:
        kind, pol, conc, hbm = task
        if kind == "ref":
            refs[(conc, hbm)] = result
        else:
            rows[(pol, conc, hbm)] = result
        if progress is not None and on_point is None:
            what = "floor and bound" if kind == "ref" else pol
            progress(f"[replay] {what} conc={conc} hbm={hbm}: done ({len(rows) + len(refs)}/{len(tasks)})")
        if on_point is not None:
            on_point(len(rows) + len(refs), len(tasks), time.perf_counter() - start)

    run_points(spec, tasks, done)
    results = []
    for hbm, conc in grid:
        for pol in spec.policies:
            row = rows[(pol, conc, hbm)]
            results.append(with_references(row, refs[(conc, hbm)]) if spec.references else row)
    return report_header(spec) | {"skipped": skipped, "references": [refs[k] for k in sorted(refs)],
                                  "results": results}


def report_header(spec: ReplaySpec) -> dict[str, Any]:
    w = spec.workload
    return {
        "kvtier_version": __version__,
        **provenance(),
        "trace": spec.trace_name,
        "profile": spec.profile.spec,
        **({"sliding_window": window_report(spec.profile, w.block_size)}
           if spec.profile.model.num_sliding_layers else {}),
        "seed": spec.seed,
        "block_size": w.block_size,
        "workload": {"sessions": len(w.sessions), "requests": w.num_requests(),
                     "distinct_blocks": w.num_distinct_blocks()},
        "admission": spec.admission,
        "surface": spec.surface,
        "agent_ends": "reported" if spec.agent_ends else "unknown",
        "tool_waits": spec.tool_waits,
        "scheduler": spec.scheduler,
        "load_rule": spec.load_rule,
        "skip_oversized": spec.skip_oversized,
        **({"cold_codec": spec.cold_codec.describe()} if spec.cold_codec is not None else {}),
        **({"fleet": {"engines": spec.engines, "routing": spec.routing, "remote_blocks": spec.remote_blocks,
                      "remote_gbps": spec.remote_gbps, "capacities": "per engine", "conc": "whole fleet",
                      "modelled": True}} if spec.fleet else {}),
        **spec.extra,
    }


def window_report(profile: Any, block_size: int) -> dict[str, Any]:
    """What a sliding-window hybrid's windows do to a replay's bytes: its window,
    the share of blocks that keep the sliding layers' KV, and the block bytes
    with and without the window."""
    m = profile.model
    return {"layers": m.num_sliding_layers, "of_layers": m.num_layers, "window_tokens": m.sliding_window_tokens,
            "window_share": profile.window_share,
            "kv_bytes_per_block": profile.kv_bytes_per_block(block_size),
            "kv_bytes_per_block_full_attention": m.kv_bytes_per_token * block_size}


def largest_passing(passes: Callable[[int], bool], limit: int, first: int = 1) -> int:
    """Largest ``n`` in ``[first, limit]`` with ``passes(n)`` for a monotone
    predicate (true up to some ``n``, false after), ``first - 1`` when none:
    doubles from ``first`` until it fails, then bisects. O(log limit) calls."""
    lo, hi = first - 1, first
    while hi <= limit and passes(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if passes(mid) else (lo, mid)
    return lo


def slo_capacity(spec: ReplaySpec, policy_name: str, hbm_blocks: int, ttft_p99_s: float | None,
                 interactivity: float | None, max_conc: int = 256, progress: Progress | None = None,
                 ) -> dict[str, Any]:
    """Largest conc whose later-turn p99 TTFT <= ``ttft_p99_s`` and p50 interactivity >= ``interactivity``.

    Doubles conc until the SLO breaks, then bisects. Returns the capacity (0 if
    even conc=1 fails) and every point measured."""
    cache: dict[int, dict[str, Any]] = {}

    def meets(conc: int) -> bool:
        if conc not in cache:
            cache[conc] = run_point(spec, policy_name, conc, hbm_blocks, progress)
        row = cache[conc]
        ok_ttft = ttft_p99_s is None or row["ttft_p99_later_turns_s"] <= ttft_p99_s
        ok_int = interactivity is None or row["interactivity_p50"] >= interactivity
        return ok_ttft and ok_int

    w = spec.workload
    limit = max_conc if w.open_loop else min(max_conc, len(_sessions(spec)))  # more conc than sessions: no change
    lo = largest_passing(meets, limit)
    return {"policy": policy_name, "hbm_blocks": hbm_blocks, "slo_ttft_p99_s": ttft_p99_s,
            "slo_interactivity": interactivity, "max_conc": lo,
            "points": [cache[c] for c in sorted(cache)]}


def slo_capacities(spec: ReplaySpec, hbm_blocks: int,
                   on_point: Callable[[int, int, float], None] | None = None) -> list[dict[str, Any]]:
    """:func:`slo_capacity` of every policy of ``spec`` (its SLO fields), one
    policy per worker process when ``spec.jobs > 1``; in policy order, then (with
    references) the floor's: an unbounded cache under the same admission, the
    capacity no placement can exceed."""
    out: dict[str, dict[str, Any]] = {}
    start = time.perf_counter()
    rows = list(spec.policies) + ([FLOOR] if spec.references else [])

    def done(task: tuple[str, str, int, int], result: dict[str, Any]) -> None:
        out[task[1]] = result
        if on_point is not None:
            on_point(len(out), len(rows), time.perf_counter() - start)

    run_points(spec, [("slo", pol, 0, hbm_blocks) for pol in rows], done)
    return [out[p] for p in rows]
