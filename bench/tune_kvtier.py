#!/usr/bin/env python3
"""Tune the ``kvtier`` placement policy's constant on the tuning half of the dev traces only.

Owns: the search of ``KVTier.next_use_trust`` (how much the predicted wait
moves a waiting agent's blocks in the next-use order: rank = wait start +
trust x predicted wait; 0 orders by wait start alone) over a fixed grid,
replayed on the *tuning* half of the dev traces (``--split tune``: sessions
sorted by id, the 1st, 3rd, ...) at the two points of the README's
placement results, DRAM 2x HBM, no SSD: conc 8 at ``--hbm-fraction 0.25``,
and the pressure point, conc 16 with HBM held at that conc-8 size; and the
JSON it writes (``bench/out/tune-kvtier.json``: every value's prefill
computed and later-turn TTFT p99 at both points, and the value chosen: the
least prefill computed over both points, then the lowest pressure-point TTFT
p99, then the smaller value).
Must not read the evaluation half: the README reports the chosen constant
there (``bench/replay_results.py``), and ``tests/test_readme_tables.py``
checks that the shipped constant is the one chosen here.

Usage: ``python bench/tune_kvtier.py [--jobs N]`` (about 8 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "out" / "tune-kvtier.json"
GRID: tuple[float, ...] = (0.0, 0.5, 1.0, 2.0)
PRESSURE_CONC = 16


def _variant(value: float):
    from kvtier.placement.agent import KVTier

    name = f"kvtier-trust-{value:g}"
    cls = type(name.replace("-", "_").replace(".", "_"), (KVTier,), {"name": name, "next_use_trust": value})
    return name, cls


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=None, help="worker processes (default: the CPUs available, <= 8)")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from replay_results import DEV_CONC, DEV_FRACTION, DEV_TRACE, _dev_hbm_blocks

    from kvtier.replay import load_trace
    from kvtier.placement import register_placement
    from kvtier.replay.profiles import DEFAULT_PROFILE, parse_profile
    from kvtier.replay.run import ReplaySpec, default_jobs, run_replay, split_workload

    names = {}
    for value in GRID:
        name, cls = _variant(value)
        register_placement(name, cls)
        names[name] = value
    hbm = _dev_hbm_blocks("tune")
    w = split_workload(load_trace(DEV_TRACE), "tune")
    start = time.perf_counter()
    points = {}
    for conc in (DEV_CONC, PRESSURE_CONC):
        spec = ReplaySpec(workload=w, profile=parse_profile(DEFAULT_PROFILE), policies=tuple(names),
                          concs=(conc,), hbm_blocks=(hbm,), skip_oversized=True, references=False,
                          jobs=args.jobs or default_jobs())
        report = run_replay(spec, on_point=lambda d, t, e, c=conc: print(f"[tune conc {c}] {d}/{t} runs, {e:.0f}s",
                                                                          file=sys.stderr))
        points[conc] = {r["policy"]: r for r in report["results"]}
    rows = [{"next_use_trust": value,
             **{f"conc{c}_prefill_tokens_computed": points[c][name]["prefill_tokens_computed"] for c in points},
             **{f"conc{c}_ttft_p99_later_turns_s": points[c][name]["ttft_p99_later_turns_s"] for c in points}}
            for name, value in names.items()]
    best = min(rows, key=lambda r: (sum(r[f"conc{c}_prefill_tokens_computed"] for c in points),
                                    r[f"conc{PRESSURE_CONC}_ttft_p99_later_turns_s"], r["next_use_trust"]))
    OUT.write_text(json.dumps({
        "what": "KVTier.next_use_trust on the tuning half of the dev traces",
        "trace": str(DEV_TRACE.name), "split": "tune", "sessions": len(w.sessions), "hbm_blocks": hbm,
        "dram_blocks": 2 * hbm, "ssd_blocks": 0, "concs": list(points), "hbm_fraction": DEV_FRACTION,
        "rows": rows, "chosen_next_use_trust": best["next_use_trust"], "wall_s": time.perf_counter() - start,
    }, indent=2) + "\n")
    print(f"chosen next_use_trust = {best['next_use_trust']:g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
