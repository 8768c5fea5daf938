"""Trace statistics without a simulation: sizes and infinite-cache hit rates.

Owns: :func:`analyze`, what ``kvtier analyze-trace`` prints: request and
session counts, input / output token percentiles, and the hit rate of a
cache that never evicts, under the definitions people compare:

* ``token_hit_rate``: input tokens served from cache / input tokens. A
  request reuses the leading run of its full blocks that some earlier
  request listed (a prefix cache). This is what kvtier's floor (an
  unbounded cache) saves, before timing: in a replay a block is reusable
  only once the request that computes it has run.
* ``block_hit_rate``: the same leading runs counted in full blocks, over all
  full blocks listed.
* ``request_mean_hit_rate``: the mean over requests of (leading run of
  listed ids seen before) / (ids listed), counting the id a trace lists for
  a trailing partial block (:attr:`~kvtier.replay.model.Request.partial_block`)
  as any other. This is aiperf's ``analyze-trace`` "theoretical cache hit
  rate" (its ``cache_hit_rate``), whose processing order is the file's;
  here requests go in send order (session start + send time, ties in load
  order), which for a Mooncake file sorted by timestamp is the same.

Requests are taken in send order across the whole workload. Pure function
of a loaded :class:`~kvtier.replay.model.Workload`: no I/O, no simulator.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .model import Request, Workload


def _send_order(workload: Workload) -> list[Request]:
    timed: list[tuple[float, int, Request]] = []
    for s in workload.sessions:
        for a in s.agents:
            for r in a.requests:
                timed.append((s.start_s + r.arrival_s, len(timed), r))
    timed.sort(key=lambda x: (x[0], x[1]))
    return [r for _, _, r in timed]


def _percentiles(values: list[int]) -> dict[str, float]:
    if not values:
        return {"p50": math.nan, "p90": math.nan, "p99": math.nan, "mean": math.nan}
    arr = np.asarray(values, dtype=np.float64)
    p50, p90, p99 = np.percentile(arr, [50, 90, 99])
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99), "mean": float(arr.mean())}


def _leading_run(ids: tuple[int, ...], seen: set[int]) -> int:
    run = 0
    for b in ids:
        if b not in seen:
            break
        run += 1
    return run


def analyze(workload: Workload) -> dict[str, Any]:
    """Counts, token percentiles and infinite-cache hit rates of ``workload`` (see the module docstring)."""
    bs = workload.block_size
    cached: set[int] = set()  # full blocks: what a prefix cache holds
    listed_ids: set[int] = set()  # every id listed, the partial ones too (aiperf's seen set)
    hit_blocks = listed_blocks = input_tokens = 0
    ratios: list[float] = []
    requests = _send_order(workload)
    for r in requests:
        ids = r.block_ids
        hit_blocks += _leading_run(ids, cached)
        cached.update(ids)
        listed = ids if r.partial_block is None else (*ids, r.partial_block)
        if listed:
            ratios.append(_leading_run(listed, listed_ids) / len(listed))
            listed_ids.update(listed)
        listed_blocks += len(ids)
        input_tokens += r.input_tokens
    return {
        "workload": workload.name,
        "block_size": bs,
        "open_loop": workload.open_loop,
        "sessions": len(workload.sessions),
        "requests": len(requests),
        "agents": sum(len(s.agents) for s in workload.sessions),
        "input_tokens": input_tokens,
        "distinct_blocks": len(cached),
        "input_tokens_per_request": _percentiles([r.input_tokens for r in requests]),
        "output_tokens_per_request": _percentiles([r.output_tokens for r in requests]),
        "token_hit_rate": hit_blocks * bs / input_tokens if input_tokens else math.nan,
        "block_hit_rate": hit_blocks / listed_blocks if listed_blocks else math.nan,
        "request_mean_hit_rate": sum(ratios) / len(ratios) if ratios else math.nan,
    }


def format_report(report: dict[str, Any]) -> str:
    """The report as the lines ``kvtier analyze-trace`` prints."""
    i, o = report["input_tokens_per_request"], report["output_tokens_per_request"]
    loop = "open loop" if report["open_loop"] else "closed loop"
    return "\n".join([
        f"workload {report['workload']}: {report['sessions']:,} sessions, {report['agents']:,} agents, "
        f"{report['requests']:,} requests ({loop}), block size {report['block_size']}",
        f"input tokens per request:  p50 {i['p50']:,.0f}  p90 {i['p90']:,.0f}  p99 {i['p99']:,.0f}  "
        f"mean {i['mean']:,.0f}",
        f"output tokens per request: p50 {o['p50']:,.0f}  p90 {o['p90']:,.0f}  p99 {o['p99']:,.0f}  "
        f"mean {o['mean']:,.0f}",
        "infinite-cache hit rate (a cache that never evicts, requests in send order):",
        f"  token_hit_rate         {report['token_hit_rate']:.4f}  input tokens reused / input tokens "
        "(what kvtier's floor saves)",
        f"  block_hit_rate         {report['block_hit_rate']:.4f}  full blocks reused / full blocks listed",
        f"  request_mean_hit_rate  {report['request_mean_hit_rate']:.4f}  mean per request of listed ids reused "
        "(aiperf analyze-trace's cache_hit_rate)",
    ])
