"""Bounded host memory when the SSD falls behind (issue 22), in a real vLLM engine.

A small Llama (8 layers, 256 KiB of KV per 32-token block) prefills 24
distinct prompts of 30 blocks at full rate: about 180 MiB of KV that kvtier
writes through to DRAM and SSD. The SSD writer is slowed 1200x by fault
injection (``slow_ssd_connector.py``: every ``put_many`` sleeps 1199 times what
it took). At 100x, once the DRAM stores went straight into the pool (issue 57),
the writer kept up with a 2-core engine at about 5 s a prompt and nothing was
skipped, so the test no longer tried what it is for; at 400x it stored 135 MiB
of 210 and skipped 75, under the 96 MiB the check below needs. (40 prompts
made the run without a connector pass CI's 300 s limit.) Host copies waiting for the SSD are bounded by
``ssd_write_queue_mib`` (16 MiB here); stores past it are skipped and counted
(``store_skipped_backpressure``), never queued.

Measured: the resident memory of the engine's process tree, sampled every
20 ms from the start of the batch until the connector is idle (after a
warm-up batch), against the same batches through a do-nothing connector
(``bench/null_connector.py``), which isolates kvtier's own memory from vLLM's
connector path. The growth kvtier adds must stay within what it is
configured to hold (the DRAM pool, the SSD write queue, the staging ring,
the SSD tier's reused write buffers) plus a margin, while the stores it skipped
add up to far more than that: an unbounded queue would have held them, and
this test would fail.

Both runs fix glibc's mmap threshold (``MALLOC_MMAP_THRESHOLD_``): by default
glibc raises it after a large buffer is freed, and later buffers of that size
then come from per-thread heaps that keep freed memory resident. What those
heaps keep depends on how the threads interleave. CI once measured +99 MiB
(108 MiB against the do-nothing connector's 9) where a run here grew +1 MiB,
with the same blocks stored and skipped; kvtier's own buffers are fixed in
size, so retained freed buffers are the likely cause (not proven: it did not
recur here). With the threshold fixed, buffers of 128 KiB or more are mapped
and unmapped, and the growth is closer to memory held; the allowance also
counts the SSD tier's write buffers, which the first version left out. The
troubleshooting row "host memory above its bounds" in docs/operations.md
tells users the same.

Outputs: token ids and logprobs equal the do-nothing connector's. (vLLM's
connector path by itself moves a few bf16 logprobs by about 1e-3 on this model:
measured with 40 prompts: 5 of them, the same with kvtier and with the
do-nothing connector. A third run without any connector, which checked only
that, cost CI 3 minutes and is gone: the do-nothing connector's outputs are the
reference, and ``test_vllm_engine.py`` compares kvtier with no connector.)
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from .engine_support import BLOCK_SIZE, ENGINE, PROCESS_SPLIT, SMALL_LLAMA, make_model, run_child

pytestmark = pytest.mark.slow

BLOCK_BYTES = 8 * 2 * BLOCK_SIZE * 4 * 64 * 2  # layers x K/V x tokens x KV heads x head dim x bf16 = 256 KiB
PROMPTS = [[(i * 131 + j * 7) % 997 + 3 for j in range(30 * BLOCK_SIZE)] for i in range(24)]
WARM_UP = [[(i * 17 + j * 5) % 991 + 3 for j in range(30 * BLOCK_SIZE)] for i in range(100, 104)]
STEP_TOKENS = 1024  # max_num_batched_tokens: one step gathers at most 32 blocks (8 MiB), half the staging ring
QUEUE_MIB = 16
STAGING_MIB = 16
DRAM_BLOCKS = 64
SLOWDOWN = 1200
SSD_BUFFERS_MIB = 2 * 8  # tiers.ssd.write_threads (2) reused write buffers of 8 MiB
MARGIN_MIB = 48  # allocator and engine noise between two runs of the same batch
# buffers of 128 KiB or more mapped and unmapped: no per-thread heap keeps a freed one resident (docstring)
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(128 << 10)}


def test_a_slow_ssd_keeps_host_memory_bounded_and_outputs_unchanged(tmp_path: Path) -> None:
    model = make_model(tmp_path / "model", config=SMALL_LLAMA)
    # One sequence at a time: batches are then the same with and without the connector (whose stores
    # delay block frees and so could change how vLLM batches), so bf16 outputs can be compared exactly.
    engine = {**ENGINE, "max_num_batched_tokens": STEP_TOKENS, "max_num_seqs": 1}
    phases = [{"prompts": WARM_UP}, {"prompts": PROMPTS, "rss": True, "idle_timeout_s": 300.0}]
    # vec kernels: on a CPU with AMX, vLLM's AMX kernels round differently when a prefix is loaded
    # rather than computed (the test's first version, run there, failed even without this session's code)
    spec = {"model": str(model), "engine": engine, "max_tokens": 4, "phases": phases, "cpu_attention": "vec"}
    here = Path(__file__).resolve().parent
    path = os.pathsep.join([str(here), str(here.parents[1] / "bench"), os.environ.get("PYTHONPATH", "")])
    # vLLM's own process split (engine core and worker processes), not the other engine tests' single process:
    # the slowed writer sleeps in proportion to the time each write took, and in one process the scheduler's and
    # frontend's work on the same interpreter lengthened those writes until the writer no longer drained in 300 s
    env = {"PYTHONPATH": path.rstrip(os.pathsep), "KVTIERTEST_SSD_SLOWDOWN": str(SLOWDOWN), **PROCESS_SPLIT,
           **MALLOC_ENV}
    limit = 600  # each run (about 3-4 min here; the slow one waits for its writer to drain)
    null = run_child(tmp_path, "null", {**spec, "kvtier": {}, "connector_name": "NullConnector",
                                        "connector_module_path": "null_connector"}, env=env, timeout_s=limit)
    kvtier = {"dram_capacity_blocks": DRAM_BLOCKS, "exclusive_dram": False,
              "ssd_path": str(tmp_path / "ssd"), "ssd_write_queue_mib": QUEUE_MIB,
              "staging_mib": STAGING_MIB, "stats_path": str(tmp_path / "slow.stats.json")}
    slow = run_child(tmp_path, "slow", {**spec, "kvtier": kvtier, "connector_name": "SlowSSDConnector",
                                        "connector_module_path": "slow_ssd_connector"}, env=env, timeout_s=limit)

    n, s = (r["phases"][1] for r in (null, slow))
    assert s["outputs"] == n["outputs"]  # token ids and logprobs
    counters = s["stats"]["counters"]
    assert s["stats"]["pending_plans"] == 0, "the slowed writer did not drain within the idle timeout"
    skipped_mib = counters.get("store_skipped_backpressure", 0) * BLOCK_BYTES / (1 << 20)
    stored_ssd_mib = counters.get("stored_blocks_ssd", 0) * BLOCK_BYTES / (1 << 20)
    growth = {name: r["rss"]["peak_mib"] - r["rss"]["start_mib"] for name, r in (("null", n), ("slow", s))}
    held_mib = DRAM_BLOCKS * BLOCK_BYTES / (1 << 20) + QUEUE_MIB + STAGING_MIB + SSD_BUFFERS_MIB
    added = growth["slow"] - growth["null"]
    print(f"slow SSD ({SLOWDOWN}x): stored to SSD {stored_ssd_mib:.0f} MiB, skipped {skipped_mib:.0f} MiB "
          f"({counters.get('store_skipped_backpressure', 0)} blocks); RSS growth {growth['slow']:.0f} MiB vs "
          f"{growth['null']:.0f} MiB through a do-nothing connector: {added:+.0f} MiB, allowed {held_mib:.0f} + "
          f"{MARGIN_MIB} MiB")
    assert counters.get("stored_blocks_dram", 0) > 0 and stored_ssd_mib > 0
    assert counters.get("store_skipped_staging", 0) == 0  # the ring keeps up: the SSD queue is what overflows
    # The bound mattered: more was skipped than kvtier may hold with the margin, so an unbounded queue, which
    # would have held it, would fail the growth check below. (How much more depends on how fast the engine
    # outruns the slowed writer on the machine: 187 MiB against 96 here on a loaded 2-core run.)
    assert skipped_mib > held_mib + MARGIN_MIB
    assert added <= held_mib + MARGIN_MIB
