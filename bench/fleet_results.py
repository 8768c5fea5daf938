#!/usr/bin/env python3
"""Plan a fleet by simulation: four (routing, remote tier) points of ``kvtier replay --engines 4`` on the dev traces.

Owns: the exact replay commands of the fleet comparison (issue 23, "Planning
past one machine"), run as subprocesses; their figures gathered in
``bench/out/fleet-dev.json`` with the commands and settings; a table of ratios
against the baseline measured in the same run (round-robin routing, no remote
tier); a PNG of prefill computed and later-turn TTFT p99 per point. Must not
change the model to meet a target: it reports whether the target holds.

Setting: the evaluation half of the dev Claude Code traces (the replay's fixed
split, as ``bench/replay_results.py``: sessions sorted by id, the 2nd, 4th, ...),
4 engines, conc 32 live sessions over the fleet (8 per engine), HBM per engine
from ``--hbm-fraction 0.25`` of one engine's share (the working set of
conc / engines = 8 sessions of mean footprint: the HBM the README's one-engine
conc-8 point has), default DRAM (2x HBM per engine), no SSD, oversized requests
skipped alike in every run. The remote tier, where on, holds 4x the fleet's
HBM (the README's SSD convention, 4x HBM) behind a 12.5 GB/s link per engine.
Every figure is modelled.

Points: round-robin without remote (the baseline); round-robin with remote;
sticky sessions without remote; kv-aware with remote. Target: kv-aware with
remote computes at most 0.6x the prefill tokens of the baseline.

Usage: ``python bench/fleet_results.py [--jobs N] [--policies lru,kvtier]``.
About 8 minutes on 2 cores.
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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "out"
DEV_TRACE = ROOT.parent / "shared" / "traces" / "weka_claude_code" / "weka_dev_120.tar.xz"
SPLIT = "eval"
ENGINES = 4
CONC = 32
FRACTION = 0.25
POLICIES = "lru,kvtier"
REMOTE_OVER_FLEET_HBM = 4
REMOTE_GBPS = 12.5
TARGET = 0.6  # kv-aware with remote over round-robin without, prefill tokens computed
# name -> (routing, remote tier on)
POINTS = {"round-robin": ("round-robin", False), "round-robin+remote": ("round-robin", True),
          "session": ("session", False), "kv-aware+remote": ("kv-aware", True)}
BASELINE = "round-robin"


def hbm_per_engine() -> tuple[int, dict]:
    """HBM blocks per engine that ``--hbm-fraction 0.25`` gives, and how it is derived."""
    from kvtier.replay import load_trace
    from kvtier.replay.profiles import DEFAULT_PROFILE, parse_profile
    from kvtier.replay.run import ReplaySpec, split_workload

    w = split_workload(load_trace(DEV_TRACE), SPLIT)
    spec = ReplaySpec(workload=w, profile=parse_profile(DEFAULT_PROFILE), concs=(CONC,), hbm_fractions=(FRACTION,),
                      engines=ENGINES)
    hbm = spec.capacities()[0]
    mean = sum(s.num_distinct_blocks() for s in w.sessions) / len(w.sessions)
    return hbm, {"hbm_fraction": FRACTION, "share_sessions": CONC / ENGINES,
                 "mean_distinct_blocks_per_session": mean, "distinct_blocks": w.num_distinct_blocks(),
                 "definition": f"HBM per engine = int({FRACTION} x min(distinct blocks of the {SPLIT} half, "
                               f"round(conc / engines x mean distinct blocks per session))) = int({FRACTION} x "
                               f"min({w.num_distinct_blocks()}, round({CONC}/{ENGINES} x {mean:.1f}))) = {hbm}: "
                               "25% of the working set of one engine's share of the live sessions"}


def args_for(routing: str, remote_blocks: int, policies: str) -> list[str]:
    args = ["--trace", os.path.relpath(DEV_TRACE, ROOT), "--split", SPLIT, "--hbm-fraction", str(FRACTION),
            "--conc", str(CONC), "--engines", str(ENGINES), "--routing", routing, "--policies", policies,
            "--skip-oversized"]
    if remote_blocks:
        args += ["--remote-blocks", str(remote_blocks), "--remote-gbps", str(REMOTE_GBPS)]
    return args


def run(name: str, args: list[str]) -> dict:
    out = OUT / f"fleet-dev-{name.replace('+', '-')}.json"
    cmd = [sys.executable, "-m", "kvtier.cli", "replay", *args, "--quiet", "--jobs", "1", "--json", str(out)]
    shown = "kvtier replay " + shlex.join(args)
    print(f"$ {shown}", file=sys.stderr, flush=True)
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise SystemExit(f"fleet_results: `{shown}` failed with exit status {proc.returncode}")
    report = json.loads(out.read_text())
    out.unlink()  # gathered into fleet-dev.json
    report["command"] = shown
    report["bench_wall_s"] = time.perf_counter() - start
    print(f"  {name}: {report['bench_wall_s']:.0f}s", file=sys.stderr, flush=True)
    return report


FIELDS = ("prefill_tokens_computed", "prefill_tokens_hit_remote", "ttft_p50_s", "ttft_p99_s", "ttft_p50_later_turns_s",
          "ttft_p99_later_turns_s", "remote_bytes_written", "remote_bytes_read", "handed_over", "num_requests",
          "skipped_requests", "hbm_blocks", "dram_blocks", "throughput_per_chip_tok_s", "wall_s")


def table(points: dict, policies: list[str]) -> str:
    head = ("policy", "point", "computed", "vs baseline", "TTFT p50 (s)", "TTFT p99 (s)", "later p99 (s)",
            "vs baseline", "remote wr GB", "remote rd GB")
    body = []
    for pol in policies:
        base = points[BASELINE][pol]
        for name, rows in points.items():
            r = rows[pol]
            body.append((pol, name, f"{r['prefill_tokens_computed'] / 1e6:.2f}M",
                         f"{r['prefill_tokens_computed'] / base['prefill_tokens_computed']:.3f}x",
                         f"{r['ttft_p50_s']:.2f}", f"{r['ttft_p99_s']:.2f}", f"{r['ttft_p99_later_turns_s']:.2f}",
                         f"{r['ttft_p99_later_turns_s'] / base['ttft_p99_later_turns_s']:.3f}x",
                         f"{r['remote_bytes_written'] / 1e9:.0f}", f"{r['remote_bytes_read'] / 1e9:.0f}"))
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(head, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(b, widths)) for b in body]
    return "\n".join(lines)


def plot(points: dict, policies: list[str], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(points)
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    width = 0.8 / len(policies)
    for ax, key, label in ((axes[0], "prefill_tokens_computed", "prefill tokens computed (M)"),
                           (axes[1], "ttft_p99_later_turns_s", "later-turn TTFT p99 (s)")):
        for j, pol in enumerate(policies):
            vals = [points[n][pol][key] / (1e6 if key.startswith("prefill") else 1) for n in names]
            xs = [i + (j - (len(policies) - 1) / 2) * width for i in range(len(names))]
            ax.bar(xs, vals, width, label=pol)
        if key.startswith("prefill"):
            for j, pol in enumerate(policies):
                ax.axhline(TARGET * points[BASELINE][pol][key] / 1e6, color=f"C{j}", ls="--", lw=0.8,
                           label=f"target {TARGET}x round-robin ({pol})")
        ax.set_xticks(range(len(names)), names, rotation=15)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=2, help="replays run at once, one (point, policy) each (default 2)")
    ap.add_argument("--policies", default=POLICIES, help=f"placement policies per point (default {POLICIES})")
    args = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    policies = [p for p in args.policies.split(",") if p]
    start = time.perf_counter()
    hbm, hbm_how = hbm_per_engine()
    remote_blocks = REMOTE_OVER_FLEET_HBM * ENGINES * hbm
    points: dict[str, dict] = {name: {} for name in POINTS}
    commands: dict[str, dict[str, str]] = {name: {} for name in POINTS}
    header: dict = {}
    # one replay per (point, policy), args.jobs at once: the slow policy's runs do not leave a core idle
    tasks = [(name, pol) for pol in reversed(policies) for name in POINTS]
    with ThreadPoolExecutor(args.jobs) as pool:
        reports = pool.map(lambda t: run(f"{t[0]}-{t[1]}", args_for(POINTS[t[0]][0], remote_blocks
                                                                      if POINTS[t[0]][1] else 0, t[1])), tasks)
        for (name, pol), report in zip(tasks, reports):
            commands[name][pol] = report["command"]
            header = {k: report[k] for k in ("kvtier_version", "trace", "profile", "block_size", "workload",
                                             "admission", "surface", "skip_oversized", "skipped")}
            (row,) = report["results"]
            points[name][pol] = {k: row.get(k) for k in FIELDS}
            assert row["hbm_blocks"] == hbm, (row["hbm_blocks"], hbm)
    ratios = {pol: {name: {"prefill_computed_vs_baseline": points[name][pol]["prefill_tokens_computed"]
                           / points[BASELINE][pol]["prefill_tokens_computed"],
                           "ttft_p99_later_vs_baseline": points[name][pol]["ttft_p99_later_turns_s"]
                           / points[BASELINE][pol]["ttft_p99_later_turns_s"]} for name in points}
              for pol in policies}
    target = {pol: {"kv_aware_remote_over_round_robin": ratios[pol]["kv-aware+remote"]["prefill_computed_vs_baseline"],
                    "target": TARGET,
                    "holds": ratios[pol]["kv-aware+remote"]["prefill_computed_vs_baseline"] <= TARGET}
              for pol in policies}
    result = {
        **header,
        "modelled": True,
        "what": "kvtier replay --engines: a fleet of modelled engines; every figure is modelled, not measured",
        "settings": {"engines": ENGINES, "conc": CONC, "conc_is": "live sessions over the whole fleet",
                     "split": SPLIT, "split_rule": "sessions sorted by id; 1st, 3rd, ... tune, 2nd, 4th, ... eval",
                     "hbm_blocks_per_engine": hbm, "hbm": hbm_how,
                     "dram_blocks_per_engine": 2 * hbm, "ssd_blocks_per_engine": 0,
                     "remote_blocks": remote_blocks,
                     "remote_blocks_is": f"{REMOTE_OVER_FLEET_HBM}x the fleet's HBM: {REMOTE_OVER_FLEET_HBM} x "
                                         f"{ENGINES} engines x {hbm} blocks",
                     "remote_gbps_per_engine_link": REMOTE_GBPS,
                     "remote_gbps_is": "an assumed 100 Gb/s NIC per engine, each way; time = bytes / bandwidth",
                     "policies": policies, "jobs": args.jobs,
                     "parallelism": f"one replay process per (point, policy), {args.jobs} at once",
                     "sessions": "every session of the evaluation half (none left out)"},
        "commands": commands,
        "baseline": BASELINE,
        "points": points,
        "ratios": ratios,
        "target": target,
        "bench_wall_s": time.perf_counter() - start,
    }
    out = OUT / "fleet-dev.json"
    out.write_text(json.dumps(result, indent=2, default=float) + "\n")
    title = (f"MODELLED fleet: {ENGINES} engines, conc {CONC}, HBM {hbm:,} + DRAM {2 * hbm:,} blocks per engine; "
             f"remote {remote_blocks:,} blocks at {REMOTE_GBPS:g} GB/s per engine ({SPLIT} half of the dev traces)")
    plot(points, policies, OUT / "fleet-dev.png", title)
    print(title)
    print(table(points, policies))
    for pol, t in target.items():
        verdict = "holds" if t["holds"] else "MISSED"
        print(f"target ({pol}): kv-aware+remote computes {t['kv_aware_remote_over_round_robin']:.3f}x the prefill "
              f"tokens of round-robin without remote (target <= {TARGET}x): {verdict}")
    print(f"wrote {out.relative_to(ROOT)} and bench/out/fleet-dev.png in {result['bench_wall_s']:.0f}s",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
