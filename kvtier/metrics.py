"""Prometheus view of a :class:`~kvtier.store.TieredStore`: every tier's figures,
read at scrape time.

Owns: the store metric names and their mapping from ``TieredStore.stats()``.
The hot path never touches prometheus-client: the store keeps plain counters
and this collector reads one ``stats()`` snapshot per scrape (one short hold
of the store lock). Must not mutate the store. Engines register it on their
own registry (:func:`register_store_metrics`); ``kvtier serve --store``
exposes it on the hints server's ``/metrics`` endpoint next to the hint-plane
metrics.

Metrics (labels in braces; ``tier`` is hbm / dram / ssd, a link is
``src`` -> ``dst`` where ``caller`` is a ``get`` reading SSD on the mover):

* ``kvtier_tier_capacity_blocks{tier}``, ``kvtier_tier_capacity_bytes{tier}``,
  ``kvtier_tier_used_blocks{tier}``, ``kvtier_tier_used_bytes{tier}``,
  ``kvtier_tier_ready_blocks{tier}``, ``kvtier_pinned_blocks``
* ``kvtier_get_blocks_total``, ``kvtier_hit_blocks_total{tier}``,
  ``kvtier_miss_blocks_total``, ``kvtier_deadline_miss_blocks_total``
* ``kvtier_evicted_blocks_total{tier}``, ``kvtier_removed_blocks_total{tier,reason}``
  (reason: evicted, moved, failed_verify, removed)
* ``kvtier_transfer_bytes_total{src,dst}``, ``kvtier_transfer_blocks_total{src,dst}``,
  ``kvtier_transfer_failed_blocks_total{src,dst}``, ``kvtier_transfer_timed_out_blocks_total{src,dst}``,
  ``kvtier_transfer_latency_seconds{src,dst}`` (histogram, submission to completion)
* ``kvtier_ssd_checksum_failures_total``, ``kvtier_ssd_decode_failures_total``,
  ``kvtier_ssd_namespace_mismatches_total``, ``kvtier_ssd_key_mismatches_total``,
  ``kvtier_ssd_map_full_total``,
  ``kvtier_ssd_write_errors_total``, ``kvtier_ssd_purged_values_total``,
  ``kvtier_ssd_bytes_written_total``, ``kvtier_ssd_bytes_read_total``
* ``kvtier_prefetch_blocks_total{outcome}`` (on_time, late, failed, used, wasted)
* ``kvtier_offload_blocks_total{src,dst,reason}`` (the ``reason`` given to ``demote``)

>>> from prometheus_client import CollectorRegistry, generate_latest
>>> from kvtier.config import load_config
>>> from kvtier.store import TieredStore
>>> store = TieredStore(load_config(env={}, overrides={
...     "layout": {"num_layers": 1, "num_kv_heads": 1, "head_dim": 8, "block_size": 4},
...     "tiers": {"hbm": {"enabled": False}, "dram": {"capacity_blocks": 4}}, "put_tier": "dram"}))
>>> registry = CollectorRegistry()
>>> _ = register_store_metrics(store, registry)
>>> b'kvtier_tier_capacity_blocks{tier="dram"} 4.0' in generate_latest(registry)
True
>>> store.close()
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from .transfer.mover import LATENCY_BUCKETS_S

_SSD_COUNTERS = (
    ("checksum_failures", "kvtier_ssd_checksum_failures", "SSD values whose header or data checksum failed"),
    ("decode_failures", "kvtier_ssd_decode_failures", "SSD values that could not be decoded (truncated, bad codec)"),
    ("mismatches", "kvtier_ssd_namespace_mismatches", "SSD values of another namespace or layout (misses)"),
    ("key_mismatches", "kvtier_ssd_key_mismatches", "SSD values stored under another key than written for (misses)"),
    ("map_full", "kvtier_ssd_map_full", "SSD writes refused by a full LMDB map (raise tiers.ssd.map_size_bytes)"),
    ("write_errors", "kvtier_ssd_write_errors", "SSD writes that failed with an I/O error"),
    ("purged", "kvtier_ssd_purged_values", "Unreadable SSD values deleted at a warm restart"),
    ("bytes_written", "kvtier_ssd_bytes_written", "Stored (encoded) bytes committed to SSD"),
    ("bytes_read", "kvtier_ssd_bytes_read", "Stored bytes read from SSD by verified hits"),
)
_PREFETCH_OUTCOMES = ("on_time", "late", "failed", "used", "wasted")


class StoreMetrics:
    """A prometheus-client collector over ``store`` (anything with the
    :meth:`~kvtier.store.TieredStore.stats` shape and a ``layout``)."""

    def __init__(self, store: Any) -> None:
        self.store = store

    def describe(self) -> list[Any]:
        return []  # collected lazily: no describe-time scrape of the store

    def collect(self) -> Iterator[Any]:
        st = self.store.stats()
        bpb = self.store.layout.bytes_per_block
        yield from self._tiers(st, bpb)
        yield from self._gets(st)
        yield from self._removals(st)
        yield from self._links(st)
        yield from self._ssd(st)
        c = st["counters"]
        fam = CounterMetricFamily("kvtier_prefetch_blocks", "Prefetched blocks by outcome", labels=["outcome"])
        for outcome in _PREFETCH_OUTCOMES:
            fam.add_metric([outcome], c.get(f"prefetch_{outcome}_blocks", 0))
        yield fam
        fam = CounterMetricFamily("kvtier_offload_blocks", "Blocks demoted by offload decisions, by reason",
                                  labels=["src", "dst", "reason"])
        for name, n in st.get("offloads", {}).items():
            link, reason = name.rsplit(":", 1)
            src, dst = link.split("->")
            fam.add_metric([src, dst, reason], n)
        yield fam

    @staticmethod
    def _tiers(st: dict[str, Any], bpb: int) -> Iterator[Any]:
        for name, key, text, scale in (
            ("kvtier_tier_capacity_blocks", "capacity_blocks", "Capacity of each tier in blocks", 1),
            ("kvtier_tier_capacity_bytes", "capacity_blocks", "Capacity of each tier in bytes", bpb),
            ("kvtier_tier_used_blocks", "used_blocks", "Blocks in use (ready + in flight) per tier", 1),
            ("kvtier_tier_used_bytes", "used_blocks", "Bytes in use (ready + in flight) per tier", bpb),
            ("kvtier_tier_ready_blocks", "ready_blocks", "Readable blocks per tier", 1),
        ):
            fam = GaugeMetricFamily(name, text, labels=["tier"])
            for tier, t in st["tiers"].items():
                fam.add_metric([tier], t[key] * scale)
            yield fam
        yield GaugeMetricFamily("kvtier_pinned_blocks", "Blocks pinned now", value=st["pinned_blocks"])

    @staticmethod
    def _gets(st: dict[str, Any]) -> Iterator[Any]:
        c = st["counters"]
        yield _counter("kvtier_get_blocks", "Blocks asked for by get", c.get("get_blocks_requested", 0))
        yield _counter("kvtier_miss_blocks", "Blocks asked for and not served", c.get("get_blocks_missed", 0))
        yield _counter("kvtier_deadline_miss_blocks", "Readable blocks not read before the caller's deadline",
                       c.get("get_deadline_missed_blocks", 0))
        fam = CounterMetricFamily("kvtier_hit_blocks", "Blocks served by get, by the tier they came from",
                                  labels=["tier"])
        for tier in st["tiers"]:
            fam.add_metric([tier], c.get(f"hit_blocks_{tier}", 0))
        yield fam

    @staticmethod
    def _removals(st: dict[str, Any]) -> Iterator[Any]:
        removals = st.get("removals", {})
        ev = CounterMetricFamily("kvtier_evicted_blocks", "Blocks evicted by each tier's policy", labels=["tier"])
        rm = CounterMetricFamily("kvtier_removed_blocks", "Blocks that stopped being readable, by reason",
                                 labels=["tier", "reason"])
        evicted = dict.fromkeys(st["tiers"], 0)
        for name, n in removals.items():
            tier, reason = name.split(":", 1)
            rm.add_metric([tier, reason], n)
            if reason == "evicted":
                evicted[tier] = n
        for tier, n in evicted.items():
            ev.add_metric([tier], n)
        yield ev
        yield rm

    @staticmethod
    def _links(st: dict[str, Any]) -> Iterator[Any]:
        fams = {
            "bytes": CounterMetricFamily("kvtier_transfer_bytes", "Bytes moved per link and direction",
                                         labels=["src", "dst"]),
            "blocks": CounterMetricFamily("kvtier_transfer_blocks", "Blocks moved per link and direction",
                                          labels=["src", "dst"]),
            "failed_blocks": CounterMetricFamily("kvtier_transfer_failed_blocks",
                                                 "Blocks whose transfer failed (never readable)", labels=["src", "dst"]),
            "timed_out_blocks": CounterMetricFamily("kvtier_transfer_timed_out_blocks",
                                                    "Blocks of transfers that finished past their deadline (discarded)",
                                                    labels=["src", "dst"]),
        }
        hist = HistogramMetricFamily("kvtier_transfer_latency_seconds",
                                     "Transfer job latency, submission to completion", labels=["src", "dst"])
        for link, ls in sorted(st["links"].items()):
            if "->" not in link:
                continue
            labels = link.split("->", 1)
            for key, fam in fams.items():
                fam.add_metric(labels, ls[key])
            cumulative, buckets = 0, []
            for bound, n in zip((*map(str, LATENCY_BUCKETS_S), "+Inf"), ls["latency_buckets"]):
                cumulative += n
                buckets.append((bound, cumulative))
            hist.add_metric(labels, buckets, ls["latency_sum_s"])
        yield from fams.values()
        yield hist

    @staticmethod
    def _ssd(st: dict[str, Any]) -> Iterator[Any]:
        ssd = st.get("ssd")
        if ssd is None:
            return
        for key, name, text in _SSD_COUNTERS:
            yield _counter(name, text, ssd.get(key, 0))


def _counter(name: str, text: str, value: float) -> CounterMetricFamily:
    fam = CounterMetricFamily(name, text)
    fam.add_metric([], value)
    return fam


def register_store_metrics(store: Any, registry: Any = None) -> StoreMetrics:
    """Register a :class:`StoreMetrics` for ``store`` on ``registry`` (default: the
    prometheus-client global ``REGISTRY``) and return it. Call once per store;
    the engine connector calls it on the registry its server exposes."""
    if registry is None:
        from prometheus_client import REGISTRY

        registry = REGISTRY
    collector = StoreMetrics(store)
    registry.register(collector)
    return collector
