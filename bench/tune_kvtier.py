#!/usr/bin/env python3
"""Tune the ``kvtier`` placement policy's constants on the tuning half of the dev traces only.

Owns: the search of ``KVTier.next_use_trust`` (how much the predicted wait
moves a waiting agent's blocks in the next-use order: rank = wait start +
trust x predicted wait; 0 orders by wait start alone) and ``KVTier.user_wait_s``
(the wait that order expects after a turn that called no tool: a user's
turn, or an agent that is done) over a fixed grid (with trust 0 the second
does not matter, and is tried once),
replayed on the *tuning* half of the dev traces (``--split tune``: sessions
sorted by id, the 1st, 3rd, ...) at the two points of the README's
placement results, DRAM 2x HBM, no SSD: conc 8 at ``--hbm-fraction 0.25``,
and the pressure point, conc 16 with HBM held at that conc-8 size; and the
JSON it writes (``bench/out/tune-kvtier.json``: every pair's prefill
computed and later-turn TTFT p99 at both points, and the pair chosen: the
least prefill computed over both points, then the lowest pressure-point TTFT
p99, then the smaller values).
Must not read the evaluation half: the README reports the chosen constant
there (``bench/replay_results.py``), and ``tests/test_readme_tables.py``
checks that the shipped constants are the ones chosen here.

Usage: ``python bench/tune_kvtier.py [--jobs N]`` (about 12 minutes on 2 cores).

``--generalise`` asks how well that choice carries, and chooses nothing: the
same grid and points on each half of the tuning half (its sessions sorted by
id, alternately: a leave-sessions-out check, the pair chosen on one fold
scored on the other), on the whole tuning half, and on the evaluation half,
which is only reported. It writes ``bench/out/tune-kvtier-generalise.json``:
per part the grid's prefill, the pair each part would choose, and each
choice's excess prefill on the other parts over their own optimum (about 50
minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from replay_results import DEV_CONC, DEV_FRACTION, DEV_TRACE, conc8_hbm_blocks  # noqa: E402
OUT = ROOT / "bench" / "out" / "tune-kvtier.json"
TRUST_GRID: tuple[float, ...] = (0.0, 0.5, 1.0, 2.0)
# A user's turn in the dev traces' tuning half: p50 74 s, p75 268 s, mean 939 s after an end_turn
# (a tool call's: p50 8 s, p90 63 s); 60 s was the value before it was searched.
USER_WAIT_GRID: tuple[float, ...] = (60.0, 120.0, 300.0, 900.0)
GRID: tuple[tuple[float, float], ...] = ((0.0, USER_WAIT_GRID[0]),) + tuple(
    (t, u) for t in TRUST_GRID if t for u in USER_WAIT_GRID)
PRESSURE_CONC = 16


def _variant(trust: float, user_wait_s: float):
    from kvtier.placement.agent import KVTier

    name = f"kvtier-trust-{trust:g}-user-{user_wait_s:g}"
    cls = type(name.replace("-", "_").replace(".", "_"), (KVTier,),
               {"name": name, "next_use_trust": trust, "user_wait_s": user_wait_s})
    return name, cls


def _grid_rows(w: Any, hbm: int, jobs: int | None, label: str) -> list[dict[str, float]]:
    """Every pair of the grid replayed on workload ``w`` at both points (HBM ``hbm``, DRAM 2x, no SSD)."""
    from kvtier.placement import placement_names, register_placement
    from kvtier.replay.profiles import DEFAULT_PROFILE, parse_profile
    from kvtier.replay.run import ReplaySpec, default_jobs, run_replay

    names = {}
    for value in GRID:
        name, cls = _variant(*value)
        if name not in placement_names():  # once per process: every part replays the same grid
            register_placement(name, cls)
        names[name] = value
    points = {}
    for conc in (DEV_CONC, PRESSURE_CONC):
        spec = ReplaySpec(workload=w, profile=parse_profile(DEFAULT_PROFILE), policies=tuple(names),
                          concs=(conc,), hbm_blocks=(hbm,), skip_oversized=True, references=False,
                          jobs=jobs or default_jobs())
        report = run_replay(spec, on_point=lambda d, t, e, c=conc: print(f"[{label} conc {c}] {d}/{t} runs, {e:.0f}s",
                                                                          file=sys.stderr))
        points[conc] = {r["policy"]: r for r in report["results"]}
    return [{"next_use_trust": value[0], "user_wait_s": value[1],
             **{f"conc{c}_prefill_tokens_computed": points[c][name]["prefill_tokens_computed"] for c in points},
             **{f"conc{c}_ttft_p99_later_turns_s": points[c][name]["ttft_p99_later_turns_s"] for c in points}}
            for name, value in names.items()]


def _choose(rows: list[dict[str, float]]) -> dict[str, float]:
    """The least prefill computed over both points, then the lowest pressure-point TTFT p99, then smaller values."""
    return min(rows, key=lambda r: (_score(r), r[f"conc{PRESSURE_CONC}_ttft_p99_later_turns_s"],
                                    r["next_use_trust"], r["user_wait_s"]))


def _score(row: dict[str, float]) -> float:
    return sum(row[f"conc{c}_prefill_tokens_computed"] for c in (DEV_CONC, PRESSURE_CONC))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=None, help="worker processes (default: the CPUs available, <= 8)")
    ap.add_argument("--generalise", action="store_true",
                    help="report how the choice carries across folds and halves (writes tune-kvtier-generalise.json; "
                         "chooses nothing)")
    ap.add_argument("--parts", default="tune-fold-1,tune-fold-2,tune,eval",
                    help="with --generalise: the parts to replay, comma-separated (default: all four; others already "
                         "in the JSON, replayed by the same code, are kept)")
    args = ap.parse_args()
    if args.generalise:
        return generalise(args.jobs, tuple(p for p in args.parts.split(",") if p))
    from kvtier.replay import load_trace
    from kvtier.replay.run import split_workload

    w = split_workload(load_trace(DEV_TRACE), "tune")
    hbm = conc8_hbm_blocks(w)
    start = time.perf_counter()
    rows = _grid_rows(w, hbm, args.jobs, "tune")
    points = (DEV_CONC, PRESSURE_CONC)
    best = _choose(rows)
    OUT.write_text(json.dumps({
        "what": "KVTier.next_use_trust and KVTier.user_wait_s on the tuning half of the dev traces",
        "trace": str(DEV_TRACE.name), "split": "tune", "sessions": len(w.sessions), "hbm_blocks": hbm,
        "dram_blocks": 2 * hbm, "ssd_blocks": 0, "concs": list(points), "hbm_fraction": DEV_FRACTION,
        "rows": rows, "chosen_next_use_trust": best["next_use_trust"],
        "chosen_user_wait_s": best["user_wait_s"], "wall_s": time.perf_counter() - start,
    }, indent=2) + "\n")
    print(f"chosen next_use_trust = {best['next_use_trust']:g}, user_wait_s = {best['user_wait_s']:g}")
    return 0


def _folds(w: Any) -> dict[str, Any]:
    """The tuning half's two folds (its sessions sorted by id, alternately), the half itself, and the evaluation
    half: each a workload."""
    from dataclasses import replace

    from kvtier.replay import load_trace
    from kvtier.replay.run import split_workload

    ordered = sorted(w.sessions, key=lambda s: s.session_id)
    parts = {f"tune-fold-{i + 1}": replace(w, sessions=tuple(ordered[i::2])) for i in (0, 1)}
    return {**parts, "tune": w, "eval": split_workload(load_trace(DEV_TRACE), "eval")}


def generalise(jobs: int | None, wanted: tuple[str, ...]) -> int:
    """The grid on the ``wanted`` parts (both folds of the tuning half, the half, the evaluation half); what each
    would choose and what that choice costs on the others. Each part is merged into the JSON as it finishes, so
    parts can run in separate processes (the file's other parts are kept where the same code replayed them).
    Reads the evaluation half for the report only."""
    import fcntl
    import tempfile
    from dataclasses import fields

    from kvtier.placement.agent import KVTier
    from kvtier.provenance import provenance
    from kvtier.replay import load_trace
    from kvtier.replay.run import ReplaySpec, split_workload

    stamp = provenance(("kvtier", "bench/tune_kvtier.py"))  # at the start: the code that ran
    parts = _folds(split_workload(load_trace(DEV_TRACE), "tune"))
    unknown = sorted(set(wanted) - set(parts))
    if unknown:
        raise SystemExit(f"tune_kvtier: --parts {unknown[0]!r}: valid: {', '.join(parts)}")
    head: dict[str, Any] = {"what": "how the tuning of KVTier.next_use_trust and user_wait_s carries: the tuning "
                                    "half's two folds (leave-sessions-out), the half, the evaluation half (reported, "
                                    "never chosen on)",
                            "trace": DEV_TRACE.name, "concs": [DEV_CONC, PRESSURE_CONC], "hbm_fraction": DEV_FRACTION,
                            "shipped": [KVTier.next_use_trust, KVTier.user_wait_s],
                            **{f.name: f.default for f in fields(ReplaySpec) if f.name in ("surface", "scheduler")},
                            **stamp}
    target = OUT.with_name("tune-kvtier-generalise.json")
    for name in wanted:
        start = time.perf_counter()
        w = parts[name]
        hbm = conc8_hbm_blocks(w)
        rows = _grid_rows(w, hbm, jobs, name)
        best = _choose(rows)
        part = {"sessions": len(w.sessions), "hbm_blocks": hbm, "dram_blocks": 2 * hbm, "rows": rows,
                "chosen": [best["next_use_trust"], best["user_wait_s"]], "wall_s": time.perf_counter() - start}
        with open(Path(tempfile.gettempdir()) / "tune-kvtier-generalise.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            old = json.loads(target.read_text()) if target.exists() else {}
            kept = {k: p for k, p in old.get("parts", {}).items() if _same_code(p.get("commit"), stamp)}
            out = {**head, "parts": {**kept, name: {**part, "commit": stamp["commit"]}}}
            _cross(out)
            target.write_text(json.dumps(out, indent=2) + "\n")
        print(f"{name}: chooses {part['chosen']}; wrote {target}")
    return 0


def _same_code(commit: str | None, stamp: dict[str, Any]) -> bool:
    """Whether a part replayed at ``commit`` ran the code this run runs (nothing the replay reads differs)."""
    from kvtier.provenance import git

    if not commit or not stamp["commit"] or stamp["kvtier_dirty"] is not False:
        return False
    return git("diff", "--name-only", commit, stamp["commit"], "--", "kvtier", "bench/tune_kvtier.py") == ""


def _cross(out: dict[str, Any]) -> None:
    """Each part's choice scored on every part present, as its excess prefill over that part's own optimum."""
    parts = out["parts"]
    for part in parts.values():
        part["excess_on"] = {}
    for name, part in parts.items():
        by_pair = {(r["next_use_trust"], r["user_wait_s"]): _score(r) for r in part["rows"]}
        optimum = min(by_pair.values())
        for o in parts.values():
            o["excess_on"][name] = by_pair[tuple(o["chosen"])] / optimum - 1
        shipped = tuple(out["shipped"])
        part["shipped_excess"] = by_pair[shipped] / optimum - 1 if shipped in by_pair else None
        part["spread"] = max(by_pair.values()) / optimum - 1
    out["wall_s"] = sum(p["wall_s"] for p in parts.values())


if __name__ == "__main__":
    raise SystemExit(main())
