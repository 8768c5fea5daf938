"""Memory soak (issue 8): TierManager churn and a live hint stream, RSS measured.

``python bench/soak.py`` runs 10 minutes of each by default (the fault suite
runs 1M manager ops and a 30 s stream in CI) and prints JSON and a table;
exits 1 when RSS grew past the bound after warm-up.

    python bench/soak.py --minutes 10 --manager-ops 20000000 --bound-mib 32
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

from kvtier.benchmarks.soak import hint_stream, manager_churn


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0, help="hint stream duration (default 10)")
    p.add_argument("--manager-ops", type=int, default=0,
                   help="manager operations (default: as many as fit in --minutes, measured in batches)")
    p.add_argument("--bound-mib", type=float, default=32.0, help="allowed RSS growth after warm-up (MiB)")
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = p.parse_args()
    results = []
    ops = args.manager_ops
    if not ops:  # calibrate: ~22k ops/s on a 2-core VM
        t0 = time.perf_counter()
        manager_churn(100_000, seed=99)
        ops = int(100_000 * args.minutes * 60 / (time.perf_counter() - t0))
    results.append(manager_churn(ops, seed=0))
    print(results[-1].describe(), flush=True)
    results.append(hint_stream(args.minutes * 60, progress=lambda m: print(m, file=sys.stderr, flush=True)))
    print(results[-1].describe(), flush=True)
    bound = args.bound_mib * (1 << 20)
    rows = [{**dataclasses.asdict(r), "growth_bytes": r.growth_bytes, "within_bound": r.growth_bytes < bound}
            for r in results]
    print(f"{'loop':>14}  {'ops':>11}  {'wall_s':>7}  {'rss_warm_MiB':>12}  {'rss_max_MiB':>11}  {'growth_MiB':>10}  ok")
    for r in rows:
        print(f"{r['name']:>14}  {r['num_ops']:>11}  {r['wall_s']:>7.0f}  {r['rss_after_warmup_bytes'] / 2**20:>12.1f}"
              f"  {r['rss_max_after_warmup_bytes'] / 2**20:>11.1f}  {r['growth_bytes'] / 2**20:>10.2f}"
              f"  {'yes' if r['within_bound'] else 'NO'}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"bound_mib": args.bound_mib, "results": rows}, f, indent=2)
    return 0 if all(r["within_bound"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
