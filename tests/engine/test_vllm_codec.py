"""Lossy cold tiers in a real vLLM engine (issue 24), on the copy-task test model
(tests/engine/trained_model.py): one engine with ``cold_codec=rq4`` and an SSD
tier (no DRAM) serves prompts of which half announce a long tool wait; after a
prefix-cache reset it serves them again, the waiting half from ``rq4`` SSD
values, the rest from exact ones. Greedy tokens must equal the same prompts
without any cache. Scenario and figures: tests/engine/codec_scenario.py; the
README's table (raw, rq4, rq3 per tier, both test models) comes from the same
scenario, run by bench/codec_results.py."""

from __future__ import annotations

import pytest

from .codec_scenario import run

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cold(tmp_path_factory: pytest.TempPathFactory) -> dict:
    data = run(tmp_path_factory.mktemp("codec"), "trained", noise=False, cold=True, codecs=())
    return data["runs"]["cold"]


def test_only_the_blocks_of_waiting_requests_are_compressed(cold: dict) -> None:
    assert cold["stored_codecs"]["rq4"] == cold["store_cold_blocks"] == cold["blocks_waited"] > 0
    assert cold["stored_codecs"]["raw"] > 0


def test_rq4_values_keep_the_greedy_tokens(cold: dict) -> None:
    waited, exact = cold["waited"], cold["not_waited"]
    print(f"\nrq4-loaded prompts: {waited['identical_prompts']}/{waited['prompts']} identical, max logprob diff "
          f"{waited['max_logprob_diff']:.4f}; raw-loaded: {exact['identical_prompts']}/{exact['prompts']}, "
          f"{exact['max_logprob_diff']:.4f}")
    assert waited["identical_prompts"] == waited["prompts"], waited["first_differing_step"]
    assert 0 < waited["max_logprob_diff"] < 0.1  # lossy, and small
    assert exact["identical_prompts"] == exact["prompts"] and exact["max_logprob_diff"] == 0


def test_every_prefix_block_came_from_ssd_and_lossy_ones_were_not_stored_again(cold: dict) -> None:
    assert cold["hit_tokens_ssd"] > 0
    assert cold["load_lossy_blocks"] == cold["loaded_waited"]
    assert cold["store_skipped_lossy_blocks"] >= cold["load_lossy_blocks"]
