#!/usr/bin/env python3
"""Run the ``kvtier replay`` comparisons whose tables the README shows, and keep their JSON.

Owns: the exact replay commands behind the README's replay tables, run as
subprocesses, their ``--json`` written to ``bench/out/replay-*.json`` (with
the command line and wall time added). Must not format tables
(``bench/replay_tables.py`` does, through ``bench/readme_tables.py``).

The dev Claude Code traces are split by the replay's fixed rule (sessions
sorted by id; 1st, 3rd, ... = tuning half, 2nd, 4th, ... = evaluation half);
both halves are run at ``--hbm-fraction 0.25``, conc 8, with the default DRAM
(2x HBM) and no SSD, and with ``--ssd-blocks`` equal to 4x that half's HBM,
and at the pressure point (conc 16, HBM held at that conc-8 size, default
DRAM, no SSD: twice the sessions on the same memory);
the peers (``sae``, ``lmcache-lazy``, ``vllm-tiering``, with ``lru-dram`` for vLLM's native CPU
offloading) against ``kvtier`` at those four points (``peers-*``: both halves,
conc 8 and the pressure point) on the ``vllm`` surface and scheduler; the
evaluation half with SSD once more on the ``vllm`` engine surface
(``--surface vllm``: only what the live vLLM connector carries out in its
recommended setup, ``exclusive_dram: true``).
The SLO capacity (largest conc meeting later-turn TTFT p99 <= 20 s and p50
interactivity >= 30 tokens/s/user) is searched on the evaluation half at the
HBM capacity that ``--hbm-fraction 0.25`` gives at conc 8.
The Mooncake conversation trace (open loop) is run for ``lru-dram`` and
``kvtier`` at three HBM capacities. TokenCake-style applications (``--workload apps``) are run with FCFS
admission for every policy, and again with each non-FCFS admission order for
``lru`` and the policy that proposed it (scheduling reported apart).

Usage: ``python bench/replay_results.py [--only NAME,...] [--jobs N]``, then
``python bench/readme_tables.py``. About 45 minutes on 2 cores in full.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "out"
DEV_TRACE = ROOT.parent / "shared" / "traces" / "weka_claude_code" / "weka_dev_120.tar.xz"
MOONCAKE_TRACE = ROOT.parent / "shared" / "traces" / "mooncake_fast25" / "conversation_trace.jsonl"
MOONCAKE_HBM = "3502,7004,14008"  # half, one and two H100s' worth of Llama-3.1-8B KV after weights
ABLATIONS = "kvtier-space-only,kvtier-time-only,kvtier-inclusive,kvtier-lru-order,kvtier-no-dead"
DEV_POLICIES = f"lru,lru-dram,arc,s3fifo,ttl,minwaste,tokencake,kvflow,kvtier,{ABLATIONS},belady-hbm"
# the pressure point: twice the sessions on the same HBM (lru and minwaste, HBM-only or swap-only,
# compute several times the bound there already at conc 8; belady-hbm is HBM-only too)
PRESSURE_CONC = 16
PRESSURE_POLICIES = f"lru-dram,arc,s3fifo,ttl,tokencake,kvflow,kvtier,{ABLATIONS}"
APPS = ("mixed", "code-writer", "deep-research")
APP_POLICIES = "lru,lru-dram,ttl,minwaste,tokencake,kvflow,kvtier,kvtier-space-only,kvtier-time-only"
# scheduling apart from placement: the admission orders as their own rows, with the policies that proposed them
ADMISSION_ROWS = {"critical-first": "lru,tokencake", "oldest-app": "lru,kvtier"}
SLO_POLICIES = "lru,lru-dram,arc,s3fifo,ttl,minwaste,tokencake,kvflow,kvtier"
SLO_TTFT_P99_S = 20.0  # later turns: a tool result or user turn answered within 20 s at p99
SLO_INTERACTIVITY = 30.0  # tokens/s/user at p50
LIVE_POLICIES = "lru,lru-dram,ttl,tokencake,kvflow,kvtier"
# the peers kvtier's users would run instead, each as its system ships it (kvtier.placement.peers; TokenCake
# and KVFlow, the research systems, as kvtier.placement.agent models them), against
# kvtier's recommended live setup, on the live surface and vLLM's scheduler, at the four dev points
PEER_POLICIES = "lru-dram,sae,lmcache-lazy,vllm-tiering,tokencake,kvflow,kvtier"
PEER_SETTINGS = ["--surface", "vllm", "--scheduler", "vllm"]
DEV_FRACTION = 0.25
DEV_CONC = 8


def _dev_hbm_blocks(half: str) -> int:
    """HBM blocks that ``--hbm-fraction 0.25`` gives on that half at conc 8 (to size the SSD at 4x)."""
    from kvtier.replay import load_trace
    from kvtier.replay.run import split_workload

    return conc8_hbm_blocks(split_workload(load_trace(DEV_TRACE), half))


def conc8_hbm_blocks(workload: Any) -> int:
    """HBM blocks that ``--hbm-fraction 0.25`` gives on ``workload`` at conc 8, the dev points' rule."""
    from kvtier.replay.profiles import DEFAULT_PROFILE, parse_profile
    from kvtier.replay.run import ReplaySpec

    spec = ReplaySpec(workload=workload, profile=parse_profile(DEFAULT_PROFILE), concs=(DEV_CONC,),
                      hbm_fractions=(DEV_FRACTION,))
    return spec.capacities()[0]


def commands() -> dict[str, list[str]]:
    """name -> the replay's arguments (after ``kvtier replay``)."""
    cmds: dict[str, list[str]] = {"default": ["--plot", "bench/out/replay-default.png"]}
    def dev(half: str, policies: str) -> list[str]:
        return ["--trace", os.path.relpath(DEV_TRACE, ROOT), "--split", half, "--hbm-fraction", str(DEV_FRACTION),
                "--conc", str(DEV_CONC), "--policies", policies, "--skip-oversized"]

    for half in ("eval", "tune"):
        cmds[f"dev-{half}"] = dev(half, DEV_POLICIES)
        cmds[f"dev-{half}-pressure"] = ["--trace", os.path.relpath(DEV_TRACE, ROOT), "--split", half, "--hbm-blocks",
                                        str(_dev_hbm_blocks(half)), "--conc", str(PRESSURE_CONC), "--policies",
                                        PRESSURE_POLICIES, "--skip-oversized"]
        cmds[f"dev-{half}-ssd"] = dev(half, DEV_POLICIES) + ["--ssd-blocks", str(4 * _dev_hbm_blocks(half))]
        cmds[f"peers-{half}"] = dev(half, PEER_POLICIES) + PEER_SETTINGS
        cmds[f"peers-{half}-pressure"] = ["--trace", os.path.relpath(DEV_TRACE, ROOT), "--split", half, "--hbm-blocks",
                                          str(_dev_hbm_blocks(half)), "--conc", str(PRESSURE_CONC), "--policies",
                                          PEER_POLICIES, "--skip-oversized", *PEER_SETTINGS]
    # what the live vLLM connector can carry out of the same decisions (evaluation half, with SSD)
    cmds["dev-eval-ssd-vllm"] = dev("eval", LIVE_POLICIES) + ["--ssd-blocks", str(4 * _dev_hbm_blocks("eval")),
                                                              "--surface", "vllm"]
    cmds["slo-dev-eval"] = ["--trace", os.path.relpath(DEV_TRACE, ROOT), "--split", "eval", "--hbm-fraction",
                            str(DEV_FRACTION), "--conc", str(DEV_CONC), "--policies", SLO_POLICIES, "--skip-oversized",
                            "--slo-ttft-p99", str(SLO_TTFT_P99_S), "--slo-interactivity", str(SLO_INTERACTIVITY)]
    # plain chat (open loop, no agents): what helps agents must not hurt it
    cmds["mooncake"] = ["--trace", os.path.relpath(MOONCAKE_TRACE, ROOT), "--block-size", "64", "--time-scale", "4",
                        "--hbm-blocks", MOONCAKE_HBM, "--policies", "lru-dram,kvtier"]
    for app in APPS:
        apps = ["--workload", "apps", "--app", app, "--apps", "80", "--rate", "1.0", "--hbm-blocks", "1000",
                "--ssd-blocks", "8000"]
        cmds[f"apps-{app}"] = apps + ["--policies", APP_POLICIES]
        for order, policies in ADMISSION_ROWS.items():
            cmds[f"apps-{app}-{order}"] = apps + ["--policies", policies, "--admission", order, "--no-references"]
    return cmds


def run(name: str, args: list[str], jobs: int | None) -> None:
    out = OUT / f"replay-{name}.json"
    cmd = [sys.executable, "-m", "kvtier.cli", "replay", *args, "--quiet", "--json", str(out)]
    if jobs:
        cmd += ["--jobs", str(jobs)]
    shown = "kvtier replay " + shlex.join(args)
    print(f"$ {shown}", file=sys.stderr, flush=True)
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"replay_results: `{shown}` failed with exit status {proc.returncode}")
    report = json.loads(out.read_text())
    report["command"] = shown
    report["bench_wall_s"] = time.perf_counter() - start
    out.write_text(json.dumps(report, indent=2, default=float) + "\n")
    print(f"  {name}: {report['bench_wall_s']:.0f}s -> {out.relative_to(ROOT)}", file=sys.stderr, flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", help="comma-separated names to run (default: all): default, dev-eval, dev-eval-ssd, "
                                   "dev-eval-pressure, dev-tune, dev-tune-ssd, dev-tune-pressure, dev-eval-ssd-vllm, "
                                   "peers-eval, peers-tune, peers-eval-pressure, peers-tune-pressure, "
                                   "slo-dev-eval, mooncake, apps-APP[-ORDER] (APP: mixed, code-writer, "
                                   "deep-research; ORDER: critical-first, oldest-app)")
    ap.add_argument("--jobs", type=int, help="worker processes per replay (default: the replay's own default)")
    args = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    cmds = commands()
    names = args.only.split(",") if args.only else list(cmds)
    for name in names:
        if name not in cmds:
            raise SystemExit(f"replay_results: unknown --only name {name!r}; valid: {', '.join(cmds)}")
        run(name, cmds[name], args.jobs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
