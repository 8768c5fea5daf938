#!/usr/bin/env python3
"""How well the hint plane predicts tool waits on the dev traces: ``DurationHistory`` against simple baselines.

Owns: replaying every tool wait of the dev Claude Code traces
(``weka_claude_code/weka_dev_120.tar.xz``, loaded as ``kvtier replay --trace``
loads it, split by :func:`kvtier.replay.run.split_workload`) through fresh
:class:`~kvtier.agents.predictor.DurationHistory` instances, scoring each
prediction against the wait that followed, and writing the figures to
``bench/out/tool_wait_predictor.json`` and a CDF plot
``bench/out/tool_wait_predictor.png``; a markdown table goes to stdout.
Must not: edit any document or other bench output, change the predictor or
the replay (it only calls their public functions), or read a clock into the
figures (they depend on the traces and the code alone).

What is measured, per split (``eval``: the evaluation half, the headline;
``tune``: the tuning half, shown apart and never mixed in):

* a tool wait is a request whose ``gap_cause`` is ``tool``: the agent waited
  ``gap_s`` seconds after its previous request for a tool to run. The traces
  name no tool (AgentX / Weka requests carry ``stop: tool_use`` but not which
  tool; :class:`kvtier.replay.Request` has no tool field), so every wait uses
  the one tool name ``tool`` -- as the replay itself does -- and the per-tool
  table has one row;
* waits are fed in time order: a prediction is made when the wait starts
  (absolute time ``session offset + arrival_s - gap_s``), the duration is
  observed when it ends (``session offset + arrival_s``), so a wait is never
  predicted from itself or from a wait still running. The session offset is
  its recorded start when the traces have one; the dev traces have none, so
  sessions run back to back in workload order (the order the replay starts
  them; each session's span is its last request's send plus ``api_time``);
* methods (each a fresh instance, all in the same sweep):
  ``kvtier``: ``DurationHistory(4096, global_fallback=True)`` with
  ``agent_type`` = the session id, the live chain of the request-stream hints
  (per (session, tool), then per tool, then over all tools);
  ``replay-chain``: ``DurationHistory(4096)`` with ``agent_type`` = the trace's
  agent type (``main``, ``Explore``, ...), the replay's own chain (per (agent
  type, tool), then per tool);
  ``global-mean``: the running arithmetic mean of every wait observed so far;
  ``default-10s``: the connector's wait when nobody predicted one
  (:data:`kvtier.placement.base.UNPREDICTED_GAP_S`, 10 s) for every wait;
  ``tool-median`` (an extra reference): the ``kvtier`` instance's own
  ``quantile_s(tool, 0.5)``, the median of the tool's last 256 durations;
* per method: waits, how many it predicted (``None`` = no estimate yet:
  "unpredicted"), median / p90 / mean absolute error over the ones it
  predicted, the same over all waits with an unpredicted one scored as the
  10 s default, the same over the waits every method predicted (a common
  subset), the share of predictions the wait outran, and the median true
  wait. Quantiles interpolate linearly (numpy's default).

Usage: ``python bench/tool_wait_predictor.py [--traces DIR] [--out DIR]``
(defaults: ``../shared/traces`` beside the checkout, ``bench/out``). A few
seconds.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere: import kvtier from this checkout
    sys.path.insert(0, str(ROOT))

from kvtier.agents.predictor import DurationHistory  # noqa: E402
from kvtier.placement.base import UNPREDICTED_GAP_S  # noqa: E402
from kvtier.provenance import git, provenance  # noqa: E402
from kvtier.replay.model import Workload  # noqa: E402

DEFAULT_TRACES = ROOT.parent / "shared" / "traces"
DEFAULT_OUT = ROOT / "bench" / "out"
TRACE_SET = "weka_claude_code/weka_dev_120.tar.xz"  # the dev traces (bench/replay_results.py DEV_TRACE)
JSON_NAME = "tool_wait_predictor.json"
PNG_NAME = "tool_wait_predictor.png"
SPLITS = ("eval", "tune")
MAX_KEYS = 4096  # kvtier.agents.graph.GraphLimits.max_history_keys
TOOL = "tool"  # the one tool name: the traces name no tool (the replay uses the same name)
TOOL_NAME_NOTE = (
    "the dev traces carry no tool names: AgentX/Weka requests have stop='tool_use', output_types and (on a "
    "sub-agent entry) tool_use_count, but not which tool ran, and kvtier.replay.Request has no tool field; every "
    "wait uses the single tool name 'tool' (as the replay does), so per-tool is one row equal to overall. "
    "(tracelab_example/ names tools, 19 rounds, but no kvtier.replay reader loads it.)")

METHODS: dict[str, str] = {
    "kvtier": "DurationHistory(4096, global_fallback=True), agent_type = session id: per (session, tool) -> "
              "per tool -> all tools (the live request-stream chain)",
    "replay-chain": "DurationHistory(4096), agent_type = the trace's agent type: per (agent type, tool) -> "
                    "per tool (the replay's chain)",
    "global-mean": "the running arithmetic mean of every wait observed so far",
    "default-10s": f"always {UNPREDICTED_GAP_S:g} s (the connector's wait when nothing is predicted)",
    "tool-median": "an extra reference, not a baseline asked for: the kvtier instance's own "
                   "quantile_s(tool, 0.5), the median of the tool's last 256 durations",
}


@dataclass(frozen=True, slots=True)
class ToolWait:
    """One tool wait: ``duration_s`` seconds from ``start_s`` to ``end_s`` (absolute, seconds)."""

    start_s: float
    end_s: float
    duration_s: float
    session_id: str
    agent_id: str
    agent_type: str
    tool: str = TOOL


# ------------------------------------------------------------------ collecting


def session_offsets(workload: Workload) -> tuple[dict[str, float], str]:
    """Each session's absolute start (seconds) and the rule that gave it.

    Recorded starts (``recorded_at_s`` on every session) when the traces have
    them; else ``start_s`` when any session has a non-zero one; else the
    sessions back to back in workload order, each taking its span (last send
    plus ``api_time``), the order in which the replay starts them."""
    sessions = workload.sessions
    if sessions and all(s.recorded_at_s is not None for s in sessions):
        first = min(s.recorded_at_s for s in sessions)  # type: ignore[type-var]
        return {s.session_id: s.recorded_at_s - first for s in sessions}, "recorded session starts"  # type: ignore[operator]
    if any(s.start_s for s in sessions):
        return {s.session_id: s.start_s for s in sessions}, "session start_s"
    offsets: dict[str, float] = {}
    at = 0.0
    for s in sessions:
        offsets[s.session_id] = at
        span = max((r.arrival_s + (r.api_time_s or 0.0) for a in s.agents for r in a.requests), default=0.0)
        at += max(0.0, span)
    return offsets, "no session start times: sessions back to back in workload order (the replay's start order)"


def collect_waits(workload: Workload) -> tuple[list[ToolWait], str]:
    """Every tool wait of ``workload`` (workload order) and the session-offset rule used."""
    offsets, rule = session_offsets(workload)
    waits: list[ToolWait] = []
    for s, a, r in workload.iter_requests():
        if r.gap_cause != "tool":
            continue
        end = offsets[s.session_id] + r.arrival_s
        waits.append(ToolWait(end - r.gap_s, end, r.gap_s, s.session_id, a.agent_id, a.agent_type, TOOL))
    return waits, rule


# ------------------------------------------------------------------ predicting


class _RunningMean:
    def __init__(self) -> None:
        self.n, self.total = 0, 0.0

    def predict(self) -> float | None:
        return self.total / self.n if self.n else None

    def observe(self, d: float) -> None:
        self.n += 1
        self.total += max(0.0, d)


def predict_all(waits: Sequence[ToolWait]) -> dict[str, list[float | None]]:
    """Each method's prediction for each wait (index-aligned with ``waits``; ``None``: no estimate).

    Events in time order: a prediction at the wait's start, an observation at
    its end; at equal times, observations of earlier-started waits come first
    and a zero-length wait is predicted before it is observed."""
    live = DurationHistory(MAX_KEYS, global_fallback=True)
    replay = DurationHistory(MAX_KEYS)
    mean = _RunningMean()
    out: dict[str, list[float | None]] = {m: [None] * len(waits) for m in METHODS}
    events: list[tuple[float, int, int]] = []
    for i, w in enumerate(waits):
        events.append((w.start_s, 1, i))
        events.append((w.end_s, 0 if w.start_s < w.end_s else 2, i))
    events.sort()
    for _, kind, i in events:
        w = waits[i]
        if kind == 1:
            out["kvtier"][i] = live.predict_s(w.session_id, w.tool, None)
            out["replay-chain"][i] = replay.predict_s(w.agent_type, w.tool, None)
            out["global-mean"][i] = mean.predict()
            out["default-10s"][i] = UNPREDICTED_GAP_S
            out["tool-median"][i] = live.quantile_s(w.tool, 0.5)
        else:
            live.observe(w.session_id, w.tool, w.duration_s)
            replay.observe(w.agent_type, w.tool, w.duration_s)
            mean.observe(w.duration_s)
    return out


# ------------------------------------------------------------------ scoring


def quantile(values: Sequence[float], q: float) -> float | None:
    """The ``q`` quantile, linear interpolation between order statistics (numpy's default); ``None`` if empty."""
    if not values:
        return None
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _err_stats(errors: Sequence[float]) -> dict[str, float | None]:
    return {"median_abs_error_s": quantile(errors, 0.5), "p90_abs_error_s": quantile(errors, 0.9),
            "mean_abs_error_s": sum(errors) / len(errors) if errors else None}


def score(waits: Sequence[ToolWait], predictions: dict[str, list[float | None]],
          select: Iterable[int] | None = None) -> dict[str, dict[str, Any]]:
    """Per method, the figures over the waits ``select`` names (default: all)."""
    idx = list(range(len(waits))) if select is None else list(select)
    common = [i for i in idx if all(p[i] is not None for p in predictions.values())]
    truth = [waits[i].duration_s for i in idx]
    out: dict[str, dict[str, Any]] = {}
    for method, preds in predictions.items():
        hit = [i for i in idx if preds[i] is not None]
        err = [abs(preds[i] - waits[i].duration_s) for i in hit]  # type: ignore[operator]
        err_all = [abs((UNPREDICTED_GAP_S if preds[i] is None else preds[i]) - waits[i].duration_s) for i in idx]
        err_common = [abs(preds[i] - waits[i].duration_s) for i in common]  # type: ignore[operator]
        under = sum(waits[i].duration_s > preds[i] for i in hit)  # type: ignore[operator]
        out[method] = {
            "waits": len(idx),
            "predicted": len(hit),
            "unpredicted": len(idx) - len(hit),
            "predicted_only": {**_err_stats(err), "under_fraction": under / len(hit) if hit else None,
                               "median_true_wait_s": quantile([waits[i].duration_s for i in hit], 0.5)},
            "all_unpredicted_as_default": {**_err_stats(err_all), "default_s": UNPREDICTED_GAP_S},
            "common_subset": {"waits": len(common), **_err_stats(err_common)},
            "median_true_wait_s": quantile(truth, 0.5),
        }
    return out


def evaluate_workload(workload: Workload) -> dict[str, Any]:
    """Collect, predict and score one workload (a split): the figures, the waits and the predictions."""
    waits, rule = collect_waits(workload)
    preds = predict_all(waits)
    tools = sorted({w.tool for w in waits})
    per_tool = {t: score(waits, preds, (i for i, w in enumerate(waits) if w.tool == t)) for t in tools}
    durations = [w.duration_s for w in waits]
    figures = {
        "sessions": len(workload.sessions),
        "agents": sum(len(s.agents) for s in workload.sessions),
        "requests": workload.num_requests(),
        "tool_waits": len(waits),
        "distinct_sessions_with_waits": len({w.session_id for w in waits}),
        "agent_types": sorted({w.agent_type for w in waits}),
        "time_order": rule,
        "true_wait_s": {"median": quantile(durations, 0.5), "p90": quantile(durations, 0.9),
                        "mean": sum(durations) / len(durations) if durations else None},
        "overall": score(waits, preds),
        "per_tool": per_tool,
    }
    return {"figures": figures, "waits": waits, "predictions": preds}


# ------------------------------------------------------------------ the run


def run(traces: Path, out_dir: Path, *, plot: bool = True,
        progress: Callable[[str], None] = lambda msg: None) -> dict[str, Any]:
    """Evaluate both splits of the dev traces under ``traces``; write the JSON (and PNG) into
    ``out_dir``; return the report (exactly what the JSON holds)."""
    from kvtier.replay import load_trace
    from kvtier.replay.run import split_workload

    path = traces / TRACE_SET
    if not path.exists():
        raise SystemExit(f"tool_wait_predictor: no dev traces at {path} (pass --traces DIR, the folder holding "
                         f"{TRACE_SET.split('/')[0]}/)")
    progress(f"loading {path} ...")
    started = time.perf_counter()
    workload = load_trace(path)  # as `kvtier replay --trace` loads it (shared_prefix "none")
    progress(f"  {len(workload.sessions)} sessions, {workload.num_requests()} requests "
             f"({time.perf_counter() - started:.1f}s)")
    results: dict[str, dict[str, Any]] = {}
    for split in SPLITS:
        progress(f"{split}: predicting ...")
        results[split] = evaluate_workload(split_workload(workload, split))
        progress(f"  {results[split]['figures']['tool_waits']} tool waits")
    status = git("status", "--porcelain", "--", "kvtier")
    report: dict[str, Any] = {
        "generated_by": "bench/tool_wait_predictor.py",
        "generated_at": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        **provenance(),
        "kvtier_uncommitted": None if status is None else status.splitlines(),
        "trace_set": TRACE_SET,
        "trace_path": str(path),
        "workload": workload.name,
        "split_rule": "kvtier.replay.run.split_workload: sessions sorted by id, 1st, 3rd, ... = tune, "
                      "2nd, 4th, ... = eval",
        "headline_split": "eval",
        "tool_names_in_trace": False,
        "tool_name_note": TOOL_NAME_NOTE,
        "max_keys": MAX_KEYS,
        "unpredicted_default_s": UNPREDICTED_GAP_S,
        "methods": METHODS,
        "splits": {split: r["figures"] for split, r in results.items()},
    }
    report = json.loads(json.dumps(report))  # what is returned is what the file holds
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / JSON_NAME
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    progress(f"wrote {json_path}")
    if plot:
        png = write_plot(results, out_dir / PNG_NAME)
        progress(f"wrote {png}" if png else "matplotlib is missing (pip install -e .[plot]): no PNG written")
    return report


def write_plot(results: dict[str, dict[str, Any]], path: Path) -> Path | None:
    """CDF of the absolute error per method (unpredicted waits scored as the 10 s default), one panel
    per split; ``None`` (nothing written) without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    floor = 0.01
    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4.5), squeeze=False)
    for ax, (split, r) in zip(axes[0], results.items()):
        waits, preds = r["waits"], r["predictions"]
        for method, p in preds.items():
            errs = sorted(max(floor, abs((UNPREDICTED_GAP_S if x is None else x) - w.duration_s))
                          for x, w in zip(p, waits))
            n = len(errs)
            med = quantile(errs, 0.5)
            ax.step(errs, [(k + 1) / n for k in range(n)], where="post", label=f"{method} (median {med:.1f} s)")
        ax.set_xscale("log")
        ax.set_xlabel(f"|predicted - true| tool wait, s (below {floor} s drawn at {floor})")
        ax.set_ylabel("share of tool waits")
        label = "evaluation half" if split == "eval" else "tuning half"
        ax.set_title(f"{split} ({label}): {len(waits)} tool waits")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    fig.suptitle(f"Tool-wait prediction error, {TRACE_SET} (unpredicted scored as {UNPREDICTED_GAP_S:g} s)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ------------------------------------------------------------------ rendering


def _f(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def markdown(report: dict[str, Any]) -> str:
    """The report as markdown tables: per split, one row per method (and per tool when there are several)."""
    lines: list[str] = []
    for split, fig in report["splits"].items():
        label = "evaluation half (headline)" if split == "eval" else "tuning half (not the headline)"
        tw = fig["true_wait_s"]
        lines += [f"### {split}: {label}", "",
                  f"{report['trace_set']}, {fig['sessions']} sessions, {fig['tool_waits']} tool waits; true wait "
                  f"median {_f(tw['median'])} s, p90 {_f(tw['p90'])} s, mean {_f(tw['mean'])} s. "
                  f"Time order: {fig['time_order']}.", ""]
        tables = [("all tools", fig["overall"])]
        if len(fig["per_tool"]) > 1:
            tables += [(f"tool {t}", rows) for t, rows in fig["per_tool"].items()]
        for title, rows in tables:
            common = next(iter(rows.values()))["common_subset"]["waits"]
            lines += [f"{title}:", "",
                      "| method | waits | predicted | median \\|err\\| s (predicted) | p90 \\|err\\| s (predicted) "
                      f"| median / p90 \\|err\\| s, all (none = {report['unpredicted_default_s']:g} s) "
                      f"| median / p90 \\|err\\| s, common {common} | wait outran prediction "
                      "| median true wait s (predicted) |",
                      "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
            for method, s in rows.items():
                p, a, c = s["predicted_only"], s["all_unpredicted_as_default"], s["common_subset"]
                under = "-" if p["under_fraction"] is None else f"{100 * p['under_fraction']:.0f}%"
                lines.append(f"| {method} | {s['waits']} | {s['predicted']} | {_f(p['median_abs_error_s'])} "
                             f"| {_f(p['p90_abs_error_s'])} | {_f(a['median_abs_error_s'])} / "
                             f"{_f(a['p90_abs_error_s'])} | {_f(c['median_abs_error_s'])} / "
                             f"{_f(c['p90_abs_error_s'])} | {under} | {_f(p['median_true_wait_s'])} |")
            lines.append("")
        if len(fig["per_tool"]) == 1:
            lines += [f"Per tool: one tool name ({next(iter(fig['per_tool']))!r}), the same as all tools.", ""]
    lines += [f"Tool names: {report['tool_name_note']}", "",
              "Methods: " + "; ".join(f"`{m}`: {d}" for m, d in report["methods"].items()) + ".", "",
              f"Commit {report['commit']}" + (" (kvtier/ has uncommitted changes)" if report["kvtier_dirty"] else "")]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--traces", type=Path, default=DEFAULT_TRACES, metavar="DIR",
                    help=f"the shared traces folder, holding {TRACE_SET} (default: ../shared/traces beside the "
                         f"checkout, {DEFAULT_TRACES})")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, metavar="DIR",
                    help=f"where {JSON_NAME} and {PNG_NAME} are written (default: bench/out)")
    ap.add_argument("--no-plot", action="store_true", help="skip the PNG")
    args = ap.parse_args(argv)
    report = run(args.traces, args.out, plot=not args.no_plot,
                 progress=lambda msg: print(msg, file=sys.stderr, flush=True))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
