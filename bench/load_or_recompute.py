#!/usr/bin/env python3
"""Load or recompute, per request: each rule of ``kvtier replay --load-rule`` on long agent contexts
whose host copies sit mostly on an SSD, over SSD read bandwidths from a network disk to an NVMe drive.

Owns: the replay commands of this comparison, its JSON per half of the dev traces
(``bench/out/load-or-recompute.json``, ``-tune.json``) and their plots. Must not format
README tables (``bench/replay_tables.py`` renders blocks ``load-or-recompute`` and
``load-or-recompute-tune``).

The point: the evaluation half of the dev traces (``--split``; Claude Code sessions, contexts of
tens of thousands of tokens), conc 16, HBM at a quarter of the working set, DRAM of
``--dram-blocks`` (1,000: far less than the contexts, so most of what comes back
comes from the SSD), an SSD of 39,532 blocks, kvtier on the recommended live surface
(``vllm``) with vLLM's admission (``--scheduler vllm``), the default profile (H100,
Llama-3.1-8B) with its SSD read bandwidth set to each of ``--ssd-gbps`` (writes at
0.8x that). Rules (:mod:`kvtier.placement.loadrule`): ``always`` (every hit loads:
the connector's default), ``never`` (every DRAM / SSD hit is recomputed), ``cost``
(kvtier's cost model per request; live: ``recompute_when_cheaper``) and ``llm-d``
(the llm-d router's selective load, modelled: at least 1,024 tokens from the host
tiers and its waiting-queue gate open). The same workload, capacities and engine
for every rule; no floor or bound (they do not load).

The cost rule's terms (the link's queue, the step a load waits, the prefill ahead) were
chosen looking at the evaluation half; the tuning half is the check.

Usage: ``python bench/load_or_recompute.py`` (20 replays, about 6 minutes two at a
time on 2 cores) and ``python bench/load_or_recompute.py --split tune --json
bench/out/load-or-recompute-tune.json``, then ``python bench/readme_tables.py``;
``--plot bench/out/load-or-recompute.json`` redraws the PNG only.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
DEV_TRACE = ROOT.parent / "shared" / "traces" / "weka_claude_code" / "weka_dev_120.tar.xz"
OUT = ROOT / "bench" / "out" / "load-or-recompute.json"
RULES = ("always", "never", "cost", "llm-d")
SSD_GBPS = (0.25, 0.5, 1.0, 2.0, 7.0)
FIELDS = ("ttft_p50_later_turns_s", "ttft_p99_later_turns_s", "ttft_mean_later_turns_s", "makespan_s",
          "prefill_tokens_computed", "prefill_tokens_hit_hbm", "prefill_tokens_hit_dram", "prefill_tokens_hit_ssd")


def point_args(dram_blocks: int, conc: int, split: str = "eval") -> list[str]:
    return ["--trace", os.path.relpath(DEV_TRACE, ROOT), "--split", split, "--hbm-fraction", "0.25",
            "--conc", str(conc), "--dram-blocks", str(dram_blocks), "--ssd-blocks", "39532", "--surface", "vllm",
            "--scheduler", "vllm", "--skip-oversized", "--policies", "kvtier", "--no-references"]


def run_one(gbps: float, rule: str, base: list[str], work: Path) -> dict:
    profile = work / f"ssd-{gbps:g}.yaml"
    profile.write_text(f"hardware:\n  ssd_read_bw_bytes_s: {gbps * 1e9:.0f}\n"
                       f"  ssd_write_bw_bytes_s: {0.8 * gbps * 1e9:.0f}\n")
    out = work / f"{gbps:g}-{rule}.json"
    args = [*base, "--profile-file", str(profile), "--load-rule", rule]
    shown = "kvtier replay " + shlex.join(args).replace(str(work) + "/", "")
    print(f"[load_or_recompute] SSD {gbps:g} GB/s, rule {rule} ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    cmd = [sys.executable, "-m", "kvtier.cli", "replay", *args, "--quiet", "--jobs", "1", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"load_or_recompute: `{shown}` failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    rep = json.loads(out.read_text())
    row = next(r for r in rep["results"] if r["policy"] == "kvtier")
    return {"ssd_gbps": gbps, "rule": rule, **{k: row[k] for k in FIELDS},
            "hits_recomputed": row["counters"].get("hits_recomputed", 0), "command": shown,
            "wall_s": time.perf_counter() - start}


def verdicts(rows: list[dict]) -> dict[str, bool]:
    """Per rule: its later-turn TTFT p99 no worse than always loading's and always recomputing's at every bandwidth."""
    by = {(r["ssd_gbps"], r["rule"]): r["ttft_p99_later_turns_s"] for r in rows}
    gbps = {r["ssd_gbps"] for r in rows}
    if not all((g, b) in by for g in gbps for b in ("always", "never")):
        return {}  # the baselines were not run
    return {rule: all(by[(g, rule)] <= min(by[(g, "always")], by[(g, "never")]) for g in gbps)
            for rule in {r["rule"] for r in rows} if rule not in ("always", "never")}


def plot(data: dict, png: Path) -> None:
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for rule in data["rules"]:
        pts = sorted((r["ssd_gbps"], r["ttft_p99_later_turns_s"]) for r in data["rows"] if r["rule"] == rule)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=rule)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks(data["ssd_gbps"], [f"{g:g}" for g in data["ssd_gbps"]])
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("SSD read bandwidth (GB/s)")
    ax.set_ylabel("later-turn TTFT p99 (s)")
    half = "evaluation" if "--split eval" in data["point"] else "tuning"
    ax.set_title(f"load or recompute (replay, dev traces' {half} half)", fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    print(f"wrote {png}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ssd-gbps", default=",".join(f"{g:g}" for g in SSD_GBPS),
                    help="SSD read bandwidths to replay, GB/s (default %(default)s)")
    ap.add_argument("--rules", default=",".join(RULES), help="load rules (default %(default)s)")
    ap.add_argument("--dram-blocks", type=int, default=1000, help="DRAM capacity in blocks (default 1000)")
    ap.add_argument("--conc", type=int, default=16, help="live sessions (default 16)")
    ap.add_argument("--split", choices=["eval", "tune"], default="eval",
                    help="the dev traces' half (default eval; tune: the half the rule's terms were not chosen on)")
    ap.add_argument("--parallel", type=int, default=2, help="replays at once (default 2)")
    ap.add_argument("--json", type=Path, default=OUT, help=f"write the results here (default {OUT.relative_to(ROOT)})")
    ap.add_argument("--png", type=Path, help="write the plot here (default: the JSON's path with .png)")
    ap.add_argument("--plot", type=Path, metavar="JSON", help="only redraw the plot from this JSON")
    args = ap.parse_args(argv)
    if args.plot:
        plot(json.loads(args.plot.read_text()), args.png or args.plot.with_suffix(".png"))
        return 0
    if not DEV_TRACE.exists():
        raise SystemExit(f"load_or_recompute: the dev traces are not at {DEV_TRACE} (see ../shared/traces/README.md)")
    try:
        gbps = [float(g) for g in args.ssd_gbps.split(",")]
    except ValueError:
        ap.error(f"--ssd-gbps {args.ssd_gbps!r}: comma-separated numbers")
    rules = args.rules.split(",")
    unknown = [r for r in rules if r not in RULES]
    if unknown or any(g <= 0 for g in gbps) or args.dram_blocks < 0 or args.conc < 1:
        ap.error(f"--rules from {', '.join(RULES)}; --ssd-gbps > 0; --dram-blocks >= 0; --conc >= 1")
    base = point_args(args.dram_blocks, args.conc, args.split)
    with tempfile.TemporaryDirectory(prefix="load-or-recompute-") as tmp, ThreadPoolExecutor(args.parallel) as pool:
        rows = list(pool.map(lambda gr: run_one(gr[0], gr[1], base, Path(tmp)), [(g, r) for g in gbps for r in rules]))
    from kvtier.provenance import provenance

    data = {**provenance(), "bench": "bench/load_or_recompute.py",
            "command": "python bench/load_or_recompute.py " + shlex.join(argv if argv is not None else sys.argv[1:]),
            "point": " ".join(base), "rules": rules, "ssd_gbps": gbps, "rows": rows,
            "no_worse_than_always_and_never": verdicts(rows)}
    args.json.write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {args.json}", file=sys.stderr)
    for r in rows:
        print(f"SSD {r['ssd_gbps']:>5g} GB/s  {r['rule']:>6}  later TTFT p99 {r['ttft_p99_later_turns_s']:8.2f} s  "
              f"mean {r['ttft_mean_later_turns_s']:6.2f} s  prefill {r['prefill_tokens_computed'] / 1e6:6.2f}M  "
              f"recomputed hits {r['hits_recomputed']}")
    print("no worse than always and never on p99:", data["no_worse_than_always_and_never"])
    plot(data, args.png or args.json.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
