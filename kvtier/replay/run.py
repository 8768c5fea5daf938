"""Orchestration of ``kvtier replay``: points, sweeps, SLO capacity search, the JSON report.

Owns: turning a :class:`ReplaySpec` into simulator runs (one per policy,
concurrency and HBM capacity), Belady's two-pass oracle, and the report
dictionary. Must not parse command lines or print tables (``kvtier.cli`` and
:mod:`kvtier.replay.report` do).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

from .. import __version__
from .belady import DriftOracle, NextUseOracle
from .model import Workload
from .placement import make_placement
from .report import summarize
from .sim import SimConfig, Simulator

DEFAULT_POLICIES = ("lru", "lru-dram", "arc", "s3fifo", "ttl", "minwaste", "tokencake", "kvflow", "kvtier", "belady")

Progress = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class ReplaySpec:
    """Everything one ``kvtier replay`` invocation runs.

    HBM capacity: ``hbm_blocks`` if set, else ``hbm_fraction`` of the
    working set (:meth:`working_set_blocks`), else what the profile's HBM
    holds after the weights. DRAM defaults to twice the HBM blocks; SSD is
    off unless set.
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
            working_set = self.working_set_blocks(conc)
            return [max(1, int(f * working_set)) for f in self.hbm_fractions]
        return [self.profile.hbm_kv_capacity_blocks(self.workload.block_size)]


def sim_config(spec: ReplaySpec, conc: int, hbm_blocks: int) -> SimConfig:
    dram = spec.dram_blocks if spec.dram_blocks is not None else 2 * hbm_blocks
    return SimConfig(hbm_blocks=hbm_blocks, dram_blocks=dram, ssd_blocks=spec.ssd_blocks, conc=conc,
                     max_batch_tokens=spec.max_batch_tokens, warmup_s=spec.warmup_s, gap_cap_s=spec.gap_cap_s,
                     max_sessions=spec.max_sessions, time_scale=spec.time_scale)


def run_point(spec: ReplaySpec, policy_name: str, conc: int, hbm_blocks: int,
              progress: Progress | None = None) -> dict[str, Any]:
    """Replay one (policy, conc, capacity) point; returns its ``results`` entry."""
    cfg = sim_config(spec, conc, hbm_blocks)
    policy = make_placement(policy_name)
    label = f"{policy_name} conc={conc} hbm={hbm_blocks}"
    start = time.perf_counter()  # includes belady's recording pass
    oracle = None
    if policy.needs_oracle:  # pass 1 records the order requests are served in
        order: list = []
        Simulator(spec.workload, cfg, make_placement("lru"), spec.profile, order_log=order).run()
        # one session at a time: the order is the same under every policy and the
        # recorded future exact; otherwise shift it by each session's drift
        oracle = NextUseOracle(order) if conc == 1 and not spec.workload.open_loop else DriftOracle(order)

    def tick(done: int, total: int) -> None:
        if progress is not None:
            progress(f"[replay] {label}: {done}/{total} requests")

    sim = Simulator(spec.workload, cfg, policy, spec.profile, oracle=oracle, progress=tick)
    result = sim.run()
    wall = time.perf_counter() - start
    row = summarize(result, policy=policy_name, conc=conc, hbm_blocks=hbm_blocks, num_chips=spec.profile.num_chips)
    row["dram_blocks"], row["ssd_blocks"] = cfg.dram_blocks, cfg.ssd_blocks
    row["wall_s"] = wall
    row["block_touches_per_s"] = result.block_touches / wall if wall > 0 else None
    if progress is not None:
        progress(f"[replay] {label}: done in {wall:.1f}s ({row['block_touches_per_s'] or 0:,.0f} block touches/s)")
    return row


def run_replay(spec: ReplaySpec, progress: Progress | None = None) -> dict[str, Any]:
    """Every (policy, conc, capacity) point of ``spec``; returns the full JSON report."""
    rows = []
    for hbm in spec.capacities():
        for conc in spec.concs:
            for pol in spec.policies:
                rows.append(run_point(spec, pol, conc, hbm, progress))
    return report_header(spec) | {"results": rows}


def report_header(spec: ReplaySpec) -> dict[str, Any]:
    w = spec.workload
    return {
        "kvtier_version": __version__,
        "trace": spec.trace_name,
        "profile": spec.profile.spec,
        "seed": spec.seed,
        "block_size": w.block_size,
        "workload": {"sessions": len(w.sessions), "requests": w.num_requests(),
                     "distinct_blocks": w.num_distinct_blocks()},
        **spec.extra,
    }


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
    """Largest conc whose p99 TTFT <= ``ttft_p99_s`` and p50 interactivity >= ``interactivity``.

    Doubles conc until the SLO breaks, then bisects. Returns the capacity (0 if
    even conc=1 fails) and every point measured."""
    cache: dict[int, dict[str, Any]] = {}

    def meets(conc: int) -> bool:
        if conc not in cache:
            cache[conc] = run_point(spec, policy_name, conc, hbm_blocks, progress)
        row = cache[conc]
        ok_ttft = ttft_p99_s is None or row["ttft_p99_s"] <= ttft_p99_s
        ok_int = interactivity is None or row["interactivity_p50"] >= interactivity
        return ok_ttft and ok_int

    lo = largest_passing(meets, max_conc)
    return {"policy": policy_name, "hbm_blocks": hbm_blocks, "slo_ttft_p99_s": ttft_p99_s,
            "slo_interactivity": interactivity, "max_conc": lo,
            "points": [cache[c] for c in sorted(cache)]}

