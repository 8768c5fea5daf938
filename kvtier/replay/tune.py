"""``kvtier tune``: search placement settings on recorded traffic, with the replay as the objective.

Owns: splitting a recording into a tuning part and a held-out part, the
search (successive halving over candidates sampled from each knob's grid in
:data:`kvtier.placement.params.KNOBS`), the held-out check of the winner
against the defaults, and the outputs: a kvtier config file (``placement``
section, plus ``tuned`` provenance) that the vLLM connector loads as its
``config_file`` and ``kvtier replay --config`` replays, a JSON of every
evaluation and a PNG of the search. Must not change how a point is replayed
(:func:`kvtier.replay.run.run_point` does that, as for ``kvtier replay``) or
read the held-out part before the search has chosen.

Search. A candidate is a policy and values of its knobs; the policy's own
constants (no knob set) is always one of them. Rung ``r`` of ``R`` replays
every surviving candidate on the first ``eta^-(R-1-r)`` of the tuning
sessions (spread over the part, so early rungs see the whole period), and
the best ``1/eta`` go on; the last rung uses all tuning sessions. Points run
in ``jobs`` forked processes. When the time budget runs out, no new rung
starts, and the best of the last finished rung wins.

Held out. Sessions are ordered by their recorded start (``start_unix_s`` of
a recorder's trace; by id for traces without one) and the last
``holdout`` share is kept apart; ``holdout="split"`` uses the replay's fixed
tuning / evaluation halves instead (``kvtier replay --split``). The winner and
the defaults are replayed on it; a winner that does no better there than the
defaults is reported as winning only in-sample.
"""

from __future__ import annotations

import math
import multiprocessing
import random
import time
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from ..errors import ConfigError
from ..placement import make_placement
from ..placement.params import KNOBS
from .model import Workload
from .run import CONFIG, ReplaySpec, run_point, slo_capacity, split_workload

OBJECTIVES = ("prefill", "ttft-p99", "slo-capacity")


@dataclass(frozen=True, slots=True)
class Candidate:
    """A policy and the knob values it runs with ({}: the policy's own constants)."""

    policy: str
    params: tuple[tuple[str, float], ...] = ()

    def describe(self) -> str:
        return self.policy + ("(" + ", ".join(f"{k}={v:g}" for k, v in self.params) + ")" if self.params
                              else " (defaults)")


@dataclass(slots=True)
class TuneResult:
    """Every evaluation, the winner and the held-out check."""

    objective: str
    rungs: list[list[dict[str, Any]]] = field(default_factory=list)
    best: Candidate | None = None
    default: Candidate | None = None
    holdout: dict[str, Any] = field(default_factory=dict)
    in_sample: dict[str, Any] = field(default_factory=dict)
    stopped_by_budget: bool = False
    elapsed_s: float = 0.0


def order_by_time(workload: Workload) -> Workload:
    """Sessions by recorded start (then id); sessions without a start time by id, first."""
    key = (lambda s: (s.recorded_at_s is not None, s.recorded_at_s or 0.0, s.session_id))
    return replace(workload, sessions=tuple(sorted(workload.sessions, key=key)))


def split_for_tuning(workload: Workload, holdout: str | float) -> tuple[Workload, Workload]:
    """(tuning part, held-out part) of ``workload`` (see the module doc)."""
    if holdout == "split":
        return split_workload(workload, "tune"), split_workload(workload, "eval")
    if not isinstance(holdout, (int, float)) or not 0 < holdout < 1:
        raise ConfigError("--holdout", holdout, "must be a fraction in (0, 1) or 'split'")
    ordered = order_by_time(workload)
    n = len(ordered.sessions)
    cut = n - max(1, round(n * holdout))
    if cut < 1:
        raise ConfigError("--holdout", holdout, f"leaves no session to tune on ({n} sessions in the recording)")
    return replace(ordered, sessions=ordered.sessions[:cut]), replace(ordered, sessions=ordered.sessions[cut:])


def candidates(policies: tuple[str, ...], knobs: tuple[str, ...], n: int, seed: int) -> list[Candidate]:
    """The policies' defaults, then up to ``n`` in all sampled from the knob grids (no repeats)."""
    from ..placement.agent import AgentAware

    # the policies with tunable constants: the agent-aware ones (what apply_params accepts)
    tunable = [p for p in policies if isinstance(make_placement(p, "--policies"), AgentAware)]
    bad = [k for k in knobs if k not in KNOBS]
    if bad:
        raise ConfigError("--knobs", ",".join(bad), f"unknown knob; valid: {', '.join(KNOBS)}")
    out = [Candidate(p) for p in policies]
    rng = random.Random(seed)
    space = math.prod(len(KNOBS[k].grid) for k in knobs) * len(tunable) if knobs else 0
    seen = set(out)
    while len(out) < min(n, len(policies) + space):
        policy = rng.choice(tunable)
        values = {k: rng.choice(KNOBS[k].grid) for k in knobs}
        if values.get("rho_min", 0.0) > values.get("rho_max", 1.0):
            values["rho_min"], values["rho_max"] = values["rho_max"], values["rho_min"]
        c = Candidate(policy, tuple(sorted(values.items())))
        if c not in seen:
            seen.add(c)
            out.append(c)
    return out


def _subset(workload: Workload, share: float) -> Workload:
    """About ``share`` of the sessions, spread evenly over the workload's order."""
    n = len(workload.sessions)
    k = max(1, round(n * share))
    picks = sorted({min(n - 1, int(i * n / k)) for i in range(k)})
    return replace(workload, sessions=tuple(workload.sessions[i] for i in picks))


def evaluate(spec: ReplaySpec, c: Candidate, objective: str, conc: int, hbm_blocks: int) -> dict[str, Any]:
    """One replay of candidate ``c``: its objective value (lower is better) and the figures behind it."""
    cspec = replace(spec, config_policy=c.policy, config_params=dict(c.params), references=False)
    if objective == "slo-capacity":
        cap = slo_capacity(cspec, CONFIG, hbm_blocks, spec.slo_ttft_p99_s, spec.slo_interactivity,
                           spec.slo_max_conc)
        return {"value": -cap["max_conc"], "slo_capacity": cap["max_conc"]}
    row = run_point(cspec, CONFIG, conc, hbm_blocks)
    ttft = row["ttft_p99_later_turns_s"]
    value = row["prefill_tokens_computed"] if objective == "prefill" else (ttft if ttft is not None else math.inf)
    return {"value": float(value), "prefill_tokens_computed": row["prefill_tokens_computed"],
            "ttft_p99_later_turns_s": ttft}


_WORKER: dict[str, Any] = {}


def _work(rung: int, index: int) -> dict[str, Any]:
    w = _WORKER
    return evaluate(w["specs"][rung], w["cands"][index], w["objective"], w["conc"], w["hbm"])


def tune(spec: ReplaySpec, tune_part: Workload, holdout_part: Workload, cands: list[Candidate], objective: str,
         conc: int, hbm_blocks: int, eta: int = 2, rungs: int = 3, budget_s: float = 600.0, jobs: int = 1,
         progress: Callable[[str], None] | None = None) -> TuneResult:
    """Successive halving of ``cands`` on ``tune_part``; then the winner and the
    defaults on ``holdout_part`` (see the module doc)."""
    if objective not in OBJECTIVES:
        raise ConfigError("--objective", objective, f"valid: {', '.join(OBJECTIVES)}")
    start = time.monotonic()
    result = TuneResult(objective)
    default = next(c for c in cands if not c.params and c.policy == cands[0].policy)
    result.default = default
    shares = [eta ** -(rungs - 1 - r) for r in range(rungs)]
    specs = [replace(spec, workload=_subset(tune_part, s)) for s in shares]
    alive = list(range(len(cands)))
    total = sum(math.ceil(len(cands) / eta ** r) for r in range(rungs))
    done = 0
    for r, rspec in enumerate(specs):
        if r and time.monotonic() - start > budget_s:
            result.stopped_by_budget = True
            break
        def tick(i: int, row: dict[str, Any], r: int = r) -> None:
            nonlocal done
            done += 1
            if progress is not None:
                shown = (f"{-row['value']:.0f} sessions" if objective == "slo-capacity"
                         else _fmt(row["value"], objective))
                progress(f"[tune] {done}/{total} rung {r + 1}/{len(specs)}: {cands[i].describe()} -> {shown} "
                         f"({time.monotonic() - start:.0f} s)")

        rows = _run_rung(rspec, r, cands, alive, objective, conc, hbm_blocks, jobs, tick)
        result.rungs.append([{"candidate": cands[i].describe(), "policy": cands[i].policy,
                              "params": dict(cands[i].params), "sessions": len(rspec.workload.sessions),
                              **rows[i]} for i in alive])
        ranked = sorted(alive, key=lambda i: (rows[i]["value"], i))
        alive = ranked[:max(1, math.ceil(len(alive) / eta))] if r < len(specs) - 1 else ranked[:1]
    best = cands[alive[0]]  # ranked: the best of the last finished rung
    result.best = best
    full = replace(spec, workload=tune_part)
    hold = replace(spec, workload=holdout_part)
    if progress:
        progress(f"[tune] checking {best.describe()} against {default.describe()} on the tuning part and the "
                 f"held-out part ({len(holdout_part.sessions)} sessions)")
    result.in_sample = _compare(full, best, default, objective, conc, hbm_blocks)
    result.holdout = _compare(hold, best, default, objective, conc, hbm_blocks)
    result.elapsed_s = time.monotonic() - start
    return result


def _compare(spec: ReplaySpec, best: Candidate, default: Candidate, objective: str, conc: int,
             hbm_blocks: int) -> dict[str, Any]:
    b = evaluate(spec, best, objective, conc, hbm_blocks)
    d = b if best == default else evaluate(spec, default, objective, conc, hbm_blocks)
    gain = None if not d["value"] or not math.isfinite(d["value"]) else (d["value"] - b["value"]) / abs(d["value"])
    return {"sessions": len(spec.workload.sessions), "best": b, "default": d, "gain": gain}


def _run_rung(spec: ReplaySpec, rung: int, cands: list[Candidate], alive: list[int], objective: str, conc: int,
              hbm_blocks: int, jobs: int, on_done: Callable[[int, dict[str, Any]], None]) -> dict[int, dict[str, Any]]:
    rows: dict[int, dict[str, Any]] = {}
    if jobs <= 1 or len(alive) == 1 or "fork" not in multiprocessing.get_all_start_methods():
        for i in alive:
            rows[i] = evaluate(spec, cands[i], objective, conc, hbm_blocks)
            on_done(i, rows[i])
        return rows
    _WORKER.update(specs={rung: spec}, cands=cands, objective=objective, conc=conc, hbm=hbm_blocks)
    try:
        with ProcessPoolExecutor(min(jobs, len(alive)), mp_context=multiprocessing.get_context("fork")) as pool:
            pending: dict[Future, int] = {pool.submit(_work, rung, i): i for i in alive}
            while pending:
                finished, _ = wait(pending, return_when=FIRST_COMPLETED)
                for fut in finished:
                    i = pending.pop(fut)
                    rows[i] = fut.result()
                    on_done(i, rows[i])
    finally:
        _WORKER.clear()
    return rows


# ---------------------------------------------------------------- command line

DESCRIPTION = """Search placement settings on recorded traffic (or any trace kvtier replay reads), with the
replay as the objective, and write a kvtier config file that the vLLM connector loads as its config_file
and kvtier replay --config replays.

The recording is split by time: the last --holdout share of its sessions is kept apart, the search runs on
the rest (successive halving: every candidate on a slice of the sessions, the best 1/eta of them on a larger
slice, ...), and the winner is then replayed against the policy's defaults on the held-out part. A winner
that does not beat the defaults there is reported as winning only in-sample.

  kvtier tune --trace recording/ --hbm-blocks 4000 --dram-blocks 8000 --out kvtier-tuned.yaml --plot tune.png
  kvtier tune --trace ../shared/traces/weka_claude_code/weka_dev_120.tar.xz --holdout split --hbm-fraction 0.25
"""


def add_arguments(p: Any) -> None:
    from ..cliargs import nonnegative_int, positive_float, positive_int, writable_file

    p.add_argument("--trace", required=True, metavar="PATH",
                   help="a recording directory (the connector's record_path) or any trace kvtier replay reads")
    p.add_argument("--objective", choices=OBJECTIVES, default="prefill",
                   help="what to minimize: prefill tokens computed (default), later-turn TTFT p99, or maximize "
                        "slo-capacity (needs --slo-ttft-p99 and/or --slo-interactivity)")
    p.add_argument("--policies", default="kvtier", metavar="P[,P...]",
                   help="policies to consider; knobs are searched for the agent-aware ones (default kvtier)")
    p.add_argument("--knobs", default="next_use_trust,rho_max,critical_at,prefetch_lead_factor", metavar="K[,K...]",
                   help=f"knobs to search (default next_use_trust,rho_max,critical_at,prefetch_lead_factor; "
                        f"all: {','.join(KNOBS)})")
    p.add_argument("--candidates", type=positive_int, default=16, help="candidates sampled (default 16)")
    p.add_argument("--eta", type=positive_int, default=2, help="keep the best 1/eta after each rung (default 2)")
    p.add_argument("--rungs", type=positive_int, default=3, help="rungs of successive halving (default 3)")
    p.add_argument("--budget-s", type=positive_float, default=600.0,
                   help="no new rung starts after this many seconds (default 600)")
    p.add_argument("--holdout", default="0.25", metavar="F|split",
                   help="held-out share of the sessions, the latest by recorded start (default 0.25), or 'split' "
                        "for the replay's fixed tuning / evaluation halves")
    p.add_argument("--conc", type=positive_int, default=8, help="live session trees replayed at once (default 8)")
    cap = p.add_mutually_exclusive_group()
    cap.add_argument("--hbm-blocks", type=positive_int, help="HBM capacity in blocks (your engine's)")
    cap.add_argument("--hbm-fraction", type=positive_float, default=None,
                     help="HBM as a share of the recording's working set (default 0.25 without --hbm-blocks)")
    p.add_argument("--dram-blocks", type=nonnegative_int, help="DRAM tier capacity in blocks (default 2x HBM)")
    p.add_argument("--ssd-blocks", type=nonnegative_int, default=0, help="SSD tier capacity in blocks (default 0)")
    p.add_argument("--profile", default=None, metavar="HW:MODEL[:CHIPS]", help="hardware profile (as kvtier replay)")
    p.add_argument("--block-size", type=positive_int, metavar="TOKENS", help="re-block the trace to this size")
    p.add_argument("--skip-oversized", action="store_true",
                   help="skip requests larger than HBM (counted, alike for every candidate)")
    p.add_argument("--slo-ttft-p99", type=positive_float, metavar="S", help="slo-capacity: later-turn TTFT p99 bound")
    p.add_argument("--slo-interactivity", type=positive_float, metavar="TOK_S",
                   help="slo-capacity: p50 interactivity floor (tokens/s/user)")
    p.add_argument("--seed", type=nonnegative_int, default=0, help="seed of the candidate sample (default 0)")
    p.add_argument("--jobs", type=positive_int, metavar="N", help="worker processes (default: CPUs, at most 8)")
    p.add_argument("--out", default="kvtier-tuned.yaml", type=writable_file,
                   help="the config file to write (default kvtier-tuned.yaml)")
    p.add_argument("--json", metavar="PATH", type=writable_file, help="also write every evaluation as JSON")
    p.add_argument("--plot", metavar="PATH.png", type=writable_file, help="also plot the search (needs matplotlib)")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")


def command(args: Any) -> int:
    import json
    import sys

    from .profiles import DEFAULT_PROFILE, parse_profile
    from .readers import load_trace
    from .run import check_capacity, default_jobs

    progress = (lambda m: None) if args.quiet else (lambda m: print(m, file=sys.stderr, flush=True))
    holdout: str | float = args.holdout
    if holdout != "split":
        try:
            holdout = float(holdout)
        except ValueError:
            raise ConfigError("--holdout", args.holdout, "must be a fraction in (0, 1) or 'split'") from None
    if args.objective == "slo-capacity" and args.slo_ttft_p99 is None and args.slo_interactivity is None:
        raise ConfigError("--objective", args.objective, "slo-capacity needs --slo-ttft-p99 and/or --slo-interactivity")
    policies = tuple(p for p in args.policies.split(",") if p)
    knobs = tuple(k for k in args.knobs.split(",") if k)
    cands = candidates(policies, knobs, args.candidates, args.seed)  # bad names fail before any work
    profile = parse_profile(args.profile or DEFAULT_PROFILE)
    progress(f"[tune] loading {args.trace} ...")
    try:
        workload = load_trace(args.trace)
    except FileNotFoundError as exc:
        raise ConfigError("--trace", args.trace, str(exc)) from None
    if args.block_size and args.block_size != workload.block_size:
        a, b = sorted((args.block_size, workload.block_size))
        if b % a:
            raise ConfigError("--block-size", args.block_size, f"the trace has blocks of {workload.block_size} "
                              "tokens; re-blocking needs one to be a multiple of the other")
        workload = workload.reblock(args.block_size)
    tune_part, held = split_for_tuning(workload, holdout)
    base = ReplaySpec(workload=workload, profile=profile, concs=(args.conc,),
                      hbm_blocks=(args.hbm_blocks,) if args.hbm_blocks else None,
                      hbm_fractions=None if args.hbm_blocks else (args.hbm_fraction or 0.25,),
                      dram_blocks=args.dram_blocks, ssd_blocks=args.ssd_blocks, trace_name=str(args.trace),
                      skip_oversized=args.skip_oversized, references=False, jobs=1,
                      slo_ttft_p99_s=args.slo_ttft_p99, slo_interactivity=args.slo_interactivity)
    hbm = base.capacities(args.conc)[0]
    base = replace(base, hbm_blocks=(hbm,), hbm_fractions=None)
    check_capacity(base)  # requests larger than HBM: the replay's message, before any work
    progress(f"[tune] {len(tune_part.sessions)} sessions to tune on, {len(held.sessions)} held out; "
             f"{len(cands)} candidates, objective {args.objective}, conc {args.conc}, HBM {hbm:,} blocks")
    result = tune(base, tune_part, held, cands, args.objective, args.conc, hbm, eta=args.eta, rungs=args.rungs,
                  budget_s=args.budget_s, jobs=args.jobs or default_jobs(), progress=progress)
    assert result.best is not None and result.default is not None
    summary = _summary(result, holdout)
    print(summary)
    _write_config(args.out, result, str(args.trace), summary)
    print(f"wrote {args.out} (load it with kv_connector_extra_config config_file, or kvtier replay --config)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({**_as_json(result, args), "hbm_blocks": hbm, "dram_blocks": base.dram_blocks or 2 * hbm,
                       "tune_sessions": len(tune_part.sessions), "holdout_sessions": len(held.sessions),
                       "candidates": [c.describe() for c in cands]}, f, indent=2, default=str)
            f.write("\n")
    if args.plot:
        _plot(result, args.plot)
    return 0


def _objective_word(objective: str) -> str:
    return {"prefill": "prefill tokens computed", "ttft-p99": "later-turn TTFT p99",
            "slo-capacity": "SLO capacity (sessions)"}[objective]


def _fmt(value: float, objective: str) -> str:
    return f"{value:,.0f}" if objective == "prefill" else f"{value:.2f} s"


def _gain_text(cmp: dict[str, Any], objective: str) -> str:
    """Tuned vs defaults on one part: the objective, and the other figure beside it."""
    b, d = cmp["best"], cmp["default"]
    if objective == "slo-capacity":
        return f"SLO capacity {b['slo_capacity']} vs {d['slo_capacity']} sessions"
    parts = []
    for key, word, kind in (("prefill_tokens_computed", "prefill computed", "prefill"),
                            ("ttft_p99_later_turns_s", "later-turn TTFT p99", "ttft-p99")):
        x, y = b.get(key), d.get(key)
        if x is None or y is None:
            parts.append(f"{word} n/a")
            continue
        change = f" ({x / y - 1:+.1%})" if y else ""
        parts.append(f"{word} {_fmt(x, kind)} vs {_fmt(y, kind)}{change}")
    return "; ".join(parts)


def _summary(result: TuneResult, holdout: str | float) -> str:
    best, default = result.best, result.default
    assert best is not None and default is not None
    where = ("the evaluation half" if holdout == "split" else f"the last {holdout:.0%} of sessions by start time")
    better_out = result.holdout["best"]["value"] < result.holdout["default"]["value"]
    better_in = result.in_sample["best"]["value"] < result.in_sample["default"]["value"]
    if best == default:
        verdict = "the defaults won the search: nothing to change"
    elif better_out:
        verdict = "better than the defaults on the held-out part too"
    elif better_in:
        verdict = "wins only in-sample: no better than the defaults on the held-out part"
    else:
        verdict = "no better than the defaults"
    lines = [f"best: {best.describe()} ({verdict}; objective: {_objective_word(result.objective)})",
             "  tuned vs defaults:",
             f"    tuning part ({result.in_sample['sessions']} sessions): "
             f"{_gain_text(result.in_sample, result.objective)}",
             f"    held out, {where} ({result.holdout['sessions']} sessions): "
             f"{_gain_text(result.holdout, result.objective)}",
             f"  {sum(len(r) for r in result.rungs)} replays in {len(result.rungs)} rung(s), {result.elapsed_s:.0f} s"
             + (" (stopped by --budget-s)" if result.stopped_by_budget else "")]
    return "\n".join(lines)


def _write_config(path: str, result: TuneResult, trace: str, summary: str) -> None:
    import datetime

    import yaml

    best = result.best
    assert best is not None
    placement: dict[str, Any] = {"policy": best.policy, **dict(best.params)}
    held = result.holdout
    holdout = f"tuned vs defaults on {held['sessions']} held-out sessions: {_gain_text(held, result.objective)}"
    data = {"placement": placement,
            "tuned": {"trace": trace, "objective": result.objective,
                      "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                      "holdout": holdout}}
    text = "# written by kvtier tune\n# " + summary.replace("\n", "\n# ") + "\n" + yaml.safe_dump(data, sort_keys=False)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def _as_json(result: TuneResult, args: Any) -> dict[str, Any]:
    from .. import __version__
    from ..provenance import provenance

    settings = {k: v for k, v in vars(args).items() if k not in ("func", "command", "out", "json", "plot", "quiet")}
    return {"trace": str(args.trace), "objective": result.objective, "settings": settings,
            "kvtier_version": __version__, **provenance(),
            "best": result.best.describe() if result.best else None,
            "best_placement": {"policy": result.best.policy, **dict(result.best.params)} if result.best else None,
            "default": result.default.describe() if result.default else None,
            "rungs": result.rungs, "in_sample": result.in_sample, "holdout": result.holdout,
            "stopped_by_budget": result.stopped_by_budget, "elapsed_s": result.elapsed_s}


def _plotted(entry: dict[str, Any], rung: list[dict[str, Any]]) -> float:
    """What the plot shows of one evaluation: its value over the best of its rung
    (rungs replay different sessions, so raw values do not compare across them)."""
    best = min(e["value"] for e in rung)
    return entry["value"] / best if best else 1.0


def _plot(result: TuneResult, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("--plot", path, "needs matplotlib (pip install 'kvtier[plot]')") from None
    fig, ax = plt.subplots(figsize=(8, 4.5))
    sessions = [r[0]["sessions"] for r in result.rungs]
    best = result.best.describe() if result.best else ""
    for name in {e["candidate"] for r in result.rungs for e in r}:
        pts = [(ri, _plotted(e, r)) for ri, r in enumerate(result.rungs) for e in r if e["candidate"] == name]
        style = {"color": "tab:red", "lw": 2.5, "zorder": 3, "label": f"best: {name}"} if name == best else (
            {"color": "tab:blue", "lw": 2, "label": f"defaults: {name}"} if "(defaults)" in name
            else {"color": "0.6", "lw": 1})
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", **style)
    ax.set_xticks(range(len(sessions)), [f"rung {i + 1}\n{n} sessions" for i, n in enumerate(sessions)])
    ax.set_ylabel(f"{_objective_word(result.objective)}\nover the rung's best (1 = best)")
    ax.set_title(f"kvtier tune: successive halving, {len(result.rungs[0])} candidates (gray: eliminated or tied)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
