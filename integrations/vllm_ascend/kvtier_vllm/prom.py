"""Prometheus metrics of the kvtier connector, on the engine's own ``/metrics``.

Owns: turning the connector's counter increments (what
``KVTierConnector.get_kv_connector_stats`` reports every scheduler step,
aggregated by vLLM over workers) into Prometheus counters named
``kvtier_connector_<counter>_total`` with vLLM's per-engine labels
(``model_name``, ``engine``). vLLM builds it through
``KVTierConnector.build_prom_metrics`` when its Prometheus logger runs
(``vllm serve``; offline ``LLM`` logs no stats). Must not compute anything:
the numbers are the scheduler's counters, unchanged.

The counters the operator's dashboard reads (:data:`.dashboard.DASHBOARD_COUNTERS`)
exist at 0 from the engine's start; any other appears on its first increment. Each metric is
made once per process and reused, as the global Prometheus registry
refuses a second metric of the same name.
"""

from __future__ import annotations

import re
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics
from vllm.v1.metrics.utils import create_metric_per_engine

from .dashboard import DASHBOARD_COUNTERS

PREFIX = "kvtier_connector_"
_HELP = {
    "requests": "requests the connector looked up",
    "lookups": "prefix lookups in kvtier's tiers",
    "hit_tokens": "prompt tokens served from kvtier's tiers",
    "load_planned_tokens": "tokens planned to load from kvtier",
    "load_failed_blocks": "blocks whose load failed or did not verify (recomputed by the engine)",
    "stored_blocks": "blocks stored into a tier",
    "store_failed_blocks": "blocks whose store failed",
    "load_expired_blocks": "blocks of loads that missed load_deadline_s, reported failed and recomputed "
                           "(also in load_failed_blocks)",
    "load_deferred_shared": "lookups deferred a step because another request's load was bringing the same prefix "
                            "into HBM (loaded once, then served by vLLM's prefix cache)",
    "promote_failed_blocks": "blocks whose copy up into DRAM (a prefetch or staging from SSD) failed or did not verify",
    "hook_cpu_us": "engine-thread CPU time spent in connector hooks, microseconds",
    "worker_cpu_us": "worker CPU time spent copying KV to and from kvtier, microseconds",
}
_metrics: dict[tuple[str, tuple[str, ...]], Any] = {}  # (name, labelnames) -> metric, once per process


def _help(counter: str) -> str:
    for stem, text in _HELP.items():
        if counter == stem or counter.startswith(stem + "_"):
            tier = counter[len(stem) + 1 :]
            return f"kvtier: {text}" + (f" (tier {tier})" if tier else "")
    return f"kvtier connector counter {counter}"


class KVTierPromMetrics(KVConnectorPromMetrics):
    """One Prometheus counter per kvtier connector counter, per engine."""

    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._per_engine: dict[str, dict[int, Any]] = {}
        for counter in DASHBOARD_COUNTERS:  # at 0 from the start: the dashboard's panels show 0, not "no data"
            self._children(counter)

    def _children(self, counter: str) -> dict[int, Any]:
        children = self._per_engine.get(counter)
        if children is None:
            children = self._per_engine[counter] = create_metric_per_engine(
                self._metric(counter), self.per_engine_labelvalues)
        return children

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for counter, delta in transfer_stats_data.items():
            if not isinstance(delta, (int, float)) or delta <= 0:
                continue  # counters only grow; a zero delta has nothing to add
            child = self._children(counter).get(engine_idx)
            if child is not None:
                child.inc(delta)

    def _metric(self, counter: str) -> Any:
        name = PREFIX + re.sub(r"[^a-zA-Z0-9_]", "_", counter)
        key = (name, tuple(self._labelnames))
        metric = _metrics.get(key)
        if metric is None:
            metric = _metrics[key] = self._counter_cls(name=name, documentation=_help(counter),
                                                       labelnames=self._labelnames)
        return metric
