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


_APPS = ("mixed", "code-writer", "deep-research")
_ORDERS = {"critical-first": ("lru", "tokencake"), "oldest-app": ("lru", "kvtier")}


@table("apps", tuple(f"replay-apps-{a}{o}.json" for a in _APPS for o in ("", *(f"-{k}" for k in _ORDERS))))
def apps(data: dict[str, Any]) -> str:
    """Mean application latency per policy and application shape; FCFS admission for
    every placement policy, then each other admission order as rows of its own."""

    def rows_of(app: str, order: str = "") -> dict[str, dict[str, Any]]:
        return {r["policy"]: r for r in data[f"replay-apps-{app}{order}.json"]["results"]}

    base = {a: rows_of(a)["lru"]["e2e_mean_s"] for a in _APPS}

    def cells(get: Any) -> list[str]:
        out = []
        for a in _APPS:
            r = get(a)
            out.append(f"{r['e2e_mean_s']:.0f} ({r['e2e_mean_s'] / base[a]:.3f}x)")
        return out

    body = [[p, "fcfs"] + cells(lambda a, p=p: rows_of(a)[p]) + [f"{rows_of('mixed')[p]['computed_over_bound']:.3f}x"]
            for p in rows_of("mixed")]
    for order, policies in _ORDERS.items():
        body += [[p, order] + cells(lambda a, p=p, o=order: rows_of(a, f"-{o}")[p]) + ["-"] for p in policies]
    mixed = data["replay-apps-mixed.json"]
    r0 = mixed["results"][0]
    caption = (f"`{mixed['command']}` (and `--app code-writer`, `--app deep-research`; the admission rows add "
               f"`--admission ORDER`): HBM {r0['hbm_blocks']:,}, DRAM {r0['dram_blocks']:,}, SSD "
               f"{r0['ssd_blocks']:,} blocks. Mean end-to-end application latency in seconds (vs `lru` with FCFS "
               f"admission); prefill computed over the bound on `mixed`.\n\n")
    return caption + md_table(["policy", "admission", *_APPS, "mixed: computed / bound"], body)


@table("slo-dev-eval", "replay-slo-dev-eval.json")
def slo_dev_eval(report: dict[str, Any]) -> str:
    """SLO capacity per policy: the largest conc meeting both SLOs, with the figures there and one step beyond."""
    body = []
    for row in report["slo"]:
        pts = {p["conc"]: p for p in row["points"]}
        ok = pts.get(row["max_conc"])
        over = min((c for c in pts if c > row["max_conc"]), default=None)

        def fig(p: dict[str, Any] | None) -> str:
            return "-" if p is None else f"{p['ttft_p99_later_turns_s']:.1f} s, {p['interactivity_p50']:.0f} tok/s"

        body.append([row["policy"], str(row["max_conc"]), fig(ok), "-" if over is None else f"conc {over}: "
                     + fig(pts[over])])
    first = report["slo"][0]
    p0 = first["points"][0]
    ssd = f"SSD {p0['ssd_blocks']:,}" if p0.get("ssd_blocks") else "no SSD"
    caption = (f"`{report['command']}`: HBM {first['hbm_blocks']:,} blocks, DRAM {p0['dram_blocks']:,}, {ssd}; "
               f"evaluation half "
               f"({report['workload']['sessions']} sessions, so conc is at most that); SLO: later-turn TTFT p99 <= "
               f"{first['slo_ttft_p99_s']:g} s and p50 interactivity >= {first['slo_interactivity']:g} tokens/s/user."
               "\n\n")
    return caption + md_table(["policy", "SLO capacity (conc)", "at that conc: TTFT p99 later, interactivity",
                               "first conc that misses"], body)
