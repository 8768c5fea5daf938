#!/usr/bin/env python3
"""Tune the ``kvtier`` placement policy's constant on the tuning half of the dev traces only.

Owns: the search of ``KVTier.demote_after_s`` (a tool wait predicted at least
this long gives up the HBM and DRAM copies first, keeping the write-through
SSD copy) over a fixed grid, replayed on the *tuning* half of the dev traces
(``--split tune``: sessions sorted by id, the 1st, 3rd, ...) at the README's
point (``--hbm-fraction 0.25``, conc 8, DRAM 2x HBM, SSD 4x HBM), and the
JSON it writes (``bench/out/tune-kvtier.json``: every value's prefill
computed and later-turn TTFT p99, and the value chosen: the least computed,
then the lowest TTFT p99, then the larger value).
Must not read the evaluation half: the README reports the chosen constant
there (``bench/replay_results.py``), and ``tests/test_readme_tables.py``
checks that the shipped constant is the one chosen here.

Usage: ``python bench/tune_kvtier.py [--jobs N]`` (about 5 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "out" / "tune-kvtier.json"
GRID_S: tuple[float | None, ...] = (5.0, 15.0, 30.0, 60.0, 120.0, None)  # None: never demote


def _variant(value: float | None):
    from kvtier.placement.agent import KVTier

    name = "kvtier-demote-" + ("never" if value is None else f"{value:g}s")
    cls = type(name.replace("-", "_"), (KVTier,), {"name": name, "demote_after_s": value})
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
    for value in GRID_S:
        name, cls = _variant(value)
        register_placement(name, cls)
        names[name] = value
    hbm = _dev_hbm_blocks("tune")
    w = split_workload(load_trace(DEV_TRACE), "tune")
    spec = ReplaySpec(workload=w, profile=parse_profile(DEFAULT_PROFILE), policies=tuple(names), concs=(DEV_CONC,),
                      hbm_blocks=(hbm,), ssd_blocks=4 * hbm, skip_oversized=True, references=False,
                      jobs=args.jobs or default_jobs())
    start = time.perf_counter()
    report = run_replay(spec, on_point=lambda d, t, e: print(f"[tune] {d}/{t} runs, {e:.0f}s", file=sys.stderr))
    rows = [{"demote_after_s": names[r["policy"]], "prefill_tokens_computed": r["prefill_tokens_computed"],
             "ttft_p99_later_turns_s": r["ttft_p99_later_turns_s"]} for r in report["results"]]
    best = min(rows, key=lambda r: (r["prefill_tokens_computed"], r["ttft_p99_later_turns_s"],
                                    -(math.inf if r["demote_after_s"] is None else r["demote_after_s"])))
    OUT.write_text(json.dumps({
        "what": "KVTier.demote_after_s on the tuning half of the dev traces",
        "trace": str(DEV_TRACE.name), "split": "tune", "sessions": len(w.sessions), "hbm_blocks": hbm,
        "dram_blocks": 2 * hbm, "ssd_blocks": 4 * hbm, "conc": DEV_CONC, "hbm_fraction": DEV_FRACTION,
        "rows": rows, "chosen_demote_after_s": best["demote_after_s"], "wall_s": time.perf_counter() - start,
    }, indent=2) + "\n")
    print(f"chosen demote_after_s = {best['demote_after_s']} ({best['prefill_tokens_computed'] / 1e6:.2f}M computed)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
