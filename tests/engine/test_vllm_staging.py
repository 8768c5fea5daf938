"""A queued request's KV staged from SSD into DRAM before vLLM schedules it, in a real engine.

The decision (``kvtier``'s ``stage_queued``, :meth:`EnginePlacement.stage`)
is the replay's queue-aware staging: a request that arrives while vLLM cannot
schedule it has the SSD-only blocks of its cached prefix promoted into DRAM
while others compute, so the load vLLM asks for when it does schedule the
request reads DRAM.

Phases, on one engine (``max_num_seqs`` 1, so a second request queues):

1. an agent's first turn (24 full blocks), tagged with a tool wait: kvtier
   writes its blocks through to DRAM and SSD;
2. other traffic (two 40-block prompts) pushes them out of the 48-block DRAM
   tier; vLLM's own prefix cache is then reset, so only the SSD holds them;
3. a long request (16 blocks, 96 tokens out) and the agent's second turn
   (its context plus a block) arrive together: the long one runs, the agent
   queues behind it. (The long request's own stores to DRAM are in flight
   meanwhile; DRAM has room for both.)

``kvtier`` stages the agent's 24 blocks while the long request runs and
loads them from DRAM; ``kvtier-space-only`` (no time-based decisions) does
not stage, and loads them from SSD. The agent's output is the same in both.
"""

from __future__ import annotations

import hashlib

import pytest

from kvtier.sdk import tag_request

from .engine_support import BLOCK_SIZE, ENGINE, TINY_LLAMA, make_model, run_child

pytestmark = pytest.mark.slow

CONTEXT_BLOCKS, NOISE_BLOCKS, LONG_BLOCKS = 24, 40, 16
DRAM_BLOCKS = 48


def _tokens(block_ids: range, salt: int) -> list[int]:
    out = []
    for b in block_ids:
        seed = int.from_bytes(hashlib.blake2b(f"{salt}:{b}".encode(), digest_size=8).digest(), "big")
        out += [(seed >> (j % 48)) % 997 + 3 for j in range(BLOCK_SIZE)]
    return out


def _phases(tag: str) -> list[dict]:
    context = _tokens(range(CONTEXT_BLOCKS), 1)
    turn2 = context + _tokens(range(CONTEXT_BLOCKS, CONTEXT_BLOCKS + 1), 1) + [5, 6, 7]
    first = tag_request({}, f"{tag}-s", "root", 600.0)["kv_transfer_params"]  # back in 10 minutes
    second = tag_request({}, f"{tag}-s", "root", None)["kv_transfer_params"]
    return [
        {"prompts": [[7, 8, 9, 10, 11]]},  # warm-up: no full block
        {"prompts": [context + [3, 4]], "kv_transfer_params": [first]},
        {"prompts": [_tokens(range(NOISE_BLOCKS), 2) + [3], _tokens(range(NOISE_BLOCKS), 3) + [3]]},
        {"reset_prefix_cache": True, "prompts": [_tokens(range(LONG_BLOCKS), 4) + [3], turn2],
         "kv_transfer_params": [None, second], "max_tokens": [96, 8]},
    ]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("staging")
    model = make_model(tmp / "model", config={**TINY_LLAMA, "max_position_embeddings": 4096})
    engine = {**ENGINE, "num_gpu_blocks_override": 401, "max_num_seqs": 1, "max_model_len": 4096,
              "max_num_batched_tokens": 4096}
    out = {}
    for placement in ("kvtier", "kvtier-space-only"):
        phases = _phases(placement)
        before = {}
        spec = {"model": str(model), "max_tokens": 8, "engine": engine, "phases": phases,
                "kvtier": {"placement": placement, "hbm_hold": False, "exclusive_dram": False,
                           "dram_capacity_blocks": DRAM_BLOCKS,
                           "ssd_path": str(tmp / f"{placement}.ssd"), "ssd_capacity_blocks": 1024,
                           "stats_path": str(tmp / f"{placement}.stats.json")}}
        run = run_child(tmp, placement, spec)
        before = run["phases"][-2]["stats"]["counters"]
        last = run["phases"][-1]
        after = last["stats"]["counters"]
        out[placement] = {
            "staged": after.get("staged_blocks", 0) - before.get("staged_blocks", 0),
            "dram": after.get("hit_tokens_dram", 0) - before.get("hit_tokens_dram", 0),
            "ssd": after.get("hit_tokens_ssd", 0) - before.get("hit_tokens_ssd", 0),
            "agent_output": last["outputs"][1]["token_ids"],
            "reset": run.get("resets"),
        }
    print("\n" + "\n".join(f"{k:<18} staged {v['staged']:>3} blocks, loaded from DRAM {v['dram']:>4} tokens, "
                           f"from SSD {v['ssd']:>4}" for k, v in out.items()))
    return out


def test_the_queued_request_is_staged_and_loads_from_dram(runs: dict) -> None:
    assert runs["kvtier"]["reset"] == [True]  # nothing of the agent's context was left in HBM
    assert runs["kvtier"]["staged"] == CONTEXT_BLOCKS
    assert runs["kvtier"]["dram"] == CONTEXT_BLOCKS * BLOCK_SIZE and runs["kvtier"]["ssd"] == 0


def test_without_staging_the_same_request_loads_from_ssd(runs: dict) -> None:
    control = runs["kvtier-space-only"]
    assert control["reset"] == [True]
    assert control["staged"] == 0
    assert control["ssd"] == CONTEXT_BLOCKS * BLOCK_SIZE and control["dram"] == 0


def test_staging_does_not_change_the_tokens(runs: dict) -> None:
    assert runs["kvtier"]["agent_output"] == runs["kvtier-space-only"]["agent_output"]
