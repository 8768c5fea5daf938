"""Transfer faults: slow, failing and late mover jobs against a real TieredStore.

Faults go in through the mover's ``fault_hook`` (it runs on the worker thread
before each copy, exactly where real slow or failing I/O would hit): it
sleeps to make a link take seconds per operation, or raises ``OSError``.
Checked: callers with a deadline return before the injected delay is over
and are served from the faster tiers meanwhile; a failed or late job leaves
no readable block where it was going; a prefetch that lands after the
request started is discarded and counted; nothing stored earlier is lost.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from fault_support import FIGURES, blocks_for, chain_tokens, make_store, read_and_check

SLOW_S = 2.0  # injected seconds per SSD operation
DEADLINE_S = 0.25  # what the caller allows


def _slow_links(*links: str, delay_s: float = SLOW_S):
    def hook(job) -> None:
        if job.link in links:
            FIGURES["faults_injected"] += 1
            time.sleep(delay_s)
    return hook


def _fail_links(*links: str):
    def hook(job) -> None:
        if job.link in links:
            FIGURES["faults_injected"] += 1
            raise OSError(5, f"injected I/O error on {job.link}")
    return hook


@pytest.fixture
def store(tmp_path: Path):
    # DRAM 16 blocks, SSD 256: chains 0-1 end up only on SSD, chains 2-3 in DRAM too
    with make_store(tmp_path / "ssd", dram=16, ssd=256, write_through=True, mover_threads=2) as s:
        chains = [s.keys_for(chain_tokens(c, 4)) for c in range(6)]
        for keys in chains:
            assert s.put(keys, blocks_for(keys)) == 4
        yield s, chains
        s.mover.fault_hook = None
        s.check_invariants()


def test_slow_ssd_never_blocks_a_caller_past_its_deadline_and_dram_keeps_serving(store) -> None:
    s, chains = store
    cold, warm = chains[0], chains[-1]
    assert s.contains_prefix(cold).tiers == ("ssd",) * 4 and s.contains_prefix(warm).tiers == ("dram",) * 4
    s.mover.fault_hook = _slow_links("ssd->dram", "ssd->caller")
    pending = s.prefetch(cold, "dram")  # occupies a mover thread for SLOW_S
    results: dict[str, object] = {}

    def reader(name: str, keys) -> None:
        t0 = time.perf_counter()
        results[name] = (read_and_check(s, keys, timeout_s=DEADLINE_S), time.perf_counter() - t0)

    threads = [threading.Thread(target=reader, args=("warm", warm)),
               threading.Thread(target=reader, args=("cold", chains[1]))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    (warm_served, warm_wrong), warm_s = results["warm"]
    (cold_served, cold_wrong), cold_s = results["cold"]
    assert (warm_served, warm_wrong) == (4, 0)  # DRAM hits served while SSD I/O crawls
    assert (cold_served, cold_wrong) == (0, 0)  # SSD read not done by the deadline: a miss, not a wait
    assert warm_s < SLOW_S and cold_s < SLOW_S  # relative to the injected delay, not an absolute bound
    assert s.stats()["counters"]["get_deadline_missed_blocks"] == 4
    assert s.explain_miss(chains[1], 0).reason == "deadline"  # readable, just not in time
    pending.result(30)
    s.mover.fault_hook = None
    _wait_idle(s)
    assert read_and_check(s, chains[1]) == (4, 0)  # nothing was lost by giving up on it
    FIGURES["faults_survived"] += 2


def _wait_idle(s) -> None:
    """Let queued mover jobs finish (a no-op job queues behind them)."""
    from kvtier.transfer import TransferJob

    for _ in range(4):
        s.mover.submit(TransferJob("idle", 0, 0, list, lambda oks: None)).result(30)


def test_failed_mover_job_leaves_no_readable_block(store) -> None:
    s, chains = store
    warm = chains[-1]
    s.mover.fault_hook = _fail_links("dram->ssd", "ssd->dram")
    # demote: the SSD copy already exists for write-through blocks, so use a fresh chain only in DRAM
    fresh = s.keys_for(chain_tokens(50, 4))
    s.put(fresh, blocks_for(fresh))
    s.manager.remove(fresh, "ssd")
    s.take_events()
    assert s.demote(fresh, "dram", "ssd") == 0  # the move failed ...
    assert s.contains_prefix(fresh).tiers == ("dram",) * 4  # ... the source copy is untouched
    assert not any(s.manager.contains(k, "ssd") for k in fresh) and not any(s._ssd.contains(k) for k in fresh)
    # a failed promotion: still readable from SSD only, never from the half-written DRAM slot
    assert s.prefetch(chains[0], "dram").result(30) == 0
    assert s.contains_prefix(chains[0]).tiers == ("ssd",) * 4
    s.mover.fault_hook = None
    assert read_and_check(s, fresh) == (4, 0) and read_and_check(s, chains[0]) == (4, 0)
    assert read_and_check(s, warm) == (4, 0)
    assert s.stats()["failed_jobs"] == 2
    FIGURES["faults_survived"] += 2


def test_prefetch_past_its_deadline_is_discarded(store) -> None:
    s, chains = store
    s.mover.fault_hook = _slow_links("ssd->dram", delay_s=0.5)
    assert s.prefetch(chains[0], "dram", timeout_s=0.05).result(30) == 0
    assert s.contains_prefix(chains[0]).tiers == ("ssd",) * 4  # not published in DRAM
    c = s.stats()["counters"]
    assert c["prefetch_late_blocks"] == 4 and c.get("prefetch_on_time_blocks", 0) == 0
    assert s.stats()["timed_out_jobs"] == 1
    s.mover.fault_hook = None
    assert s.prefetch(chains[0], "dram", timeout_s=30).result(30) == 4  # on time now
    assert read_and_check(s, chains[0]) == (4, 0)
    c = s.stats()["counters"]
    assert c["prefetch_on_time_blocks"] == 4 and c["prefetch_used_blocks"] == 4
    FIGURES["faults_survived"] += 1


def test_prefetch_overtaken_by_its_request_is_discarded_cleanly(store) -> None:
    s, chains = store
    s.mover.fault_hook = _slow_links("ssd->dram", delay_s=0.5)
    pending = s.prefetch(chains[1], "dram")
    time.sleep(0.05)  # the move is running
    assert read_and_check(s, chains[1]) == (4, 0)  # the request reads SSD directly, meanwhile
    assert pending.result(30) == 0  # the move landed after the request started: dropped
    assert s.contains_prefix(chains[1]).tiers == ("ssd",) * 4
    assert s.stats()["counters"]["prefetch_late_blocks"] == 4
    s.mover.fault_hook = None
    assert read_and_check(s, chains[1]) == (4, 0)
    FIGURES["faults_survived"] += 1


def test_prefetched_blocks_evicted_unread_count_as_wasted(store) -> None:
    s, chains = store
    assert s.prefetch(chains[0], "dram").result(30) == 4
    for c in range(60, 64):  # push the prefetched chain out of DRAM before anyone reads it
        keys = s.keys_for(chain_tokens(c, 4))
        s.put(keys, blocks_for(keys))
    assert s.stats()["counters"]["prefetch_wasted_blocks"] == 4
