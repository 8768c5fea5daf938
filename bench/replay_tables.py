"""Renderers of the README's ``kvtier replay`` tables (registered with ``readme_tables``).

Owns: how a replay report (``bench/out/replay-*.json``, written by
``bench/replay_results.py``) reads as markdown: a caption with what every
policy was given and the two references, then one row per policy with
prefill computed vs ``lru`` and vs the bound. Must not run replays.
"""

from __future__ import annotations

from typing import Any

from readme_tables import md_table, table


def _caption(report: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    r = rows[0]
    w = report["workload"]
    ssd = f"SSD {r['ssd_blocks']:,} blocks" if r.get("ssd_blocks") else "no SSD"
    est = "exact" if r.get("bound_exact") else "an estimate at conc > 1"
    total = r["hbm_blocks"] + r.get("dram_blocks", 0) + r.get("ssd_blocks", 0)
    skipped = f" {r['skipped_requests']:,} oversized requests skipped alike in every run." \
        if r.get("skipped_requests") else ""
    return (f"`{report['command']}`: {w['sessions']} sessions, {w['requests']:,} requests, "
            f"{w['distinct_blocks']:,} distinct blocks of {report['block_size']} tokens; profile {report['profile']}; "
            f"conc {r['conc']}; every policy offered HBM {r['hbm_blocks']:,} + DRAM {r.get('dram_blocks', 0):,} "
            f"blocks, {ssd}; admission {report.get('admission', 'fcfs')}.{skipped} References on the same run: "
            f"floor (unbounded cache) {r['floor_prefill_tokens'] / 1e6:.2f}M prefill tokens computed; bound "
            f"(Belady over all {total:,} blocks as one tier, {est}) {r['bound_prefill_tokens'] / 1e6:.2f}M; plain "
            f"LRU over that one tier {r['lru_one_tier_prefill_tokens'] / 1e6:.2f}M. "
            f"Replay wall time {report.get('bench_wall_s', report.get('wall_s', 0)):.0f} s on 2 cores.\n\n")


def _tiers(r: dict[str, Any]) -> str:
    unused = [t for t in r["tiers_offered"] if t not in r["tiers_used"]]
    return "+".join(r["tiers_used"]) + (f" (not {', '.join(unused)})" if unused else "")


def _rate(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def policy_table(report: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    lru = next(r for r in rows if r["policy"] == "lru")["prefill_tokens_computed"]
    best = min(r["prefill_tokens_computed"] for r in rows)
    body = []
    for r in rows:
        c = r["prefill_tokens_computed"]
        name = f"**{r['policy']}**" if c == best else r["policy"]
        body.append([name, _tiers(r), f"{c / 1e6:.2f}", f"{c / lru:.3f}x", f"{r['computed_over_bound']:.3f}x",
                     f"{r['ttft_p99_later_turns_s']:.1f}", f"{r['throughput_per_chip_tok_s']:.0f}",
                     _rate(r["hit_rate_hbm"]), _rate(r["hit_rate_dram"]), _rate(r["hit_rate_ssd"])])
    head = ["policy", "tiers used", "prefill computed (M tok)", "vs lru", "vs bound", "later-turn TTFT p99 (s)",
            "tok/s/chip", "HBM hit rate", "DRAM", "SSD"]
    return _caption(report, rows) + md_table(head, body)


def _point(report: dict[str, Any], index: int | None = None) -> list[dict[str, Any]]:
    groups: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for r in report["results"]:
        groups.setdefault((r["hbm_blocks"], r["conc"]), []).append(r)
    keys = sorted(groups)
    return groups[keys[len(keys) // 2 if index is None else index]]


for _name in ("dev-eval", "dev-eval-ssd", "dev-tune", "dev-tune-ssd", "default"):
    table(f"replay-{_name}", f"replay-{_name}.json")(lambda rep: policy_table(rep, _point(rep)))


@table("replay-default-sweep", "replay-default.json")
def default_sweep(report: dict[str, Any]) -> str:
    """Prefill computed over the bound, per policy and HBM capacity."""
    groups: dict[int, list[dict[str, Any]]] = {}
    for r in report["results"]:
        groups.setdefault(r["hbm_blocks"], []).append(r)
    caps = sorted(groups)
    policies = list(dict.fromkeys(r["policy"] for r in report["results"]))
    body = [[p] + [f"{next(r['computed_over_bound'] for r in groups[c] if r['policy'] == p):.3f}" for c in caps]
            for p in policies]
    body.append(["floor (unbounded cache)"] + [
        f"{groups[c][0]['floor_prefill_tokens'] / groups[c][0]['bound_prefill_tokens']:.3f}" for c in caps])
    head = ["prefill computed / bound"] + [f"HBM {c:,}" for c in caps]
    return md_table(head, body)


@table("tune-kvtier", "tune-kvtier.json")
def tune_kvtier(data: dict[str, Any]) -> str:
    """The tuning half's search of KVTier.demote_after_s (bench/tune_kvtier.py)."""
    body = []
    for r in data["rows"]:
        v = "never" if r["demote_after_s"] is None else f"{r['demote_after_s']:g} s"
        chosen = r["demote_after_s"] == data["chosen_demote_after_s"]
        body.append([f"**{v}** (shipped)" if chosen else v, f"{r['prefill_tokens_computed'] / 1e6:.3f}",
                     f"{r['ttft_p99_later_turns_s']:.1f}"])
    caption = (f"Tuning half ({data['sessions']} sessions), HBM {data['hbm_blocks']:,}, DRAM {data['dram_blocks']:,}, "
               f"SSD {data['ssd_blocks']:,} blocks, conc {data['conc']}:\n\n")
    return caption + md_table(["demote a wait predicted at least", "prefill computed (M tok)",
                               "later-turn TTFT p99 (s)"], body)
