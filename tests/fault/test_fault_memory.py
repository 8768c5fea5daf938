"""Memory stays flat: a million TierManager operations and a 30-second hint
stream (server and SDK in this process) after warm-up grow RSS by less than
the stated bounds, and every bounded structure ends within its bound.
The 10-minute version is ``python bench/soak.py``."""

from __future__ import annotations

from fault_support import FIGURES, NOTES

from kvtier.benchmarks.soak import hint_stream, manager_churn

MANAGER_OPS = 1_000_000
MANAGER_RSS_BOUND_BYTES = 16 << 20  # an indexed key costs ~200 B of dict entries: a leak of 1 in 10 ops would show 20 MiB
HINT_STREAM_S = 30.0
HINT_RSS_BOUND_BYTES = 16 << 20  # ~25k events/s here: a 64-byte leak per event would show ~30 MiB


def test_a_million_manager_operations_leave_rss_flat() -> None:
    r = manager_churn(MANAGER_OPS, seed=1)
    NOTES.append(f"RSS  {r.describe()} (bound {MANAGER_RSS_BOUND_BYTES >> 20} MiB)")
    print(r.describe())
    assert r.num_ops >= MANAGER_OPS
    assert r.sizes["open_plans"] == 0
    # every indexed key is resident somewhere or a chain stub: bounded by the tiers' capacities
    assert r.sizes["index_nodes"] <= 2 * (512 + 4096 + 16384), r.sizes
    assert r.growth_bytes < MANAGER_RSS_BOUND_BYTES, r.describe()
    FIGURES["memory_ops"] += r.num_ops


def test_a_hint_stream_leaves_rss_flat_and_the_graph_empty() -> None:
    # a small dedupe window so a 30 s run reaches steady state (bench/soak.py uses the default)
    r = hint_stream(HINT_STREAM_S, dedupe_window_events=16_384)
    NOTES.append(f"RSS  {r.describe()} (bound {HINT_RSS_BOUND_BYTES >> 20} MiB)")
    print(r.describe())
    assert r.sizes["events_accepted"] > 0 and r.sizes["events_dropped"] == 0 and r.sizes["events_rejected"] == 0
    assert r.sizes["sessions_left"] == r.sizes["agents_left"] == r.sizes["tool_calls_left"] == 0
    assert r.sizes["dedupe_window"] <= 16_384
    assert r.growth_bytes < HINT_RSS_BOUND_BYTES, r.describe()
    FIGURES["memory_ops"] += r.num_ops
