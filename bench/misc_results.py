#!/usr/bin/env python3
"""Regenerate the JSON behind the README's rounds and shared-context tables.

Owns: running, each as its own subprocess, the ``kvtier`` commands whose
figures the README's "Shared context across agents" section shows, and
writing them under ``bench/out/``:

* ``rounds.json``: ``kvtier replay --workload rounds`` at every point of the
  capacity table (HBM KV capacity: the profile's default, then
  ``--hbm-blocks 4000, 2000, 1000``; output tokens 32, 64 and the default),
  plus the same output tokens at the default capacity with
  ``--round-latency ttft``. Each run keeps its command line (``--json FILE``
  was appended to it) and the report it wrote;
* ``shared.json``: ``kvtier bench shared`` run ``--shared-runs`` times in a
  row (its timings move with the machine's load; its byte figures do not),
  each run's command line and report.

Both files also name the commit of the code that produced them and whether
``kvtier/`` had uncommitted changes (``kvtier_dirty``); every run records its
seconds and the machine's 1-minute load average before and after it, since
other jobs on a shared machine move the timings.

Must not: render or edit any document (``bench/readme_tables.py`` does, with
the renderers in ``bench/misc_tables.py``), change the commands' defaults,
or run anything in parallel (one subprocess at a time: the figures of
``kvtier bench shared`` are timings).

Usage::

    python bench/misc_results.py                 # both files, into bench/out/
    python bench/misc_results.py --only rounds   # just rounds.json
    python bench/readme_tables.py                # then rewrite the tables

The subprocesses import ``kvtier`` from this checkout (``PYTHONPATH`` is set
to the directory above ``bench/``), with the interpreter running this script.
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
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from kvtier.provenance import provenance

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "out"

# The rounds table: rows are HBM KV capacities (None: the profile's default, no
# --hbm-blocks), columns output tokens per agent per round (None: the default,
# no --output-tokens). The ttft row repeats the first row's capacity with the
# SLO on time to first token.
ROUNDS_HBM_BLOCKS: tuple[int | None, ...] = (None, 4000, 2000, 1000)
ROUNDS_OUTPUT_TOKENS: tuple[int | None, ...] = (32, 64, None)
ROUNDS_TTFT_HBM_BLOCKS: int | None = None

# Runs kvtier's own command line (kvtier/cli.py's main) under the name "kvtier".
_KVTIER = "import sys; from kvtier.cli import main; sys.argv[0] = 'kvtier'; sys.exit(main())"


def _kvtier(args: list[str], timeout_s: float) -> float:
    """Run ``kvtier ARGS`` from this checkout; seconds it took. Fails loudly on a non-zero exit."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _KVTIER, *args], cwd=ROOT, env=env, timeout=timeout_s,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode:
        raise SystemExit(f"misc_results: `kvtier {shlex.join(args)}` exited {proc.returncode}:\n{proc.stdout}")
    return time.perf_counter() - start


def _source() -> dict[str, Any]:
    """Where these figures come from (:func:`kvtier.provenance.provenance`) and on what."""
    return {**provenance(), "python": sys.version.split()[0], "cpu_count": os.cpu_count(),
            "generated_by": "bench/misc_results.py",
            "generated_at": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}


def _run_json(args: list[str], tmp: Path, timeout_s: float) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run ``kvtier ARGS --json FILE``; the report it wrote, and the run's seconds and the
    machine's 1-minute load average before and after it (timings move with other jobs' load)."""
    path = tmp / "report.json"
    path.unlink(missing_ok=True)
    before = os.getloadavg()[0]
    seconds = _kvtier([*args, "--json", str(path)], timeout_s)
    meta = {"seconds": round(seconds, 2), "loadavg_1m_before": round(before, 2),
            "loadavg_1m_after": round(os.getloadavg()[0], 2)}
    return json.loads(path.read_text()), meta


def rounds(tmp: Path, timeout_s: float, log) -> dict[str, Any]:
    points = [(hbm, out, "full") for hbm in ROUNDS_HBM_BLOCKS for out in ROUNDS_OUTPUT_TOKENS]
    points += [(ROUNDS_TTFT_HBM_BLOCKS, out, "ttft") for out in ROUNDS_OUTPUT_TOKENS]
    runs = []
    for hbm, out, latency in points:
        args = ["replay", "--workload", "rounds"]
        args += ["--hbm-blocks", str(hbm)] if hbm is not None else []
        args += ["--output-tokens", str(out)] if out is not None else []
        args += ["--round-latency", latency] if latency != "full" else []
        args += ["--quiet"]
        report, meta = _run_json(args, tmp, timeout_s)
        log(f"[misc_results] kvtier {shlex.join(args)}: {meta['seconds']:.1f} s")
        runs.append({"command": "kvtier " + shlex.join(args), "argv": args, "hbm_blocks_arg": hbm,
                     "output_tokens_arg": out, "latency_arg": latency, **meta, "report": report})
    return {**_source(), "runs": runs}


def shared(tmp: Path, timeout_s: float, num_runs: int, log) -> dict[str, Any]:
    args = ["bench", "shared"]
    runs = []
    for i in range(num_runs):
        report, meta = _run_json(args, tmp, timeout_s)
        log(f"[misc_results] kvtier {shlex.join(args)} ({i + 1}/{num_runs}): {meta['seconds']:.1f} s, "
            f"load average {meta['loadavg_1m_before']:.2f} -> {meta['loadavg_1m_after']:.2f}")
        runs.append({"command": "kvtier " + shlex.join(args), "argv": args, **meta, "report": report})
    return {**_source(), "runs": runs}


def _write(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=["rounds", "shared"], help="regenerate one file only (default: both)")
    ap.add_argument("--shared-runs", type=int, default=5,
                    help="runs of `kvtier bench shared` (default 5; the table shows each timing's range)")
    ap.add_argument("--out", type=Path, default=OUT, help="directory to write into (default bench/out)")
    ap.add_argument("--timeout-s", type=float, default=600.0, help="limit per subprocess (default 600 s)")
    args = ap.parse_args(argv)
    if args.shared_runs < 1:
        ap.error("--shared-runs must be >= 1")

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvtier-misc-results-") as tmp:
        if args.only in (None, "rounds"):
            _write(args.out / "rounds.json", rounds(Path(tmp), args.timeout_s, log))
            log(f"[misc_results] wrote {args.out / 'rounds.json'}")
        if args.only in (None, "shared"):
            _write(args.out / "shared.json", shared(Path(tmp), args.timeout_s, args.shared_runs, log))
            log(f"[misc_results] wrote {args.out / 'shared.json'}")
    log(f"[misc_results] done in {time.perf_counter() - start:.1f} s; now run `python bench/readme_tables.py`")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
