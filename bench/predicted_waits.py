#!/usr/bin/env python3
"""What predicting tool waits costs kvtier in the replay, against knowing them (issue 42).

Owns: the replay commands of that comparison and the one JSON they make,
``bench/out/predicted-waits.json``. Must not format tables
(``bench/replay_tables.py`` renders block ``predicted-waits``) and must not
judge: the README test checks the table against the JSON, not a threshold.

At the four points of the surface ablation (``bench/surface_ablation.py``:
both halves of the dev traces, conc 8 at ``--hbm-fraction 0.25`` and conc 16
on that HBM; DRAM 2x HBM, no SSD, FCFS, ``--skip-oversized``), ``kvtier`` on
the recommended live surface (``--surface vllm``) runs three times, told of
each tool wait:

* ``announced`` — its true length (an oracle: the client announces exactly
  how long its tool takes), with the floor and the bound in the same replay;
* ``predicted`` — the hint plane's prediction from the waits seen so far,
  per agent type as the SDK names it, then per tool (the replay's default);
* ``predicted-stream`` — the chain the request-stream middleware's hints get,
  which name no agent type: per (session, tool), then per tool, then over
  all tools, as the connector's hosted hint server has it (the predictor
  alone: agents' ends reported, as the SDK reports them).

and twice more as the request-stream middleware feeds it, which reports no
agent's end (``--agent-ends unknown``: a turn without a tool call is a
``turn_end`` wait, as live), told the true waits (``stream-announced``) or
the stream chain's predictions (``stream-predicted``).

Each replay writes its own ``--json`` into ``--work``
(``build/predicted-waits``), kept so that an interrupted run resumes: empty it
after changing the code. Usage: ``python bench/predicted_waits.py
[--halves eval,tune] [--parallel 1]``, then ``python bench/readme_tables.py``.
20 replays, about 10 minutes one at a time on 2 cores. Each replay's JSON
records the commit it ran on; the merge refuses replays of different commits.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from replay_results import ROOT  # noqa: E402
from surface_ablation import HALVES, POINTS, point_args, run  # noqa: E402

from kvtier.provenance import provenance  # noqa: E402

OUT = ROOT / "bench" / "out" / "predicted-waits.json"
# mode -> the replay's options: the oracle first, then its predictions; the request-stream setup last
MODES: dict[str, list[str]] = {
    "announced": ["--tool-waits", "announced"],
    "predicted": ["--tool-waits", "predicted"],
    "predicted-stream": ["--tool-waits", "predicted-stream"],
    "stream-announced": ["--tool-waits", "announced", "--agent-ends", "unknown"],
    "stream-predicted": ["--tool-waits", "predicted-stream", "--agent-ends", "unknown"],
}
ORACLE = {"predicted": "announced", "predicted-stream": "announced", "stream-predicted": "stream-announced"}


def commands(halves: tuple[str, ...]) -> dict[str, list[str]]:
    """run name (``HALF-POINT-MODE``) -> the replay's arguments (after ``kvtier replay``), in run order."""
    cmds: dict[str, list[str]] = {}
    for half in halves:
        for point in POINTS:
            for mode, opts in MODES.items():
                refs = [] if mode == "announced" else ["--no-references"]
                cmds[f"{half}-{point}-{mode}"] = [*point_args(half, point), "--policies", "kvtier", "--surface",
                                                  "vllm", *opts, *refs]
    return cmds


def _provenance() -> dict:
    return provenance()


def run_stamped(name: str, args: list[str], work: Path) -> float:
    """:func:`surface_ablation.run`, then the commit it ran on written into its JSON (once: a replay kept from
    an earlier run keeps its own)."""
    took = run(name, args, work)
    path = work / f"{name}.json"
    rep = json.loads(path.read_text())
    if "provenance" not in rep:
        rep["provenance"] = _provenance()
        path.write_text(json.dumps(rep, indent=2, default=float) + "\n")
    return took


def merge(work: Path, cmds: dict[str, list[str]]) -> dict:
    """One JSON: per ``HALF-POINT``, ``kvtier``'s row per mode, the references and every command."""
    points: dict[str, dict] = {}
    header: dict | None = None
    provenance: list[dict] = []
    for name in cmds:
        path = work / f"{name}.json"
        if not path.exists():
            continue
        rep = json.loads(path.read_text())
        provenance.append(rep.get("provenance") or {"commit": None, "kvtier_dirty": None})
        half, point, mode = name.split("-", 2)
        p = points.setdefault(f"{half}-{point}", {"half": half, "point": point, "modes": {}, "commands": {},
                                                   "wall_s": {}})
        row = next(r for r in rep["results"] if r["policy"] == "kvtier")
        p["modes"][mode] = row
        p["commands"][mode], p["wall_s"][mode] = rep["command"], rep["bench_wall_s"]
        if rep.get("references"):
            p["references"] = rep["references"][0]
            p["workload"], p["trace"] = rep["workload"], rep["trace"]
            header = header or {k: rep[k] for k in ("kvtier_version", "profile", "block_size", "admission",
                                                    "skip_oversized")}
    made = {(p["commit"], p["kvtier_dirty"]) for p in provenance}
    if len(made) > 1:
        raise SystemExit(f"predicted_waits: the replays in {work} ran on different code ({sorted(map(str, made))}); "
                         f"empty it and run again")
    commit, dirty = made.pop() if made else (None, None)
    return {"generated_by": "bench/predicted_waits.py",
            "generated_at": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "commit": commit, "kvtier_dirty": dirty, **(header or {}), "modes": list(MODES), "oracle": ORACLE,
            "points": points}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--halves", default=",".join(HALVES), help="eval,tune (the default; in that order)")
    ap.add_argument("--parallel", type=int, default=1, help="replays at once (default 1)")
    ap.add_argument("--work", type=Path, default=ROOT / "build" / "predicted-waits",
                    help="per-replay JSONs (kept: a rerun resumes; empty it after changing the code)")
    ap.add_argument("--out", type=Path, default=OUT, help=f"merged JSON (default {OUT.relative_to(ROOT)})")
    args = ap.parse_args()
    halves = tuple(h for h in args.halves.split(",") if h)
    bad = [h for h in halves if h not in HALVES]
    if bad:
        ap.error(f"--halves: {bad[0]!r} is not one of {', '.join(HALVES)}")
    cmds = commands(halves)
    args.work.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=max(1, args.parallel)) as pool:
        for done, _ in enumerate(pool.map(lambda kv: run_stamped(kv[0], kv[1], args.work), cmds.items()), 1):
            print(f"[{done}/{len(cmds)}] {time.perf_counter() - start:.0f}s", file=sys.stderr, flush=True)
    merged = merge(args.work, cmds)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(merged, indent=2, default=float) + "\n")
    print(f"wrote {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
