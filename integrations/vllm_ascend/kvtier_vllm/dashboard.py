"""An operator's Grafana dashboard over what ``vllm serve`` with the kvtier connector
exports on ``/metrics``: kvtier's tiers, holds, prefetches, hints and refusals next to
vLLM's own latency and KV-cache figures.

Owns: the panels (title, unit, PromQL), the kvtier counters they read
(:data:`DASHBOARD_COUNTERS`: :mod:`.prom` creates them at 0 when the engine starts,
so a panel shows 0, not "no data", before the first event), the Grafana JSON
(:func:`dashboard`), and the metric names a panel's query reads
(:func:`metric_names`, for the test that a running connector exports each one).
Must not import vLLM or read metrics itself.

``python -m kvtier_vllm.dashboard --out docs/grafana/kvtier-vllm.json`` writes
the file shipped in the repository; a test checks that file is what this writes.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Any

PREFIX = "kvtier_connector_"

_read: list[str] = []  # the connector counters the panels read, in order


def _k(name: str) -> str:
    """The per-second rate of connector counter ``name`` (recorded in :data:`DASHBOARD_COUNTERS`)."""
    _read.append(name)
    return f"sum(rate({PREFIX}{name}_total{{model_name=~\"$model\"}}[$__rate_interval]))"


def _q(quantile: float, histogram: str) -> str:
    return (f"histogram_quantile({quantile}, sum by (le) (rate({histogram}_bucket{{model_name=~\"$model\"}}"
            f"[$__rate_interval])))")


Panel = tuple[str, str, list[tuple[str, str]]]  # title, unit, [(legend, PromQL)]

ROWS: list[tuple[str, list[Panel]]] = [
    ("Serving (vLLM)", [
        ("Time to first token", "s", [("p50", _q(0.5, "vllm:time_to_first_token_seconds")),
                                      ("p95", _q(0.95, "vllm:time_to_first_token_seconds"))]),
        ("Inter-token latency", "s", [("p50", _q(0.5, "vllm:inter_token_latency_seconds")),
                                      ("p95", _q(0.95, "vllm:inter_token_latency_seconds"))]),
        ("Requests", "short", [("running", 'sum(vllm:num_requests_running{model_name=~"$model"})'),
                               ("waiting", 'sum(vllm:num_requests_waiting{model_name=~"$model"})')]),
        ("HBM KV cache used", "percentunit", [("used", 'avg(vllm:kv_cache_usage_perc{model_name=~"$model"})')]),
    ]),
    ("Tiers (kvtier)", [
        ("Prompt tokens served from cache", "short", [
            ("HBM (vLLM prefix cache)", 'sum(rate(vllm:prefix_cache_hits_total{model_name=~"$model"}'
                                        '[$__rate_interval]))'),
            ("DRAM", _k("hit_tokens_dram")), ("SSD", _k("hit_tokens_ssd")), ("remote", _k("hit_tokens_remote"))]),
        ("Blocks stored", "short", [("DRAM", _k("stored_blocks_dram")), ("SSD", _k("stored_blocks_ssd"))]),
        ("Failures (recomputed, never served)", "short", [
            ("load failed", _k("load_failed_blocks")), ("of them past the deadline", _k("load_expired_blocks")),
            ("store failed DRAM", _k("store_failed_blocks_dram")),
            ("store failed SSD", _k("store_failed_blocks_ssd")),
            ("stores skipped (backpressure)", _k("store_skipped_backpressure"))]),
        ("Connector CPU", "µs", [("engine hooks", _k("hook_cpu_us")), ("worker copies", _k("worker_cpu_us"))]),
    ]),
    ("Agent awareness (kvtier)", [
        ("HBM holds", "short", [("held", _k("hbm_held_blocks")), ("released", _k("hbm_hold_released_blocks")),
                                ("expired", _k("hbm_hold_expired_blocks")), ("refused", _k("hbm_hold_refused")),
                                ("shared rounds", _k("shared_round_hbm_blocks"))]),
        ("Prefetches", "short", [("started", _k("prefetches")), ("on time", _k("prefetch_on_time")), ("late", _k("prefetch_late")),
                                 ("wasted", _k("prefetch_wasted")), ("cancelled", _k("prefetch_cancelled"))]),
        ("Waits started", "short", [("tool", _k("tool_waits")), ("turn end", _k("user_waits")),
                                    ("re-timed by a hint", _k("waits_retimed"))]),
        ("Tool-wait predictor", "ms", [
            ("mean abs error", f"{_k('tool_wait_abs_error_ms')} / clamp_min({_k('tool_wait_predictions')}, 1e-9)"),
            ("tools back later than predicted (per 1,000)",
             f"1000 * {_k('tool_wait_under_predictions')} / clamp_min({_k('tool_wait_predictions')}, 1e-9)")]),
        ("Hints refused", "short", [("requests with bad kv_transfer_params", _k("kv_params_refused_requests"))]),
    ]),
]

DASHBOARD_COUNTERS: tuple[str, ...] = tuple(dict.fromkeys(_read))
"""The connector counters the panels read (``kvtier_connector_<name>_total``)."""


def dashboard() -> dict[str, Any]:
    """The Grafana dashboard (schema 39): a ``$datasource`` (Prometheus) and ``$model``
    (vLLM's ``model_name`` label) variable, one row per group of :data:`ROWS`."""
    panels: list[dict[str, Any]] = []
    y, pid = 0, 1
    for row, row_panels in ROWS:
        panels.append({"type": "row", "title": row, "id": pid, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}})
        pid, y = pid + 1, y + 1
        for i, (title, unit, targets) in enumerate(row_panels):
            panels.append({
                "type": "timeseries", "title": title, "id": pid,
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": y + 8 * (i // 2)},
                "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                "targets": [{"refId": chr(ord("A") + j), "expr": expr, "legendFormat": legend,
                             "datasource": {"type": "prometheus", "uid": "${datasource}"}}
                            for j, (legend, expr) in enumerate(targets)],
            })
            pid += 1
        y += 8 * ((len(row_panels) + 1) // 2)
    return {
        "title": "kvtier on vLLM", "uid": "kvtier-vllm", "schemaVersion": 39, "version": 1,
        "tags": ["kvtier", "vllm"], "time": {"from": "now-1h", "to": "now"}, "refresh": "30s",
        "templating": {"list": [
            {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Prometheus"},
            {"name": "model", "type": "query", "label": "model", "includeAll": True, "multi": True,
             "datasource": {"type": "prometheus", "uid": "${datasource}"},
             "query": "label_values(vllm:num_requests_running, model_name)", "refresh": 2},
        ]},
        "panels": panels,
    }


_FUNCTIONS = {"sum", "rate", "avg", "by", "le", "histogram_quantile", "clamp_min", "model_name"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (``foo_bucket`` of a histogram as ``foo_bucket``)."""
    expr = re.sub(r'"[^"]*"', "", expr)  # label values
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # ranges
    names = set(re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", expr)) - _FUNCTIONS
    return {n for n in names if not n.startswith("$") and not re.fullmatch(r"e\d*", n)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvtier_vllm.dashboard",
                                description="Write kvtier's Grafana dashboard for vLLM with the kvtier connector "
                                            "(import it in Grafana; pick a Prometheus data source that scrapes "
                                            "the engine's /metrics).")
    p.add_argument("--out", default="-", help="where to write the JSON (default: standard output)")
    args = p.parse_args(argv)
    text = json.dumps(dashboard(), indent=2, ensure_ascii=False) + "\n"
    if args.out == "-":
        sys.stdout.write(text)
    else:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
