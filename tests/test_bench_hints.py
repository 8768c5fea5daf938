"""`kvtier bench hints` in a short form: the kvtier server applies every client's events,
pins included (it failed once its server refused block-key commands without a store)."""

from __future__ import annotations

from kvtier.benchmarks import hints


def test_the_hint_benchmark_runs_every_event_kind_against_a_server_with_a_store() -> None:
    report = hints.run(total_events=2048, client_counts=(1,), emit_samples=500)
    (row,) = report["throughput"]
    assert row["clients"] == 1 and row["kvtier_events_per_s"] > 0 and row["echo_events_per_s"] > 0
    assert row["kvtier_events"] == row["echo_events"] >= 2048  # every event applied, the pins among them
    assert all(r["server_rejected"] == 0 and r["dropped"] == 0 for r in report["emit_latency"])
