"""Turn simulator results into the figures ``kvtier replay`` prints, writes and plots.

Owns: the definitions of every reported metric (percentiles, throughput per
chip, hit rates), the terminal table and the PNG charts. Must not simulate.

Definitions:

* TTFT = first token time - time the request was ready (its dependencies
  done and its gap elapsed); ``later turns`` = every request but a session's
  first (tool results, user turns, sub-agent requests).
* interactivity = decode tokens per second of one request after its first
  token (tokens/s/user), p50 over requests with more than one output token.
* throughput per chip = (input + output tokens of measured requests) /
  measured wall time / chips; the input and output parts are also reported.
* prefill tokens: ``computed`` were run through the model; ``hit_*`` were
  served from that tier's cache (loaded from DRAM / SSD when not in HBM).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from .sim import SimResult

RESULT_FIELDS = (
    "policy", "conc", "hbm_blocks", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "ttft_p50_first_turn_s",
    "ttft_p99_first_turn_s", "ttft_p50_later_turns_s", "ttft_p99_later_turns_s", "interactivity_p50",
    "e2e_mean_s", "e2e_p99_s", "throughput_per_chip_tok_s", "input_tok_s_per_chip", "output_tok_s_per_chip",
    "prefill_tokens_computed", "prefill_tokens_hit_hbm", "prefill_tokens_hit_dram", "prefill_tokens_hit_ssd",
    "bytes_moved", "hit_rate_hbm", "hit_rate_dram", "hit_rate_ssd", "num_requests",
)


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank-interpolated percentile (numpy's 'linear'); NaN when empty."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(result: SimResult, *, policy: str, conc: int, hbm_blocks: int, num_chips: int) -> dict[str, Any]:
    """One ``results`` entry of the JSON report."""
    recs = [r for r in result.records if r.measured] or result.records
    ttft = [r.ttft_s for r in recs]
    first = [r.ttft_s for r in recs if r.first_turn]
    later = [r.ttft_s for r in recs if not r.first_turn]
    inter = [x for x in (r.interactivity_tok_s for r in recs) if x is not None]
    span = max(result.makespan_s - result.measure_start_s, 1e-9)
    tok_in = sum(r.input_tokens for r in recs)
    tok_out = sum(r.output_tokens for r in recs)
    computed = sum(r.computed_tokens for r in recs)
    hit = {t: sum(getattr(r, f"hit_{t}_tokens") for r in recs) for t in ("hbm", "dram", "ssd")}
    lat = result.session_latency_s
    return {
        "policy": policy,
        "conc": conc,
        "hbm_blocks": hbm_blocks,
        "num_requests": len(recs),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p90_s": percentile(ttft, 90),
        "ttft_p99_s": percentile(ttft, 99),
        "ttft_p50_first_turn_s": percentile(first, 50),
        "ttft_p99_first_turn_s": percentile(first, 99),
        "ttft_p50_later_turns_s": percentile(later, 50),
        "ttft_p99_later_turns_s": percentile(later, 99),
        "interactivity_p50": percentile(inter, 50),
        "e2e_mean_s": sum(lat) / len(lat) if lat else math.nan,
        "e2e_p99_s": percentile(lat, 99),
        "throughput_per_chip_tok_s": (tok_in + tok_out) / span / num_chips,
        "input_tok_s_per_chip": tok_in / span / num_chips,
        "output_tok_s_per_chip": tok_out / span / num_chips,
        "prefill_tokens_computed": computed,
        "prefill_tokens_hit_hbm": hit["hbm"],
        "prefill_tokens_hit_dram": hit["dram"],
        "prefill_tokens_hit_ssd": hit["ssd"],
        "bytes_moved": sum(result.bytes_moved.values()),
        "bytes_moved_per_link": dict(sorted(result.bytes_moved.items())),
        "hit_rate_hbm": hit["hbm"] / tok_in if tok_in else math.nan,
        "hit_rate_dram": hit["dram"] / tok_in if tok_in else math.nan,
        "hit_rate_ssd": hit["ssd"] / tok_in if tok_in else math.nan,
        "block_touches": result.block_touches,
        "counters": dict(result.counters),
    }


TABLE_COLUMNS = (
    ("policy", "policy"), ("conc", "conc"), ("hbm_blocks", "hbm_blk"),
    ("ttft_p50_first_turn_s", "ttft1_p50"), ("ttft_p99_first_turn_s", "ttft1_p99"),
    ("ttft_p50_later_turns_s", "ttftN_p50"), ("ttft_p99_later_turns_s", "ttftN_p99"),
    ("ttft_p90_s", "ttft_p90"), ("interactivity_p50", "tok/s/user"), ("e2e_mean_s", "e2e_mean"),
    ("e2e_p99_s", "e2e_p99"), ("input_tok_s_per_chip", "in_tok/s/chip"), ("output_tok_s_per_chip", "out_tok/s/chip"),
    ("prefill_tokens_computed", "computed"), ("prefill_tokens_hit_hbm", "hit_hbm"),
    ("prefill_tokens_hit_dram", "hit_dram"), ("prefill_tokens_hit_ssd", "hit_ssd"),
    ("bytes_moved", "moved_GB"), ("hit_rate_hbm", "hr_hbm"), ("hit_rate_dram", "hr_dram"), ("hit_rate_ssd", "hr_ssd"),
)


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """A fixed-width table, one line per (policy, conc, capacity) point."""
    header = [h for _, h in TABLE_COLUMNS]
    body = [[_cell(k, r.get(k)) for k, _ in TABLE_COLUMNS] for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(header)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(b, widths)) for b in body]
    return "\n".join(lines)


def _cell(key: str, v: Any) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if key == "bytes_moved":
        return f"{v / 1e9:.1f}"
    if key.startswith("prefill_tokens"):
        return f"{v / 1e6:.2f}M"
    if key.startswith("hit_rate"):
        return f"{v:.3f}"
    if isinstance(v, float):
        return f"{v:.3f}" if v < 100 else f"{v:.0f}"
    return str(v)


def plot(results: Sequence[dict[str, Any]], capacity_rows: Sequence[dict[str, Any]], path: str, title: str) -> None:
    """Pareto chart (interactivity vs throughput per chip, labelled by conc) and,
    when capacities were swept, hit rate vs HBM capacity. Writes a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ncols = 2 if capacity_rows else 1
    fig, axes = plt.subplots(1, ncols, figsize=(7 * ncols, 5), squeeze=False)
    ax = axes[0][0]
    for pol in dict.fromkeys(r["policy"] for r in results):
        pts = sorted((r for r in results if r["policy"] == pol), key=lambda r: r["conc"])
        xs = [r["interactivity_p50"] for r in pts]
        ys = [r["throughput_per_chip_tok_s"] for r in pts]
        ax.plot(xs, ys, marker="o", label=pol)
        for r, x, y in zip(pts, xs, ys):
            ax.annotate(str(r["conc"]), (x, y), textcoords="offset points", xytext=(3, 3), fontsize=7)
    ax.set_xlabel("interactivity p50 (tokens/s/user)")
    ax.set_ylabel("throughput per chip (tokens/s)")
    ax.set_title("Pareto: throughput vs interactivity (labels: conc)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if capacity_rows:
        ax2 = axes[0][1]
        for pol in dict.fromkeys(r["policy"] for r in capacity_rows):
            pts = sorted((r for r in capacity_rows if r["policy"] == pol), key=lambda r: r["hbm_blocks"])
            total = [(r["prefill_tokens_hit_hbm"] + r["prefill_tokens_hit_dram"] + r["prefill_tokens_hit_ssd"])
                     / max(1, r["prefill_tokens_hit_hbm"] + r["prefill_tokens_hit_dram"] + r["prefill_tokens_hit_ssd"]
                           + r["prefill_tokens_computed"]) for r in pts]
            ax2.plot([r["hbm_blocks"] for r in pts], total, marker="o", label=pol)
        ax2.set_xlabel("HBM capacity (blocks)")
        ax2.set_ylabel("prefill tokens served from cache (all tiers)")
        ax2.set_title("hit rate vs HBM capacity")
        ax2.grid(alpha=0.3)
        ax2.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
