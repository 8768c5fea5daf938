"""Renderers of the README's ``kvtier replay`` tables (registered with ``readme_tables``).

Owns: how a replay report (``bench/out/replay-*.json``, written by
``bench/replay_results.py``) reads as markdown: a caption with what every
policy was given and the two references, then one row per policy with
prefill computed vs ``lru`` and vs the bound; and the ``kvtier tune`` runs on
the dev traces (``bench/out/tune-dev*.json``, written by the commands their
caption shows). Must not run replays.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from readme_tables import md_table, table

from kvtier.replay.report import SUMMARY_HEADER, group_caption, main_point, summary_rows, sweep_rows
from kvtier.placement.surface import LIVE


SHIPPED = "kvtier"
"""The policy kvtier ships (the connector's default placement): the README's bold row."""
FAIR = "lru-dram"
"""The fair baseline: the same DRAM, written through, LRU (vLLM's CPU offloading and LMCache's default)."""


def policy_table(report: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """The replay's own summary of one point as markdown, the shipped policy in bold and a
    column against the fair baseline (``lru-dram``), after a caption naming the command, the
    workload and the wall time, and one sentence of what the shipped policy wins against
    that baseline (prefill computed, later-turn TTFT p99, against the bound)."""
    w = report["workload"]
    caption = (f"`{report['command']}`: {w['sessions']} sessions, {w['requests']:,} requests, "
               f"{w['distinct_blocks']:,} distinct blocks of {report['block_size']} tokens; profile "
               f"{report['profile']}; {group_caption(rows[0])}. Replay wall time "
               f"{report.get('bench_wall_s', report.get('wall_s', 0)):.0f} s on 2 cores.")
    by_name = {r["policy"]: r for r in rows}
    ship, fair = by_name.get(SHIPPED), by_name.get(FAIR)
    if ship is not None and fair is not None and fair["prefill_tokens_computed"]:
        c, f = ship["prefill_tokens_computed"], fair["prefill_tokens_computed"]
        bound = rows[0].get("bound_prefill_tokens")
        share = abs(1 - c / f)
        caption += (f" **{SHIPPED}** (bold, the shipped policy) computes {share:.0%}" if share >= 0.095 else
                    f" **{SHIPPED}** (bold, the shipped policy) computes {share:.1%}")
        caption += (f" {'less' if c <= f else 'more'} prefill than {FAIR} with the same tiers ({c / 1e6:.2f}M "
                    f"against {f / 1e6:.2f}M)" + (f", {c / bound:.3f}x the bound" if bound else "") +
                    f"; later-turn TTFT p99 {ship['ttft_p99_later_turns_s']:.1f} s against "
                    f"{fair['ttft_p99_later_turns_s']:.1f} s.")
    header = list(SUMMARY_HEADER)
    at = header.index("vs lru") + 1
    header.insert(at, f"vs {FAIR}")
    body = summary_rows(rows)
    for r, line in zip(rows, body):
        f = fair["prefill_tokens_computed"] if fair is not None else 0
        line.insert(at, f"{r['prefill_tokens_computed'] / f:.3f}x" if f else "-")
        if r["policy"] == SHIPPED:
            line[0] = f"**{line[0]}**"
    return caption + "\n\n" + md_table(header, body)


for _name in ("dev-eval", "dev-eval-ssd", "dev-eval-ssd-vllm", "dev-tune", "dev-tune-ssd", "dev-eval-pressure",
              "dev-tune-pressure", "default"):
    table(f"replay-{_name}", f"replay-{_name}.json")(lambda rep: policy_table(rep, main_point(rep["results"])))


@table("replay-default-sweep", "replay-default.json")
def default_sweep(report: dict[str, Any]) -> str:
    """Prefill computed over the bound, per policy and (HBM capacity, conc) point."""
    header, body = sweep_rows(report["results"])
    return md_table(header, body)


@table("tune-kvtier", "tune-kvtier.json")
def tune_kvtier(data: dict[str, Any]) -> str:
    """The tuning half's search of KVTier.next_use_trust and KVTier.user_wait_s (bench/tune_kvtier.py)."""
    concs = data["concs"]
    body = []
    for r in data["rows"]:
        pair = (r["next_use_trust"], r["user_wait_s"])
        trust, wait = f"{pair[0]:g}", f"{pair[1]:g}" if pair[0] else "(any)"
        if pair == (data["chosen_next_use_trust"], data["chosen_user_wait_s"]):
            trust, wait = f"**{trust}**", f"**{wait}** (shipped)"
        body.append([trust, wait] + [f"{r[f'conc{c}_prefill_tokens_computed'] / 1e6:.2f}" for c in concs]
                    + [f"{r[f'conc{c}_ttft_p99_later_turns_s']:.1f}" for c in concs])
    caption = (f"Tuning half ({data['sessions']} sessions), HBM {data['hbm_blocks']:,}, DRAM {data['dram_blocks']:,} "
               f"blocks, no SSD, conc {' and '.join(map(str, concs))}:\n\n")
    return caption + md_table(["trust in the predicted wait", "user_wait_s"]
                              + [f"prefill computed, conc {c} (M tok)" for c in concs]
                              + [f"later-turn TTFT p99, conc {c} (s)" for c in concs], body)


_PARTS = {"tune-fold-1": "tuning half, fold 1", "tune-fold-2": "tuning half, fold 2", "tune": "tuning half",
          "eval": "evaluation half (reported, never chosen on)"}


def _pair(pair: list[float]) -> str:
    return f"trust {pair[0]:g}, user_wait_s {pair[1]:g}" if pair[0] else "trust 0"


@table("tune-kvtier-generalise", "tune-kvtier-generalise.json")
def tune_kvtier_generalise(data: dict[str, Any]) -> str:
    """How the tuning of KVTier's two constants carries (bench/tune_kvtier.py --generalise): the pair each part
    would choose, and what each choice costs on the other parts over their own optimum."""
    parts = data["parts"]
    body = []
    for name, part in parts.items():
        body.append([_PARTS.get(name, name), str(part["sessions"]), f"{part['hbm_blocks']:,}", _pair(part["chosen"]),
                     f"{part['spread']:.1%}", f"{part['shipped_excess']:+.2%}"]
                    + [f"{parts[k]['excess_on'][name]:+.2%}" if k in parts else "(not run)"
                       for k in ("tune-fold-1", "tune-fold-2", "tune")])
    caption = (f"`python bench/tune_kvtier.py --generalise` at commit {str(data.get('commit'))[:7]} "
               f"({data['wall_s'] / 60:.0f} min on 1 core): the grid of the table above on each part of the dev traces, "
               f"`--surface {data['surface']} --scheduler {data['scheduler']}`, "
               f"conc {' and '.join(map(str, data['concs']))}, "
               f"HBM at `--hbm-fraction {data['hbm_fraction']:g}` of each part at conc 8, DRAM 2x HBM, no SSD. "
               f"A pair's score is its prefill computed at both points; excess is over that part's best pair. "
               f"Shipped: {_pair(data['shipped'])}.\n\n")
    text = caption + md_table(["part", "sessions", "HBM blocks", "it would choose", "grid's spread",
                               "shipped pair's excess", "excess of fold 1's choice", "excess of fold 2's choice",
                               "excess of the tuning half's choice"], body)
    folds = [parts[k] for k in ("tune-fold-1", "tune-fold-2") if k in parts]
    if len(folds) == 2:  # the pair that holds on both folds: least worst excess over them
        worst = {}
        for fold in folds:
            scores = {(r["next_use_trust"], r["user_wait_s"]):
                      sum(r[f"conc{c}_prefill_tokens_computed"] for c in data["concs"]) for r in fold["rows"]}
            optimum = min(scores.values())
            for pair, score in scores.items():
                worst[pair] = max(worst.get(pair, 0.0), score / optimum - 1)
        robust = min(worst, key=lambda p: (worst[p], p))
        shipped = tuple(data["shipped"])
        text = text.rstrip("\n") + (f"\n\nThe pair that holds on both folds (least worst excess over the two): {_pair(list(robust))}, "
                 f"at most {worst[robust]:+.2%}; the shipped pair: at most {worst.get(shipped, float('nan')):+.2%}.\n")
    return text


_TUNE_DEV = ("tune-dev.json", "tune-dev-pressure.json")


@table("tune-dev", _TUNE_DEV)
def tune_dev(runs: dict[str, Any]) -> str:
    """``kvtier tune`` on the dev traces at two points: the winner against the defaults on both halves."""
    lines, body = [], []
    for name in _TUNE_DEV:
        data = runs[name]
        st = data["settings"]
        cap = (f"--hbm-blocks {st['hbm_blocks']}" if st.get("hbm_blocks") else f"--hbm-fraction {st['hbm_fraction']:g}")
        point = f"conc {st['conc']}, HBM {data['hbm_blocks']:,} + DRAM {data['dram_blocks']:,}"
        lines.append(f"- {point}: `kvtier tune --trace {Path(st['trace']).name} --holdout {st['holdout']} {cap} "
                     f"--conc {st['conc']} --skip-oversized --candidates {st['candidates']} --rungs {st['rungs']}` "
                     f"({sum(len(r) for r in data['rungs'])} replays, {data['elapsed_s'] / 60:.0f} min on 2 cores); "
                     f"winner `{data['best']}`")
        for part, where in (("in_sample", "tuning half"), ("holdout", "evaluation half (held out)")):
            b, d = data[part]["best"], data[part]["default"]
            row = [point, where]
            for key, fmt, scale in (("prefill_tokens_computed", "{:.2f}M", 1e6),
                                    ("ttft_p99_later_turns_s", "{:.1f} s", 1)):
                change = f" ({b[key] / d[key] - 1:+.1%})" if d[key] else ""
                row += [fmt.format(d[key] / scale), fmt.format(b[key] / scale) + change]
            body.append(row)
    caption = (f"{runs[_TUNE_DEV[0]]['tune_sessions']} sessions to tune on, "
               f"{runs[_TUNE_DEV[0]]['holdout_sessions']} held out; no SSD; objective prefill computed.\n\n"
               + "\n".join(lines) + "\n\n")
    return caption + md_table(["point", "sessions", "prefill computed, defaults", "prefill computed, tuned",
                               "later-turn TTFT p99, defaults", "later-turn TTFT p99, tuned"], body)


_ABLATIONS = ("kvtier", "kvtier-inclusive", "kvtier-lru-order", "kvtier-no-dead", "kvtier-space-only",
              "kvtier-time-only")
_ABLATION_POINTS = ("dev-tune", "dev-tune-pressure", "dev-eval", "dev-eval-pressure")


@table("ablation", tuple(f"replay-{p}.json" for p in _ABLATION_POINTS))
def ablation(data: dict[str, Any]) -> str:
    """Each kvtier mechanism off in turn: computed over the bound and later-turn TTFT p99,
    at both points of both halves."""
    rows = {p: {r["policy"]: r for r in data[f"replay-{p}.json"]["results"]} for p in _ABLATION_POINTS}
    body = []
    for pol in (*_ABLATIONS, "lru-dram"):
        body.append([pol] + [f"{rows[p][pol]['computed_over_bound']:.3f}x, {rows[p][pol]['ttft_p99_later_turns_s']:.1f} s"
                             for p in _ABLATION_POINTS])
    refs = [data[f"replay-{p}.json"]["results"][0] for p in _ABLATION_POINTS]
    if all(r.get("floor_ttft_p99_later_turns_s") is not None for r in refs):  # (references with TTFT)
        body.append(["bound"] + [f"1.000x, {r['bound_ttft_p99_later_turns_s']:.1f} s" for r in refs])
        body.append(["floor (unbounded cache)"] + [f"{r['floor_prefill_tokens'] / r['bound_prefill_tokens']:.3f}x, "
                                                   f"{r['floor_ttft_p99_later_turns_s']:.1f} s" for r in refs])
    heads = []
    for p in _ABLATION_POINTS:
        r0 = data[f"replay-{p}.json"]["results"][0]
        half = "tuning" if "tune" in p else "evaluation"
        heads.append(f"{half} half, conc {r0['conc']}, HBM {r0['hbm_blocks']:,}")
    caption = ("Prefill computed over the bound, and later-turn TTFT p99, with one mechanism off at a time "
               "(rows: `kvtier-inclusive` writes DRAM through instead of keeping it exclusive; `kvtier-lru-order` "
               "orders every tier by LRU instead of predicted next use; `kvtier-no-dead` keeps dead KV; "
               "`kvtier-space-only` / `kvtier-time-only` drop the tool-wait prefetch and queue staging / the critical-path "
               "reserve; `bound` and `floor` are the references, the floor a cache that never evicts under the same "
               "admission). DRAM 2x HBM, no SSD; from the `dev-*` JSON of `bench/replay_results.py`.\n\n")
    return caption + md_table(["policy", *heads], body)


_PEERS = {"lru-dram": "`lru-dram`: vLLM CPU offloading / LMCache by default (LRU, written through)",
          "sae": "`sae`: vLLM session-aware eviction (PR #50422; modelled only)",
          "lmcache-lazy": "`lmcache-lazy`: LMCache eviction-aware lazy offload (PR #4847)",
          "vllm-tiering": "`vllm-tiering`: vLLM session lifecycle, pressure-gated stores (PR #48837; modelled only)",
          "tokencake": "`tokencake`: TokenCake (arXiv 2510.18586)",
          "kvflow": "`kvflow`: KVFlow (arXiv 2507.07400)",
          "kvtier": "**`kvtier`** (recommended live setup: the connector's defaults)"}
_PEER_POINTS = ("peers-tune", "peers-tune-pressure", "peers-eval", "peers-eval-pressure")


@table("peers", tuple(f"replay-{p}.json" for p in _PEER_POINTS))
def peers(data: dict[str, Any]) -> str:
    """kvtier against the peers' models at the four dev points: computed over the bound and
    later-turn TTFT p99, with the bound and the floor."""
    rows = {p: {r["policy"]: r for r in data[f"replay-{p}.json"]["results"]} for p in _PEER_POINTS}
    body = [[label] + [f"{rows[p][pol]['computed_over_bound']:.3f}x, {rows[p][pol]['ttft_p99_later_turns_s']:.1f} s"
                       for p in _PEER_POINTS] for pol, label in _PEERS.items()]
    refs = [data[f"replay-{p}.json"]["results"][0] for p in _PEER_POINTS]
    body.append(["bound"] + [f"1.000x, {r['bound_ttft_p99_later_turns_s']:.1f} s" for r in refs])
    body.append(["floor (unbounded cache)"] + [f"{r['floor_prefill_tokens'] / r['bound_prefill_tokens']:.3f}x, "
                                               f"{r['floor_ttft_p99_later_turns_s']:.1f} s" for r in refs])
    heads = []
    for p in _PEER_POINTS:
        r0 = refs[_PEER_POINTS.index(p)]
        half = "tuning" if "tune" in p else "evaluation"
        heads.append(f"{half} half, conc {r0['conc']}, HBM {r0['hbm_blocks']:,}")
    first = data[f"replay-{_PEER_POINTS[0]}.json"]
    dirty = " with uncommitted changes" if first.get("kvtier_dirty") else ""
    caption = ("Prefill computed over the bound, and later-turn TTFT p99, of each peer modelled from its code "
               "(`kvtier.placement.peers`, the research systems in `kvtier.placement.agent`; what is not modelled "
               "is in each docstring) and of kvtier, all on the "
               f"live surface (`--surface {refs[0]['surface']}`) and vLLM's scheduler (`--scheduler "
               f"{refs[0]['scheduler']}`), DRAM 2x HBM, no SSD; from the `peers-*` JSON of "
               f"`bench/replay_results.py` (commit {first['commit'][:7]}{dirty}, e.g. `{first['command']}`).\n\n")
    return caption + md_table(["policy", *heads], body)


@table("mooncake", "replay-mooncake.json")
def mooncake(report: dict[str, Any]) -> str:
    """Plain chat, open loop: kvtier against lru-dram at each HBM capacity, with the bound."""
    by = {}
    for r in report["results"]:
        by.setdefault(r["hbm_blocks"], {})[r["policy"]] = r
    body = []
    for hbm, rows in sorted(by.items()):
        a, b = rows["lru-dram"], rows["kvtier"]
        body.append([f"{hbm:,}", f"{a['prefill_tokens_computed'] / 1e6:.2f}M ({a['computed_over_bound']:.3f}x)",
                     f"{b['prefill_tokens_computed'] / 1e6:.2f}M ({b['computed_over_bound']:.3f}x)",
                     f"{b['prefill_tokens_computed'] / a['prefill_tokens_computed']:.3f}"])
    w = report["workload"]
    caption = (f"`{report['command']}`: {w['sessions']:,} single-request sessions, {w['distinct_blocks']:,} distinct "
               f"blocks of {report['block_size']} tokens; DRAM 2x HBM, no SSD. Prefill computed (over the bound):\n\n")
    return caption + md_table(["HBM blocks", "lru-dram", "kvtier", "kvtier / lru-dram"], body)


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

        name = "floor (unbounded cache)" if row["policy"] == "floor" else row["policy"]
        body.append([name, str(row["max_conc"]), fig(ok), "-" if over is None else f"conc {over}: "
                     + fig(pts[over])])
    first = report["slo"][0]
    p0 = first["points"][0]
    ssd = f"SSD {p0['ssd_blocks']:,}" if p0.get("ssd_blocks") else "no SSD"
    caption = (f"`{report['command']}`: HBM {first['hbm_blocks']:,} blocks, DRAM {p0['dram_blocks']:,}, {ssd}; "
               f"evaluation half "
               f"({report['workload']['sessions']} sessions, so conc is at most that); SLO: later-turn TTFT p99 <= "
               f"{first['slo_ttft_p99_s']:g} s and p50 interactivity >= {first['slo_interactivity']:g} tokens/s/user. "
               "The floor is a cache that never evicts, under the same admission: no placement exceeds its capacity."
               "\n\n")
    return caption + md_table(["policy", "SLO capacity (conc)", "at that conc: TTFT p99 later, interactivity",
                               "first conc that misses"], body)


_FLEET_LABELS = {"round-robin": "round-robin, no remote tier", "round-robin+remote": "round-robin + remote tier",
                 "session": "sticky sessions, no remote tier", "kv-aware+remote": "kv-aware + remote tier"}


@table("fleet-dev", "fleet-dev.json")
def fleet_dev(data: dict[str, Any]) -> str:
    """``kvtier replay --engines 4`` on the dev traces' evaluation half (``bench/fleet_results.py``): four
    routing / remote-tier points per policy, ratios against round-robin without a remote tier."""
    st, base = data["settings"], data["baseline"]
    cap = (f"MODELLED. {st['engines']} engines, conc {st['conc']} over the fleet, {data['workload']['sessions']} "
           f"sessions / {data['workload']['requests']:,} requests of the evaluation half; per engine HBM "
           f"{st['hbm_blocks_per_engine']:,} blocks (25% of one engine's share of the working set) + DRAM "
           f"{st['dram_blocks_per_engine']:,}, no SSD; remote tier {st['remote_blocks']:,} blocks "
           f"({st['remote_blocks_is']}) at {st['remote_gbps_per_engine_link']:g} GB/s per engine "
           f"({st['remote_gbps_is']}). `{data['commands']['kv-aware+remote']['kvtier']}`\n\n")
    body = []
    for policy in st["policies"]:
        for point, label in _FLEET_LABELS.items():
            r, b = data["points"][point][policy], data["points"][base][policy]
            body.append([policy, label, f"{r['prefill_tokens_computed'] / 1e6:.1f}M",
                         f"{r['prefill_tokens_computed'] / b['prefill_tokens_computed']:.3f}x",
                         f"{r['ttft_p50_s']:.2f} / {r['ttft_p99_s']:.1f}", f"{r['ttft_p99_later_turns_s']:.1f}",
                         f"{r['ttft_p99_later_turns_s'] / b['ttft_p99_later_turns_s']:.3f}x",
                         f"{r['remote_bytes_written'] / 1e9:,.0f} / {r['remote_bytes_read'] / 1e9:,.0f}"])
    targets = "; ".join(f"{p}: kv-aware + remote computes {t['kv_aware_remote_over_round_robin']:.3f}x round-robin "
                        f"without ({'holds' if t['holds'] else 'MISSES'} the <= {t['target']}x target)"
                        for p, t in data["target"].items())
    return cap + md_table(["policy", "routing", "prefill computed", "vs round-robin", "TTFT p50 / p99 (s)",
                           "later-turn TTFT p99 (s)", "vs round-robin", "remote GB written / read"], body) \
        + f"\n{targets}.\n"


_BASE = "vllm-write-through"  # the write-through connector: the ablation adds to it (bench/surface_ablation.py)
_SURFACE_LABELS = {
    _BASE: "the vLLM connector with `exclusive_dram: false` (write-through, live)",
    "vllm": "+ exclusive DRAM, waiting agents' HBM re-queued, deferred loads: the recommended setup, the connector "
            "with `exclusive_dram: true` (live)",
    "vllm/agent-ends-unknown": "`vllm` where the client's hints are in `kv_transfer_params` only (`--agent-ends "
                               "unknown`): no hint server tells kvtier an agent is done, so a turn without a tool "
                               "call is a `turn_end` wait (live)",
    "vllm/tool-waits-announced": "`vllm` told each tool wait's true length (`--tool-waits announced`, an "
                                 "oracle) where every other row predicts it from the waits seen so far",
    "vllm/scheduler-vllm": "`vllm` with vLLM's admission (`--scheduler vllm`: only while the step has tokens "
                           "left, and a block allocated earlier in the step is a hit; the references and every "
                           "other row admit up to the running limit)",
    f"{_BASE}+exclusive+order+defer": "+ exclusive DRAM, HBM in the full next-use order, deferred loads",
    f"{_BASE}+exclusive+defer": "+ exclusive DRAM, deferred loads (the connector's `exclusive_dram` before it "
                                "ordered HBM)",
    f"{_BASE}+requeue": "+ waiting agents' HBM re-queued in next-use order (the part of the order vLLM allows)",
    f"{_BASE}+exclusive": "+ exclusive DRAM",
    f"{_BASE}+order": "+ HBM order by predicted next use",
    f"{_BASE}+drop": "+ dead HBM blocks freed",
    f"{_BASE}+prefetch": "+ prefetch into HBM",
    f"{_BASE}+defer": "+ defer until its blocks land",
    f"{_BASE}+exclusive+order": "+ exclusive DRAM and the order",
    f"{_BASE}+exclusive+drop": "+ exclusive DRAM, dead blocks freed",
    f"{_BASE}+all": "+ all five",
    "full": "full surface",
}
_DECISIONS = ("exclusive", "order", "drop", "prefetch", "defer")
_SURFACE_LABELS |= {"+".join([_BASE, *(d for d in _DECISIONS if d != left)]): f"+ all but {left}"
                    for left in _DECISIONS}
_SURFACE_POINTS = ("eval-conc8", "eval-pressure", "tune-conc8", "tune-pressure")


@table("replay-surface-ablation", "replay-surface-ablation.json")
def surface_ablation(data: dict[str, Any]) -> str:
    """``kvtier`` on ``--surface vllm-write-through`` (the write-through connector) with each
    full-surface decision added on its own (bench/surface_ablation.py), and on ``vllm`` (the
    recommended setup): prefill computed (over the bound) and later-turn TTFT p99 at both
    points of both halves, with lru-dram, the bound and the floor; then the share of the
    vllm-write-through -> full gap each closes."""
    pts = [data["points"][p] for p in _SURFACE_POINTS if p in data["points"]]

    def cell(computed: float, bound: float, ttft: float | None) -> str:
        return f"{computed / 1e6:.2f}M ({computed / bound:.3f}x), {ttft:.1f} s"

    body = []
    for s in data["surfaces"]:
        rows = [p["surfaces"][s] for p in pts]
        body.append([f"`{s}`", _SURFACE_LABELS.get(s, ""), "live" if s.split("/")[0] in LIVE else "modelled only"]
                    + [cell(r["prefill_tokens_computed"], r["bound_prefill_tokens"], r["ttft_p99_later_turns_s"])
                       for r in (_with_refs(row, p) for row, p in zip(rows, pts))])
    body.append(["`lru-dram`", f"on `{_BASE}`, for comparison", "live"]
                + [cell(p["lru-dram"]["prefill_tokens_computed"], p["references"]["bound_prefill_tokens"],
                        p["lru-dram"]["ttft_p99_later_turns_s"]) for p in pts])
    for name, key in (("bound", "bound"), ("floor (unbounded cache)", "floor")):
        body.append([name, "same run, same admission", "-"]
                    + [cell(p["references"][f"{key}_prefill_tokens"], p["references"]["bound_prefill_tokens"],
                            p["references"][f"{key}_ttft_p99_later_turns_s"]) for p in pts])
    heads = [f"{'evaluation' if p['half'] == 'eval' else 'tuning'} half, conc {p['references']['conc']}, "
             f"HBM {p['references']['hbm_blocks']:,}" for p in pts]
    first = pts[0]
    wall = sum(sum(p["wall_s"].values()) for p in pts)
    caption = (f"`kvtier` prefill computed (over the bound) and later-turn TTFT p99 with decisions of the full "
               f"surface added to the write-through connector, `--surface {_BASE}`: the recommended setup, "
               f"`vllm` (the connector's `exclusive_dram`: exclusive DRAM, waiting agents' HBM in next-use order, "
               f"deferred loads: live), each decision alone, exclusive DRAM "
               f"with the order or with dead blocks freed, all five, and all but each one. Dev traces ("
               + ", ".join(f"{p['workload']['sessions']} sessions in the "
                           f"{'evaluation' if p['half'] == 'eval' else 'tuning'} half" for p in pts[::2])
               + "), DRAM 2x HBM, no SSD, FCFS admission for every run, `--skip-oversized`. Written by "
               f"`python bench/surface_ablation.py`: per point, `{first['commands'][_BASE]}` (the references and "
               f"`lru-dram`; conc 16 points: `--hbm-blocks N --conc 16`, N the half's conc-8 HBM), then "
               f"`--policies kvtier --no-references --surface S` for every other surface S. "
               f"{sum(len(p['wall_s']) for p in pts)} replays, {wall / 60:.0f} min of replay wall time in all (two "
               f"at a time on 2 shared cores).\n\n")
    table_md = md_table(["surface", "adds", "runs", *heads], body)
    # what each surface changes: the share of the base -> full prefill gap it closes, and TTFT p99 over the base's
    # (a share of the TTFT gap would mislead where the gap is a fraction of a second)
    gap_body = []
    for s in data["surfaces"]:
        if s == _BASE:
            continue
        cells = []
        for p in pts:
            v, f, r = p["surfaces"][_BASE], p["surfaces"]["full"], p["surfaces"][s]
            key = "prefill_tokens_computed"
            share = (v[key] - r[key]) / (v[key] - f[key]) if v[key] != f[key] else float("nan")
            cells.append(f"{share:+.0%}, {r['ttft_p99_later_turns_s'] / v['ttft_p99_later_turns_s']:.2f}x")
        gap_body.append([f"`{s}`", *cells])
    gap = (f"\nWhat each surface changes against `{_BASE}`: the share of the gap in prefill computed between "
           f"`{_BASE}` and `full` that it closes (100%: down to `full`'s figure; above 100%: below it), and its "
           f"later-turn TTFT p99 over `{_BASE}`'s:\n\n" + md_table(["surface", *heads], gap_body))
    return caption + table_md + gap


_WAIT_LABELS = {"announced": "true waits (`--tool-waits announced`, an oracle)",
                "predicted": "predicted per agent type, then per tool (`predicted`, the SDK's hints)",
                "predicted-stream": "predicted per session, then per tool, then over all (`predicted-stream`: "
                                    "the request-stream hints' chain, agents' ends reported)",
                "stream-announced": "request-stream setup, no agent ends reported (`--agent-ends unknown`), true "
                                    "waits (an oracle)",
                "stream-predicted": "request-stream setup: `predicted-stream`, `--agent-ends unknown`"}


@table("predicted-waits", "predicted-waits.json")
def predicted_waits(data: dict[str, Any]) -> str:
    """``kvtier`` on the recommended live surface told each tool wait's true length or a prediction from the
    waits seen so far (bench/predicted_waits.py): prefill computed over the bound, and each prediction
    against the same setup's true waits, at both points of both halves, with the bound and the floor."""
    pts = [data["points"][p] for p in _SURFACE_POINTS if p in data["points"]]
    key = "prefill_tokens_computed"
    body = []
    for mode in data["modes"]:
        oracle = data["oracle"].get(mode)
        cells = []
        for p in pts:
            r, bound = p["modes"][mode][key], p["references"]["bound_prefill_tokens"]
            vs = f", {r / p['modes'][oracle][key] - 1:+.1%} against true" if oracle else ""
            cells.append(f"{r / 1e6:.2f}M ({r / bound:.3f}x bound{vs})")
        body.append([_WAIT_LABELS.get(mode, f"`{mode}`"), *cells])
    for name, ref in (("bound", "bound"), ("floor (unbounded cache)", "floor")):
        body.append([name] + [f"{p['references'][f'{ref}_prefill_tokens'] / 1e6:.2f}M "
                              f"({p['references'][f'{ref}_prefill_tokens'] / p['references']['bound_prefill_tokens']:.3f}x)"
                              for p in pts])
    heads = [f"{'evaluation' if p['half'] == 'eval' else 'tuning'} half, conc {p['references']['conc']}, "
             f"HBM {p['references']['hbm_blocks']:,}" for p in pts]
    wall = sum(sum(p["wall_s"].values()) for p in pts)
    commit = (data.get("commit") or "unknown")[:7] + (" (kvtier/ modified)" if data.get("kvtier_dirty") else "")
    caption = (f"`kvtier` prefill computed on the recommended live surface (`--surface vllm`), told each tool "
               f"wait's true length or predicted from the waits seen so far (modelled: the replay's engine, the "
               f"connector's decisions). Points and resources as in the surface ablation (DRAM 2x HBM, no SSD, "
               f"FCFS, `--skip-oversized`). Written by `python bench/predicted_waits.py` at commit {commit}: per "
               f"point, `{pts[0]['commands']['announced']}` (with the references), then the other rows' options "
               f"with `--no-references`. {sum(len(p['wall_s']) for p in pts)} replays, {wall / 60:.0f} min of "
               f"replay wall time.\n\n")
    return caption + md_table(["tool waits", *heads], body)


def _with_refs(row: dict[str, Any], point: dict[str, Any]) -> dict[str, Any]:
    """A kvtier row run without references, given its point's (they do not depend on the surface)."""
    return row | {k: point["references"][k] for k in ("bound_prefill_tokens", "floor_prefill_tokens")}


_RULE_LABELS = {"always": "always load (the connector's default)", "never": "always recompute",
                "cost": "**kvtier** `cost` (`recompute_when_cheaper`)", "llm-d": "llm-d selective load (modelled)"}


@table("load-or-recompute-tune", "load-or-recompute-tune.json")
@table("load-or-recompute", "load-or-recompute.json")
def load_or_recompute(data: dict[str, Any]) -> str:
    """Later-turn TTFT p99 (and prefill computed) of each load rule per SSD bandwidth
    (bench/load_or_recompute.py), each cell against always loading's and always recomputing's
    better one at that bandwidth."""
    by = {(r["ssd_gbps"], r["rule"]): r for r in data["rows"]}
    gbps = sorted(data["ssd_gbps"])
    body = []
    for rule in data["rules"]:
        cells = []
        for g in gbps:
            r = by[(g, rule)]
            base = [by[(g, b)]["ttft_p99_later_turns_s"] for b in ("always", "never") if (g, b) in by]
            vs = ("" if rule in ("always", "never") or len(base) < 2 else
                  f", {r['ttft_p99_later_turns_s'] / min(base):.2f}x the better")
            cells.append(f"{r['ttft_p99_later_turns_s']:.1f} s ({r['prefill_tokens_computed'] / 1e6:.1f}M{vs})")
        body.append([_RULE_LABELS.get(rule, rule), *cells])
    commit = (data.get("commit") or "unknown")[:7] + (" (kvtier/ modified)" if data.get("kvtier_dirty") else "")
    wall = sum(r["wall_s"] for r in data["rows"])
    held = ", ".join(f"`{k}` {'holds' if v else 'does not hold'}"
                     for k, v in data["no_worse_than_always_and_never"].items())
    caption = (f"Later-turn TTFT p99 (prefill computed) per load rule and SSD read bandwidth, modelled (the "
               f"replay's engine; H100, Llama-3.1-8B, SSD writes at 0.8x the read bandwidth): `kvtier replay "
               f"{data['point']} --profile-file ssd.yaml --load-rule cost` and the other rules (ssd.yaml sets the "
               f"SSD's bandwidths), written by `{data['command'].strip()}` at commit {commit} "
               f"({len(data['rows'])} replays, {wall / 60:.0f} min of replay wall time). "
               f"Never worse than the better of always loading and always recomputing at every bandwidth: "
               f"{held}.\n\n")
    return caption + md_table(["rule", *(f"SSD {g:g} GB/s" for g in gbps)], body)
