"""The operator's Grafana dashboard in the repository is the one :mod:`kvtier_vllm.dashboard`
writes, every panel queries something, and the kvtier counters it reads are the ones the
connector creates at start (whether a running server exports them is checked against
``vllm serve``'s ``/metrics`` in ``tests/engine/test_vllm_agent_adapters.py``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from kvtier_vllm.dashboard import DASHBOARD_COUNTERS, PREFIX, dashboard, metric_names

SHIPPED = Path(__file__).resolve().parents[1] / "docs" / "grafana" / "kvtier-vllm.json"


def test_the_shipped_dashboard_is_what_the_generator_writes() -> None:
    assert json.loads(SHIPPED.read_text()) == dashboard(), \
        "regenerate: python -m kvtier_vllm.dashboard --out docs/grafana/kvtier-vllm.json"


def test_every_panel_queries_metrics_and_reads_only_counters_created_at_start() -> None:
    read = set()
    panels = [p for p in dashboard()["panels"] if p["type"] == "timeseries"]
    assert len({p["id"] for p in dashboard()["panels"]}) == len(dashboard()["panels"])
    for panel in panels:
        assert panel["targets"], panel["title"]
        for t in panel["targets"]:
            names = metric_names(t["expr"])
            assert names, (panel["title"], t["expr"])
            read |= {n.removeprefix(PREFIX).removesuffix("_total") for n in names if n.startswith(PREFIX)}
    assert read == set(DASHBOARD_COUNTERS)


def test_metric_names_reads_names_not_functions_labels_or_ranges() -> None:
    expr = ('histogram_quantile(0.95, sum by (le) (rate(vllm:time_to_first_token_seconds_bucket'
            '{model_name=~"$model"}[$__rate_interval]))) / clamp_min(sum(rate(kvtier_connector_x_total[5m])), 1e-9)')
    assert metric_names(expr) == {"vllm:time_to_first_token_seconds_bucket", "kvtier_connector_x_total"}


def test_the_command_writes_json_and_explains_itself(tmp_path: Path) -> None:
    out = tmp_path / "d.json"
    subprocess.run([sys.executable, "-m", "kvtier_vllm.dashboard", "--out", str(out)], check=True)
    assert json.loads(out.read_text())["uid"] == "kvtier-vllm"
    helptext = subprocess.run([sys.executable, "-m", "kvtier_vllm.dashboard", "--help"], check=True,
                              capture_output=True, text=True).stdout
    assert "Grafana" in helptext and "--out" in helptext
