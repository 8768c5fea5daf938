"""Prometheus view of the hints server: counters and gauges read at scrape time.

Owns: the metric names and the HTTP endpoint thread. The hot path never
touches prometheus-client (its per-call locks cost more than the event
itself): the server keeps plain counters in
:class:`~kvtier.hints.apply.TenantStats` and this collector sums them when
Prometheus scrapes. Must not mutate the applier or the graph (it runs on the
HTTP thread; it only copies dicts, which is atomic under the GIL).

Metrics (no tenant label, so cardinality stays fixed):
``kvtier_hint_events_total{type}``, ``kvtier_hint_rejections_total{reason}``,
``kvtier_hint_duplicates_total``, ``kvtier_hint_commands_total{outcome}``,
``kvtier_hint_rpcs_total{method,code}``, ``kvtier_hint_sessions``,
``kvtier_hint_agents``, ``kvtier_hint_tool_calls_in_flight``,
``kvtier_hint_shared_rounds``, ``kvtier_hint_expired_sessions_total``,
``kvtier_hint_dedupe_window_events``, and the tool-duration predictor's
error: ``kvtier_tool_predictions_total``,
``kvtier_tool_prediction_abs_error_seconds``,
``kvtier_tool_prediction_rel_error``, ``kvtier_tool_prediction_under_fraction``.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Iterator

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .apply import HintApplier


class HintMetrics:
    """A collector over ``applier`` (and the server's RPC counter ``rpcs``)."""

    def __init__(self, applier: HintApplier, rpcs: Counter[tuple[str, str]]) -> None:
        self.applier = applier
        self.rpcs = rpcs
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)  # type: ignore[arg-type]
        self._http: Any = None

    def collect(self) -> Iterator[Any]:
        tenants = list(self.applier.tenants.values())
        yield self._counter("kvtier_hint_events", "Hint events applied, by event type", "type",
                            [t.events_by_type for t in tenants])
        yield self._counter("kvtier_hint_rejections", "Hint events rejected, by reason", "reason",
                            [t.rejections_by_reason for t in tenants])
        yield self._counter("kvtier_hint_commands", "Commands by outcome", "outcome",
                            [t.commands_by_outcome for t in tenants])
        dup = CounterMetricFamily("kvtier_hint_duplicates", "Duplicate event ids (applied once)")
        dup.add_metric([], sum(t.num_duplicates for t in tenants))
        yield dup
        rpcs = CounterMetricFamily("kvtier_hint_rpcs", "RPCs by method and status code", labels=["method", "code"])
        for (method, code), n in sorted(dict(self.rpcs).items()):
            rpcs.add_metric([method, code], n)
        yield rpcs
        g = self.applier.graph
        expired = CounterMetricFamily("kvtier_hint_expired_sessions", "Sessions expired after the idle TTL")
        expired.add_metric([], g.num_expired_sessions)
        yield expired
        for name, text, value in (
            ("kvtier_hint_sessions", "Live sessions", g.num_sessions),
            ("kvtier_hint_agents", "Agents of live sessions", g.num_agents),
            ("kvtier_hint_tool_calls_in_flight", "Tool calls in flight", g.num_tool_calls),
            ("kvtier_hint_shared_rounds", "Shared rounds in progress", g.num_shared_rounds),
            ("kvtier_hint_dedupe_window_events", "Event ids held for duplicate detection", self.applier.dedupe_size),
        ):
            yield GaugeMetricFamily(name, text, value=value)
        err = g.history.error()
        preds = CounterMetricFamily("kvtier_tool_predictions", "Tool calls whose predicted duration was scored")
        preds.add_metric([], err.num_predictions)
        yield preds
        for name, text, value in (
            ("kvtier_tool_prediction_abs_error_seconds", "Mean |predicted - actual| tool duration",
             err.mean_abs_error_s),
            ("kvtier_tool_prediction_rel_error", "Mean |predicted - actual| / actual tool duration", err.mean_rel_error),
            ("kvtier_tool_prediction_under_fraction", "Share of tool calls that returned later than predicted",
             err.under_fraction),
        ):
            yield GaugeMetricFamily(name, text, value=value)

    @staticmethod
    def _counter(name: str, text: str, label: str, counters: list[Counter[str]]) -> CounterMetricFamily:
        total: Counter[str] = Counter()
        for c in counters:
            total.update(dict(c))
        family = CounterMetricFamily(name, text, labels=[label])
        for key, n in sorted(total.items()):
            family.add_metric([key], n)
        return family

    def serve_http(self, port: int, host: str = "127.0.0.1") -> int:
        """Start the ``/metrics`` endpoint on a daemon thread; return the bound port."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        self._http = server
        return int(server.server_port)

    def stop_http(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
