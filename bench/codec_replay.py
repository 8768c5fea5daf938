#!/usr/bin/env python3
"""Compressed cold tiers on the dev traces: ``kvtier replay --cold-codec`` raw vs rq4 (rq3, bplane-zstd) (issue 24).

Owns: one run (one process and its forked workers, one load of the traces)
of the evaluation half of the dev Claude Code traces under every cold codec
asked for, on the same HBM / DRAM / SSD byte budgets; its figures in
``bench/out/replay-codec-dev-eval.json`` (per codec x policy: prefill tokens
computed, later-turn TTFT p99, the blocks DRAM and SSD hold), a PNG beside
it, a printed table, and :func:`markdown_table` (the README table from that
JSON). Must not change the model to favour a codec: the codec's figures come
from the profile it is given.

Setting: as ``bench/replay_results.py``'s ``dev-eval-ssd``: the evaluation half
(sessions sorted by id; 2nd, 4th, ...), every session of it, ``--hbm-fraction
0.25`` at conc 8, DRAM 2x HBM, SSD 4x HBM, oversized requests skipped alike
in every run; the live-capable policies (``lru, lru-dram, ttl, tokencake,
kvflow, kvtier``). DRAM and SSD stay byte budgets: a codec of ratio r makes
them hold floor(r x blocks). ``lru`` uses HBM only, so it is run once and its
row is the same under every codec. Columns, per lossy codec: compressed on
SSD only (the live connector's case: ``tiers.ssd.codec`` / ``cold_codec``;
DRAM holds raw slots) and on DRAM+SSD (modelled only), with ``--cores`` per
direction (default 2: the SSD tier's reader and writer threads); and the
first lossy codec on DRAM+SSD once more with ``--wide-cores`` (default 8),
what more host cores would buy. Next to every column, the floor (an
unbounded cache, same admission) and the bound (Belady over the blocks that
column's tiers hold) of the same run. Codecs: ``raw`` and ``rq4`` by default;
``--codecs raw,bplane-zstd,rq4,rq3`` adds the others.

The codecs' ratio and speed come from ``--codec-profile`` (default
``bench/out/codecs.json``, written by ``kvtier bench codecs --json``); the JSON
records which profile and the numbers used.

Usage: ``python bench/codec_replay.py [--codec-profile FILE] [--codecs raw,rq4,...]
[--cores N] [--wide-cores N] [--jobs N] [--out FILE.json]``. About 7 minutes on 2 cores (the
replays share memory bandwidth: two at once run at about half speed each).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shlex
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "out"
sys.path.insert(0, str(ROOT / "bench"))
from replay_results import DEV_CONC, DEV_FRACTION, DEV_TRACE, LIVE_POLICIES  # noqa: E402

DEFAULT_PROFILE = OUT / "codecs.json"
RESULT = OUT / "replay-codec-dev-eval.json"
PLOT = OUT / "replay-codec-dev-eval.png"
SPLIT = "eval"
CODECS = "raw,rq4"
CORES = 2  # the SSD tier's read_threads / write_threads: what kvtier's own codec runs on
WIDE_CORES = 8
HBM_ONLY = "lru"  # uses no cold tier: one run stands for every codec
SSD_OVER_HBM = 4
FIELDS = ("prefill_tokens_computed", "ttft_p99_later_turns_s", "ttft_p50_later_turns_s", "ttft_p99_s",
          "prefill_tokens_hit_hbm", "prefill_tokens_hit_dram", "prefill_tokens_hit_ssd", "throughput_per_chip_tok_s",
          "bytes_moved", "bytes_moved_per_link", "num_requests", "skipped_requests", "tiers_used", "wall_s")
COST_ORDER = ("ref", "kvtier", "tokencake", "kvflow", "lru-dram", "ttl", "lru")  # longest first: the pool packs better

_SPECS: dict[str, Any] = {}  # label -> ReplaySpec, inherited by forked workers


def _label(codec: str, tiers: tuple[str, ...], cores: int) -> str:
    if codec == "raw":
        return "raw"
    where = "SSD" if tiers == ("ssd",) else "DRAM+SSD"
    return f"{codec} {where}" + (" (modelled only)" if "dram" in tiers else "") + f", {cores} cores"


def _point(label: str, policy: str, conc: int, hbm: int) -> dict[str, Any]:
    from kvtier.replay.run import reference_point, run_point

    if policy == "ref":
        return reference_point(_SPECS[label], conc, hbm)
    return run_point(_SPECS[label], policy, conc, hbm)


def _command(args: list[str]) -> str:
    return "kvtier replay " + shlex.join(args)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--codec-profile", default=str(DEFAULT_PROFILE),
                    help="codec profile (kvtier bench codecs --json FILE.json; default bench/out/codecs.json)")
    ap.add_argument("--codecs", default=CODECS, help=f"cold codecs to compare, raw first (default {CODECS})")
    ap.add_argument("--cores", type=int, default=CORES,
                    help=f"CPU cores per direction (encode, decode) for every codec (default {CORES}: the SSD "
                         "tier's reader and writer threads)")
    ap.add_argument("--wide-cores", type=int, default=WIDE_CORES,
                    help=f"the first lossy codec on DRAM+SSD once more with this many cores (default {WIDE_CORES}; "
                         "0: skip)")
    ap.add_argument("--dram-over-hbm", type=float, default=2.0, help="DRAM budget in HBM's blocks (default 2)")
    ap.add_argument("--ssd-over-hbm", type=float, default=SSD_OVER_HBM,
                    help=f"SSD budget in HBM's blocks (default {SSD_OVER_HBM}; smaller: the cold tiers under pressure)")
    ap.add_argument("--policies", default=LIVE_POLICIES, help=f"placement policies (default {LIVE_POLICIES})")
    ap.add_argument("--jobs", type=int, default=min(8, len(os.sched_getaffinity(0))),
                    help="worker processes (default: the CPUs this process may use, at most 8)")
    ap.add_argument("--out", default=str(RESULT), help=f"JSON to write (default {RESULT.relative_to(ROOT)}; "
                                                       "the PNG goes beside it)")
    args = ap.parse_args()

    from dataclasses import replace

    from kvtier.errors import ConfigError
    from kvtier.replay import load_trace
    from kvtier.replay.codec import cold_codec, load_codec_profile
    from kvtier.replay.profiles import DEFAULT_PROFILE as HW_PROFILE, parse_profile
    from kvtier.replay.run import ReplaySpec, check_capacity, split_workload

    start = time.perf_counter()
    codecs = [c for c in args.codecs.split(",") if c]
    policies = [p for p in args.policies.split(",") if p]
    lossy = [c for c in codecs if c != "raw"]
    variants = [("raw", ("dram", "ssd"), args.cores)] if "raw" in codecs else []
    for c in lossy:
        variants += [(c, ("ssd",), args.cores), (c, ("dram", "ssd"), args.cores)]
    if lossy and args.wide_cores and args.wide_cores != args.cores:
        variants.append((lossy[0], ("dram", "ssd"), args.wide_cores))
    try:
        entries = {e["codec"]: e for e in load_codec_profile(args.codec_profile)}
        made = {v: cold_codec(v[0], args.codec_profile, tiers=v[1], cores=v[2]) for v in variants}
    except ConfigError as e:
        raise SystemExit(f"codec_replay: {e}") from None
    w = split_workload(load_trace(DEV_TRACE), SPLIT)
    base = ReplaySpec(workload=w, profile=parse_profile(HW_PROFILE), policies=tuple(policies), concs=(DEV_CONC,),
                      hbm_fractions=(DEV_FRACTION,), skip_oversized=True, trace_name=f"{DEV_TRACE.name} ({SPLIT} half)")
    hbm = base.capacities()[0]
    dram, ssd = int(args.dram_over_hbm * hbm), int(args.ssd_over_hbm * hbm)
    base = replace(base, hbm_blocks=(hbm,), hbm_fractions=None, dram_blocks=dram, ssd_blocks=ssd)
    skipped = check_capacity(base)
    labels = {v: _label(*v) for v in variants}
    for v, label in labels.items():
        _SPECS[label] = replace(base, cold_codec=made[v])
    first = labels[variants[0]]
    tasks = []
    for label in labels.values():
        tasks.append((label, "ref"))  # the floor and the bound with this codec's capacities
        tasks += [(label, pol) for pol in policies if pol != HBM_ONLY or label == first]
    tasks.sort(key=lambda t: COST_ORDER.index(t[1]) if t[1] in COST_ORDER else -1)
    print(f"codec_replay: {len(w.sessions)} sessions, {w.num_requests()} requests; HBM {hbm:,}, DRAM {dram:,}, "
          f"SSD {ssd:,} raw blocks; {len(tasks)} runs on {args.jobs} worker(s)", file=sys.stderr, flush=True)
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    ctx = multiprocessing.get_context("fork")
    with ProcessPoolExecutor(max(1, min(args.jobs, len(tasks))), mp_context=ctx) as pool:
        futures = {pool.submit(_point, label, pol, DEV_CONC, hbm): (label, pol) for label, pol in tasks}
        for fut, (label, pol) in futures.items():
            rows[(label, pol)] = fut.result()
            print(f"  {label} / {pol}: {rows[(label, pol)]['wall_s']:.0f}s", file=sys.stderr, flush=True)

    trace_arg = os.path.relpath(DEV_TRACE, ROOT)
    common = ["--trace", trace_arg, "--split", SPLIT, "--hbm-fraction", str(DEV_FRACTION), "--conc", str(DEV_CONC),
              "--skip-oversized", "--dram-blocks", str(dram), "--ssd-blocks", str(ssd)]
    results: dict[str, dict[str, Any]] = {}
    references: dict[str, dict[str, Any]] = {}
    described, commands = [], {}
    for v, label in labels.items():
        codec = made[v]
        results[label] = {}
        for pol in policies:
            row = rows[(first if pol == HBM_ONLY else label, pol)]
            entry = {k: row.get(k) for k in FIELDS}
            entry["dram_blocks_effective"] = codec.capacity_blocks("dram", dram)
            entry["ssd_blocks_effective"] = codec.capacity_blocks("ssd", ssd)
            entry["codec_encoded_blocks"] = row["counters"].get("codec_encoded_blocks", 0)
            entry["codec_decoded_blocks"] = row["counters"].get("codec_decoded_blocks", 0)
            if pol == HBM_ONLY and label != first:
                entry["same_run_as"] = first  # HBM only: no cold tier, no codec
            results[label][pol] = entry
        ref = rows[(label, "ref")]
        references[label] = {k: ref[k] for k in ("floor_prefill_tokens", "bound_prefill_tokens", "bound_exact",
                                                 "floor_ttft_p99_later_turns_s", "bound_ttft_p99_later_turns_s",
                                                 "total_blocks")}
        described.append({"label": label, **codec.describe(), "live": "dram" not in codec.tiers,
                          "dram_blocks_effective": codec.capacity_blocks("dram", dram),
                          "ssd_blocks_effective": codec.capacity_blocks("ssd", ssd),
                          "profile_entry": entries.get(codec.name)})
        tiers_arg = ",".join(codec.tiers)
        commands[label] = _command([*common, "--policies", ",".join(policies), "--cold-codec", codec.name,
                                    "--codec-profile", os.path.relpath(args.codec_profile, ROOT),
                                    "--cold-codec-tiers", tiers_arg,
                                    "--codec-cores", str(codec.cores)])
    data = {
        "what": "kvtier replay --cold-codec: the cold tiers (DRAM, SSD) stored with each codec of the profile, "
                "on the same byte budgets; modelled (kvtier.replay.codec); a codec on DRAM has no live "
                "counterpart (the connector's DRAM tier holds raw slots)",
        "trace": base.trace_name, "profile": base.profile.spec, "block_size": w.block_size,
        "workload": {"sessions": len(w.sessions), "requests": w.num_requests(),
                     "distinct_blocks": w.num_distinct_blocks()},
        "skipped": skipped,
        "settings": {"split": SPLIT, "sessions": "every session of the evaluation half", "conc": DEV_CONC,
                     "hbm_fraction": DEV_FRACTION, "hbm_blocks": hbm, "dram_blocks": dram, "ssd_blocks": ssd,
                     "capacities_are": "byte budgets in raw (bf16) blocks; a codec of ratio r holds floor(r x blocks)",
                     "cores": args.cores, "wide_cores": args.wide_cores, "policies": policies,
                     "hbm_only_policy": f"{HBM_ONLY}: run once (no cold tier), its row repeated under every codec",
                     "jobs": args.jobs},
        "codec_profile": {"path": os.path.relpath(args.codec_profile, ROOT),
                          "codecs": [entries[c] for c in codecs if c in entries]},
        "codecs": described,
        "commands": commands,
        "references": references,
        "results": results,
        "bench_wall_s": time.perf_counter() - start,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=2, default=float) + "\n")
    png = out.with_suffix(".png")
    plot(data, png)
    print(markdown_table(data))
    print(f"wrote {out} and {png} in {data['bench_wall_s']:.0f}s", file=sys.stderr)
    return 0


def _policies(data: dict[str, Any]) -> list[str]:
    return list(dict.fromkeys(p for rows in data["results"].values() for p in rows))


def markdown_table(data: dict[str, Any]) -> str:
    """The README table of ``replay-codec-dev-eval.json``: a caption (setting, profile,
    floor), then one row per policy and one column per codec: prefill tokens computed
    (and its ratio to raw) and later-turn TTFT p99; the first row, the blocks DRAM / SSD
    hold under each codec."""
    s = data["settings"]
    labels = list(data["results"])
    by_label = {c["label"]: c for c in data["codecs"]}
    raw = data["results"].get("raw", {})
    header = ["policy"] + [f"{lab} (x{by_label[lab]['ratio']:.2f})" for lab in labels]
    body = [["blocks held (DRAM / SSD)"] + [f"{by_label[lab]['dram_blocks_effective']:,} / "
                                           f"{by_label[lab]['ssd_blocks_effective']:,}" for lab in labels]]
    for pol in _policies(data):
        cells = [pol]
        for lab in labels:
            r = data["results"][lab].get(pol)
            if r is None:
                cells.append("-")
                continue
            base = raw.get(pol)
            vs = (f" ({r['prefill_tokens_computed'] / base['prefill_tokens_computed']:.3f}x)"
                  if base and lab != "raw" and base["prefill_tokens_computed"] else "")
            cells.append(f"{r['prefill_tokens_computed'] / 1e6:.2f}M{vs}, {r['ttft_p99_later_turns_s']:.1f} s")
        body.append(cells)
    refs = data["references"]
    for name, key in (("floor (unbounded cache)", "floor"), ("bound (Belady, same blocks)", "bound")):
        body.append([name] + [f"{refs[lab][key + '_prefill_tokens'] / 1e6:.2f}M, "
                              f"{refs[lab][key + '_ttft_p99_later_turns_s']:.1f} s" for lab in labels])
    caption = (f"Cold codecs on the dev traces ({data['trace']}, {data['workload']['sessions']} sessions, conc "
               f"{s['conc']}): HBM {s['hbm_blocks']:,}, DRAM {s['dram_blocks']:,}, SSD {s['ssd_blocks']:,} raw "
               f"blocks as byte budgets; codec ratio and speed per core from `{data['codec_profile']['path']}` "
               f"(`kvtier bench codecs`, engine KV); the codec runs on the host CPU, so the accelerator link "
               f"carries raw bytes. Each cell: prefill tokens computed (vs raw), later-turn TTFT p99. "
               f"{s['hbm_only_policy'].split(':')[0]} uses HBM only. SSD-only columns have a live counterpart "
               f"(`tiers.ssd.codec`, `cold_codec`); a compressed DRAM is modelled only. Modelled.\n\n")
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in body]
    return caption + "\n".join(lines) + "\n"


def plot(data: dict[str, Any], path: Path) -> None:
    """Prefill tokens computed and later-turn TTFT p99 per policy, one bar per codec; the floor dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(data["results"])
    policies = _policies(data)
    fig, axes = plt.subplots(1, 2, figsize=(14, 5))
    width = 0.8 / len(labels)
    for ax, key, scale, ylabel in ((axes[0], "prefill_tokens_computed", 1e6, "prefill tokens computed (M)"),
                                   (axes[1], "ttft_p99_later_turns_s", 1.0, "later-turn TTFT p99 (s)")):
        for j, lab in enumerate(labels):
            xs = [i + (j - (len(labels) - 1) / 2) * width for i in range(len(policies))]
            vals = [data["results"][lab][p][key] / scale if p in data["results"][lab] else 0.0 for p in policies]
            ax.bar(xs, vals, width, label=lab)
        ref = data["references"][labels[0]]
        ref_key = "floor_prefill_tokens" if key == "prefill_tokens_computed" else "floor_ttft_p99_later_turns_s"
        ax.axhline(ref[ref_key] / scale, color="k", ls="--", lw=0.8, label="floor (unbounded cache)")
        ax.set_xticks(range(len(policies)), policies, rotation=15)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=8)
    s = data["settings"]
    fig.suptitle(f"cold codecs, {data['trace']}: HBM {s['hbm_blocks']:,}, DRAM {s['dram_blocks']:,}, SSD "
                 f"{s['ssd_blocks']:,} raw blocks (byte budgets), conc {s['conc']}; profile "
                 f"{data['codec_profile']['path']} (modelled)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
