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
* cold codec (``--cold-codec``): ``dram_blocks`` / ``ssd_blocks`` are the byte
  budgets in raw blocks, ``*_blocks_effective`` the blocks the compressed
  tiers hold; ``bytes_moved`` counts the bytes on the links (compressed where
  a compressed tier is an end), ``counters`` the blocks encoded and decoded.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from .sim import SimResult

RESULT_FIELDS = (
    "policy", "conc", "hbm_blocks", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "ttft_p50_first_turn_s",
    "ttft_p99_first_turn_s", "ttft_p50_later_turns_s", "ttft_p99_later_turns_s", "ttft_mean_later_turns_s",
    "makespan_s", "interactivity_p50",
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
        "ttft_mean_later_turns_s": sum(later) / len(later) if later else math.nan,
        "makespan_s": result.makespan_s,
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


CODEC_COLUMNS = (("cold_codec", "codec"), ("cold_codec_ratio", "ratio"), ("dram_blocks_effective", "dram_blk"),
                 ("ssd_blocks_effective", "ssd_blk"))


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """A fixed-width table, one line per (policy, conc, capacity) point (with a
    cold codec: the codec, its ratio and the blocks DRAM and SSD hold)."""
    columns = TABLE_COLUMNS[:3] + (CODEC_COLUMNS if any("cold_codec" in r for r in rows) else ()) + TABLE_COLUMNS[3:]
    header = [h for _, h in columns]
    body = [[_cell(k, r.get(k)) for k, _ in columns] for r in rows]
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
    if key == "cold_codec_ratio":
        return f"{v:.2f}"
    if isinstance(v, float):
        return f"{v:.3f}" if v < 100 else f"{v:.0f}"
    return str(v)


def tiers_cell(r: dict[str, Any]) -> str:
    """The tiers a policy used, and those it was offered but does not use."""
    used, offered = r.get("tiers_used") or [], r.get("tiers_offered") or []
    unused = [t for t in offered if t not in used]
    return "+".join(used) + (f" (no {'/'.join(unused)})" if unused else "")


SUMMARY_HEADER = ("policy", "tiers used", "computed", "vs lru", "vs bound", "TTFT p99 later (s)",
                  "tok/s/chip", "hit hbm", "hit dram", "hit ssd")


def summary_rows(rows: Sequence[dict[str, Any]]) -> list[list[str]]:
    """One line per policy of one (conc, capacity) group: prefill computed vs
    ``lru`` and vs the bound, later-turn TTFT p99, throughput per chip, hits per tier."""
    lru = next((r for r in rows if r["policy"] == "lru"), None)
    out = []
    for r in rows:
        c = r["prefill_tokens_computed"]
        vs_lru = f"{c / lru['prefill_tokens_computed']:.3f}x" if lru and lru["prefill_tokens_computed"] else "-"
        vs_bound = f"{r['computed_over_bound']:.3f}x" if r.get("computed_over_bound") else "-"
        out.append([r["policy"], tiers_cell(r), f"{c / 1e6:.2f}M", vs_lru, vs_bound,
                    _cell("x", r["ttft_p99_later_turns_s"]), f"{r['throughput_per_chip_tok_s']:.0f}",
                    _cell("hit_rate", r["hit_rate_hbm"]), _cell("hit_rate", r["hit_rate_dram"]),
                    _cell("hit_rate", r["hit_rate_ssd"])])
    return out


def codec_caption(r: dict[str, Any]) -> str:
    """``; cold codec ...``: the codec, its ratio and the blocks DRAM and SSD hold ("" without one)."""
    if "cold_codec" not in r:
        return ""
    if r["cold_codec"] == "raw":
        return "; cold codec raw (stored as is)"
    held = [f"{t.upper()} holds {r[f'{t}_blocks_effective']:,} blocks" for t in ("dram", "ssd")
            if r.get(f"{t}_blocks") and t in r["cold_codec_tiers"]]
    cores = f"{r['codec_cores']} core{'s' if r['codec_cores'] != 1 else ''} per direction"
    return (f"; cold codec {r['cold_codec']} on {'+'.join(r['cold_codec_tiers'])} (ratio {r['cold_codec_ratio']:.2f}, "
            f"{cores})" + (f": {', '.join(held)}" if held else ""))


def total_blocks(r: dict[str, Any]) -> int:
    """Blocks a row's tiers hold together (a cold codec's effective DRAM and SSD capacities)."""
    return r["hbm_blocks"] + sum(r.get(f"{t}_blocks_effective", r.get(f"{t}_blocks", 0)) or 0 for t in ("dram", "ssd"))


def group_caption(r: dict[str, Any]) -> str:
    """What one (conc, capacity) group was given and its references."""
    ssd = f"SSD {r['ssd_blocks']:,}" if r.get("ssd_blocks") else "SSD off"
    text = (f"conc {r['conc']}, HBM {r['hbm_blocks']:,} + DRAM {r.get('dram_blocks', 0):,} blocks, {ssd}"
            f"{codec_caption(r)}; admission {r.get('admission', 'fcfs')}, scheduler {r.get('scheduler', 'plain')}")
    if r.get("bound_prefill_tokens") is not None:
        est = "exact" if r.get("bound_exact") else "estimate"
        text += (f"; floor (unbounded cache) {r['floor_prefill_tokens'] / 1e6:.2f}M, bound (Belady over all "
                 f"{total_blocks(r):,} blocks as one tier, "
                 f"{est}) {r['bound_prefill_tokens'] / 1e6:.2f}M, LRU over that one tier "
                 f"{r['lru_one_tier_prefill_tokens'] / 1e6:.2f}M prefill tokens computed")
        if r.get("floor_ttft_p99_later_turns_s") is not None:
            text += (f"; later-turn TTFT p99 of the floor {r['floor_ttft_p99_later_turns_s']:.1f} s, of the bound "
                     f"{r['bound_ttft_p99_later_turns_s']:.1f} s (the queue for HBM no placement removes)")
    if r.get("skipped_requests"):
        text += f"; {r['skipped_requests']:,} oversized requests skipped alike in every run"
    return text


def _fixed(header: Sequence[str], body: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(header)]
    return ["  ".join(h.rjust(w) for h, w in zip(header, widths))] + [
        "  ".join(c.rjust(w) for c, w in zip(b, widths)) for b in body]


def group_by_point(rows: Sequence[dict[str, Any]]) -> dict[tuple[int, int], list[dict[str, Any]]]:
    groups: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["hbm_blocks"], r["conc"]), []).append(r)
    return groups


def sweep_rows(rows: Sequence[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """Prefill computed over the bound per policy (rows) and (capacity, conc) point (columns)."""
    groups = group_by_point(rows)
    header = ["policy"] + [f"hbm {h:,} conc {c}" for h, c in groups]
    body = [[pol] + [next((f"{r['computed_over_bound']:.3f}" for r in g if r["policy"] == pol
                           and r.get("computed_over_bound")), "-") for g in groups.values()]
            for pol in dict.fromkeys(r["policy"] for r in rows)]
    body.append(["floor"] + [f"{g[0]['floor_prefill_tokens'] / g[0]['bound_prefill_tokens']:.3f}"
                             if g[0].get("bound_prefill_tokens") else "-" for g in groups.values()])
    return header, body


def main_point(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows of the point a summary details: the only one, else the middle of the sweep."""
    groups = list(group_by_point(rows).values())
    return groups[len(groups) // 2]


def format_summary(rows: Sequence[dict[str, Any]]) -> str:
    """The default output of ``kvtier replay``: with several (capacity, conc)
    points, prefill computed / bound per policy and point; then, for one point
    (the only one, else the middle of the sweep), its caption and one line per
    policy. ``--full`` prints every figure of every point."""
    if rows and "engines" in rows[0]:
        return format_fleet_summary(rows)
    groups = list(group_by_point(rows).values())
    parts = []
    if len(groups) > 1:
        header, body = sweep_rows(rows)
        parts.append("\n".join(["prefill computed / bound (1.000 = the offline bound; floor = unbounded cache):",
                                 *_fixed(header, body)]))
    grp = main_point(rows)
    parts.append("\n".join([group_caption(grp[0]) + ":", *_fixed(SUMMARY_HEADER, summary_rows(grp))]))
    return "\n\n".join(parts)


FLEET_HEADER = ("policy", "routing", "remote", "computed", "vs lru", "TTFT p50 (s)", "TTFT p99 (s)",
                "TTFT p99 later (s)", "remote written GB", "remote read GB")


def format_fleet_summary(rows: Sequence[dict[str, Any]]) -> str:
    """A fleet replay (rows with ``engines``): per (capacity, conc) group, its
    caption and one line per policy with the routing, the remote tier and the
    bytes on the engines' remote links (written, read). Modelled figures."""
    parts = []
    for grp in group_by_point(rows).values():
        r0 = grp[0]
        remote = (f"remote tier {r0['remote_blocks']:,} blocks shared, {r0['remote_gbps']:g} GB/s per engine link"
                  if r0["remote"] else "no remote tier")
        ssd = f"SSD {r0['ssd_blocks']:,}" if r0.get("ssd_blocks") else "SSD off"
        caption = (f"MODELLED fleet: {r0['engines']} engine{'s' if r0['engines'] != 1 else ''}, each HBM {r0['hbm_blocks']:,} + DRAM "
                   f"{r0.get('dram_blocks', 0):,} blocks, {ssd}{codec_caption(r0)}; {r0['conc']} live sessions over "
                   f"the fleet; routing {r0['routing']}; {remote}"
                   f"{' (raw)' if r0['remote'] and 'cold_codec' in r0 else ''}; "
                   f"admission {r0.get('admission', 'fcfs')}")
        if r0.get("skipped_requests"):
            caption += f"; {r0['skipped_requests']:,} oversized requests skipped alike in every run"
        caption += ":"
        lru = next((r for r in grp if r["policy"] == "lru"), None)
        body = []
        for r in grp:
            c = r["prefill_tokens_computed"]
            vs_lru = f"{c / lru['prefill_tokens_computed']:.3f}x" if lru and lru["prefill_tokens_computed"] else "-"
            body.append([r["policy"], r["routing"], "on" if r["remote"] else "off", f"{c / 1e6:.2f}M", vs_lru,
                         _cell("x", r["ttft_p50_s"]), _cell("x", r["ttft_p99_s"]),
                         _cell("x", r["ttft_p99_later_turns_s"]), f"{r['remote_bytes_written'] / 1e9:.1f}",
                         f"{r['remote_bytes_read'] / 1e9:.1f}"])
        parts.append("\n".join([caption, *_fixed(FLEET_HEADER, body)]))
    return "\n\n".join(parts)


def plot(results: Sequence[dict[str, Any]], path: str, title: str) -> None:
    """Prefill computed over the bound, and later-turn TTFT p99, per policy
    against the swept axis (HBM capacity, else conc); with one point per
    policy, bars. Writes a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    axis = "hbm_blocks" if len({r["hbm_blocks"] for r in results}) > 1 else "conc"
    xlabel = "HBM capacity (blocks; DRAM and SSD as given)" if axis == "hbm_blocks" else "conc (live sessions)"
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    policies = list(dict.fromkeys(r["policy"] for r in results))
    ykey = "computed_over_bound" if all(r.get("computed_over_bound") for r in results) else "prefill_tokens_computed"
    if len({r[axis] for r in results}) == 1:  # one point per policy: bars
        for a, key in ((ax, ykey), (ax2, "ttft_p99_later_turns_s")):
            a.bar(policies, [next(r[key] for r in results if r["policy"] == p) for p in policies])
            a.tick_params(axis="x", rotation=45)
    else:
        for pol in policies:
            pts = sorted((r for r in results if r["policy"] == pol), key=lambda r: r[axis])
            ax.plot([r[axis] for r in pts], [r[ykey] for r in pts], marker="o", label=pol)
            ax2.plot([r[axis] for r in pts], [r["ttft_p99_later_turns_s"] for r in pts], marker="o", label=pol)
        if ykey == "computed_over_bound":
            refs = sorted({(r[axis], r["floor_prefill_tokens"] / r["bound_prefill_tokens"]) for r in results})
            ax.plot([x for x, _ in refs], [y for _, y in refs], "k--", label="floor (unbounded cache)")
        from matplotlib.ticker import NullFormatter

        xs = sorted({r[axis] for r in results})
        for a in (ax, ax2):
            a.set_xlabel(xlabel)
            a.set_xscale("log", base=2)
            a.set_xticks(xs, [f"{x:,}" for x in xs])
            a.xaxis.set_minor_formatter(NullFormatter())
        ax.legend(fontsize=8)
    ax.set_ylabel("prefill computed / bound (Belady over all tiers as one)" if ykey == "computed_over_bound"
                  else "prefill tokens computed")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_title("prefill work over the offline bound (1.0 = bound)")
    ax2.set_ylabel("TTFT p99, later turns (s)")
    ax2.set_yscale("log")
    ax2.set_title("later-turn TTFT p99")
    for a in (ax, ax2):
        a.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
