#!/usr/bin/env python3
"""Which full-surface decision carries kvtier's gain: each added on its own to the write-through connector (issue 41).

Owns: the replay commands of the surface ablation and the one JSON they make,
``bench/out/replay-surface-ablation.json``. Must not format tables
(``bench/replay_tables.py`` renders block ``replay-surface-ablation``).

Two points, as the README's judged tables: conc 8 at ``--hbm-fraction 0.25``,
and the pressure point, conc 16 with HBM held at that conc-8 size (9,883
blocks on the evaluation half, 10,686 on the tuning half); default DRAM (2x
HBM), no SSD, FCFS admission, ``--skip-oversized``; both halves of the dev
traces. At each point, one replay runs ``lru-dram`` and ``kvtier`` on
``vllm-write-through`` (the write-through connector) with the floor and the
bound; every other surface (:data:`SURFACES`)
runs ``kvtier`` alone (``--no-references``: the references do not depend on
the surface, they run LRU and Belady with no hints), and the recommended
surface with ``--agent-ends unknown`` (:data:`ROW_ARGS`: hints in
``kv_transfer_params`` only, no hint server telling kvtier an agent is done)
and with ``--tool-waits announced`` (the true tool waits instead of the
hint plane's predictions), and with ``--scheduler vllm`` (vLLM's admission: within
the step's token budget, a block a request allocated is a hit for the next; the
references keep the plain admission). Each replay writes its
own ``--json`` into ``--work`` (``build/surface-ablation``), kept so that an
interrupted run resumes: empty it after changing the code. The merged file
keeps each row as the replay wrote it and every command line.

Usage: ``python bench/surface_ablation.py [--halves eval,tune] [--parallel 2]``,
then ``python bench/readme_tables.py``. 88 replays, about 45 minutes two at a
time on 2 cores shared with other work.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from replay_results import DEV_CONC, DEV_FRACTION, DEV_TRACE, PRESSURE_CONC, ROOT, _dev_hbm_blocks  # noqa: E402

OUT = ROOT / "bench" / "out" / "replay-surface-ablation.json"
DECISIONS = ("exclusive", "order", "drop", "prefetch", "defer")  # kvtier.placement.surface.ALL_ADDITIONS
BASE = "vllm-write-through"  # the write-through connector; the additions are named on it
# rows of the table: the live surfaces (kvtier.placement.surface.LIVE: vllm = BASE+exclusive+requeue+defer), the
# order in full instead of the re-queue, the live setup before it ordered HBM, each decision on its own, exclusive
# DRAM with the order and with dead blocks freed (at conc 8 exclusive DRAM alone costs prefill), all of them, all
# but each one (the decisions interact: one alone can cost what several together gain), full
SURFACES = (BASE, "vllm", f"{BASE}+exclusive+order+defer", f"{BASE}+exclusive+defer", f"{BASE}+requeue",
            *(f"{BASE}+{d}" for d in DECISIONS), f"{BASE}+exclusive+order", f"{BASE}+exclusive+drop", f"{BASE}+all",
            *("+".join([BASE, *(d for d in DECISIONS if d != left)]) for left in DECISIONS), "full")
# rows that are a surface run with more of the replay's options, on the recommended setup:
# hints in kv_transfer_params only (no hint server reporting agents' ends: --agent-ends unknown), and the
# tool waits' true lengths announced instead of predicted from history (an oracle: what prediction costs)
# and vLLM's admission (--scheduler vllm: within the step's token budget, blocks shared once allocated)
ENDS_UNKNOWN = "vllm/agent-ends-unknown"
WAITS_ANNOUNCED = "vllm/tool-waits-announced"
VLLM_SCHEDULER = "vllm/scheduler-vllm"
ROW_ARGS: dict[str, list[str]] = {ENDS_UNKNOWN: ["--surface", "vllm", "--agent-ends", "unknown"],
                                  WAITS_ANNOUNCED: ["--surface", "vllm", "--tool-waits", "announced"],
                                  VLLM_SCHEDULER: ["--surface", "vllm", "--scheduler", "vllm"]}
SURFACES = (*SURFACES[:2], ENDS_UNKNOWN, WAITS_ANNOUNCED, VLLM_SCHEDULER, *SURFACES[2:])
HALVES = ("eval", "tune")
POINTS = ("conc8", "pressure")


@lru_cache(maxsize=None)
def point_args(half: str, point: str) -> tuple[str, ...]:
    cap = (["--hbm-fraction", str(DEV_FRACTION), "--conc", str(DEV_CONC)] if point == "conc8"
           else ["--hbm-blocks", str(_dev_hbm_blocks(half)), "--conc", str(PRESSURE_CONC)])
    return ("--trace", os.path.relpath(DEV_TRACE, ROOT), "--split", half, *cap, "--skip-oversized")


def commands(halves: tuple[str, ...]) -> dict[str, list[str]]:
    """run name (``HALF-POINT-SURFACE``) -> the replay's arguments (after ``kvtier replay``), in run order."""
    cmds: dict[str, list[str]] = {}
    for half in halves:
        for point in POINTS:
            base = list(point_args(half, point))
            for s in SURFACES:
                refs = ["--policies", "lru-dram,kvtier"] if s == BASE else ["--policies", "kvtier", "--no-references"]
                cmds[f"{half}-{point}-{s}"] = base + refs + ROW_ARGS.get(s, ["--surface", s])
    return cmds


def run(name: str, args: list[str], work: Path) -> float:
    out = work / f"{name.replace('/', '_')}.json"
    if out.exists():
        return 0.0
    shown = "kvtier replay " + shlex.join(args)
    print(f"$ {shown}", file=sys.stderr, flush=True)
    start = time.perf_counter()
    tmp = out.with_suffix(".part")
    cmd = [sys.executable, "-m", "kvtier.cli", "replay", *args, "--quiet", "--jobs", "1", "--json", str(tmp)]
    proc = subprocess.run(cmd, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"surface_ablation: `{shown}` failed with exit status {proc.returncode}")
    report = json.loads(tmp.read_text())
    report["command"], report["bench_wall_s"] = shown, time.perf_counter() - start
    out.write_text(json.dumps(report, indent=2, default=float) + "\n")
    tmp.unlink()
    print(f"  {name}: {report['bench_wall_s']:.0f}s", file=sys.stderr, flush=True)
    return report["bench_wall_s"]


def merge(work: Path, cmds: dict[str, list[str]]) -> dict:
    """One JSON: per ``HALF-POINT``, the references, ``lru-dram`` on :data:`BASE` and ``kvtier`` per surface."""
    points: dict[str, dict] = {}
    header = None
    for name in cmds:
        path = work / f"{name.replace('/', '_')}.json"
        if not path.exists():
            continue
        rep = json.loads(path.read_text())
        half, point, surface = name.split("-", 2)
        p = points.setdefault(f"{half}-{point}", {"half": half, "point": point, "surfaces": {}, "commands": {},
                                                   "wall_s": {}})
        rows = {r["policy"]: r for r in rep["results"]}
        p["surfaces"][surface] = rows["kvtier"]
        p["commands"][surface], p["wall_s"][surface] = rep["command"], rep["bench_wall_s"]
        if "lru-dram" in rows:
            p["lru-dram"] = rows["lru-dram"]
            p["references"] = rep["references"][0]
            header = header or {k: rep[k] for k in ("kvtier_version", "trace", "profile", "block_size", "admission",
                                                    "skip_oversized")}
            p["workload"] = rep["workload"]
    return {**(header or {}), "surfaces": list(SURFACES), "points": points}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--halves", default=",".join(HALVES), help="eval,tune (the default; in that order)")
    ap.add_argument("--parallel", type=int, default=2, help="replays at once (default 2)")
    ap.add_argument("--work", type=Path, default=ROOT / "build" / "surface-ablation",
                    help="where each replay's JSON is kept (an existing one is not run again)")
    args = ap.parse_args()
    halves = tuple(args.halves.split(","))
    if not set(halves) <= set(HALVES):
        raise SystemExit(f"surface_ablation: --halves {args.halves!r}; valid: {', '.join(HALVES)}")
    args.work.mkdir(parents=True, exist_ok=True)
    cmds = commands(halves)
    start = time.perf_counter()
    with ThreadPoolExecutor(args.parallel) as pool:
        list(pool.map(lambda item: run(item[0], item[1], args.work), cmds.items()))
    merged = merge(args.work, commands(HALVES))
    OUT.write_text(json.dumps(merged, indent=2, default=float) + "\n")
    print(f"surface_ablation: {time.perf_counter() - start:.0f}s -> {OUT.relative_to(ROOT)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
