"""The connector's counters reach Prometheus through vLLM's own connector-metrics
path (``KVConnectorProm`` → ``KVTierConnector.build_prom_metrics``), with vLLM's
real classes and the global registry that ``vllm serve`` exposes on ``/metrics``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from prometheus_client import REGISTRY
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm

pytestmark = pytest.mark.vllm_interface  # no engine: also run against newer vLLMs (scripts/vllm_next.sh)

LABELS = ["model_name", "engine"]


def _value(name: str, engine: str) -> float | None:
    return REGISTRY.get_sample_value(name, {"model_name": "tiny", "engine": engine})


def test_connector_counters_are_prometheus_counters_per_engine() -> None:
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # registers the connector under the name kvtier (entry point)
    config = SimpleNamespace(kv_transfer_config=KVTransferConfig(kv_connector="kvtier", kv_role="kv_both"))
    prom = KVConnectorProm(config, LABELS, {0: ["tiny", "0"], 1: ["tiny", "1"]})
    assert prom.prom_metrics is not None, "the kvtier connector registers no Prometheus metrics"
    before = _value("kvtier_connector_hit_tokens_dram_total", "0") or 0.0
    prom.observe({"hit_tokens_dram": 64, "lookups": 3, "load_failed_blocks": 0}, 0)
    prom.observe({"hit_tokens_dram": 32}, 0)
    prom.observe({"hit_tokens_dram": 5}, 1)
    assert _value("kvtier_connector_hit_tokens_dram_total", "0") == pytest.approx(before + 96)
    assert _value("kvtier_connector_hit_tokens_dram_total", "1") is not None
    assert _value("kvtier_connector_lookups_total", "0") is not None
    # a second engine in the same process reuses the metrics (no duplicate registration)
    again = KVConnectorProm(config, LABELS, {0: ["tiny", "0"]})
    again.observe({"hit_tokens_dram": 4}, 0)
    assert _value("kvtier_connector_hit_tokens_dram_total", "0") == pytest.approx(before + 100)
