"""Fidelity of the replay: the same agent requests through the real vLLM engine
with kvtier and through ``kvtier replay`` configured like that engine.

Workload: the first requests of three sessions of the dev Claude Code traces
(``../shared/traces/weka_claude_code/weka_dev_120.tar.xz``), scaled down to
the tiny model: every 64th 64-token block of a request is kept as one 32-token
block (block ids are prefix hashes, so a kept block still stands for its whole
prefix), at most 26 blocks, plus 5 new tokens per request (its new message,
never reused). The three sessions take turns (A1 B1 C1 A2 B2 C2 ...), one
request at a time, so the two sides serve exactly the same order.

The engine records what it serves (``record_path``, issue 25): the recording
holds every request with lengths and anonymous block ids, no prompt, and
``kvtier replay`` of the recording, configured like the engine, reproduces the
engine's counts within 2% too.

Same configuration on both sides: blocks of 32 tokens, 40 usable HBM blocks
(vLLM: ``num_gpu_blocks_override=41``, one is its null block), a 64-block
DRAM tier written through and read on an HBM miss (the connector; replay
policy ``lru-dram``), LRU everywhere, no SSD. Compared: prefill tokens
computed and hit per tier (HBM = vLLM's prefix cache, DRAM = kvtier).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from .engine_support import BLOCK_SIZE, ENGINE, make_model, run_child

pytestmark = pytest.mark.slow

TRACE = Path(__file__).resolve().parents[3] / "shared" / "traces" / "weka_claude_code" / "weka_dev_120.tar.xz"
SESSIONS, TURNS, STRIDE, CAP, SUFFIX, OUT = 3, 8, 64, 26, 5, 8
HBM_BLOCKS, DRAM_BLOCKS = 40, 64


def _block_tokens(block_id: int) -> list[int]:
    seed = int.from_bytes(hashlib.blake2b(str(block_id).encode(), digest_size=8).digest(), "big")
    return [(seed >> (j % 48)) % 997 + 3 for j in range(BLOCK_SIZE)]


def _requests() -> list[tuple[tuple[int, ...], list[int]]]:
    """(kept block ids, prompt token ids) of each request, in serving order."""
    from kvtier.replay import load_trace

    sessions = load_trace(TRACE).sessions[:SESSIONS]
    out = []
    for turn in range(TURNS):
        for si, s in enumerate(sessions):
            ids = tuple(s.root.requests[turn].block_ids[STRIDE - 1 :: STRIDE][:CAP])
            suffix = [(si * 7919 + turn * 104729 + j * 13) % 997 + 3 for j in range(SUFFIX)]
            out.append((ids, [t for b in ids for t in _block_tokens(b)] + suffix))
    return out


def _replay(requests: list[tuple[tuple[int, ...], list[int]]]) -> dict:
    from kvtier.replay.model import Agent, Request, Session, Workload
    from kvtier.replay.profiles import DEFAULT_PROFILE, parse_profile
    from kvtier.replay.run import ReplaySpec, run_point

    reqs = tuple(Request(i, len(tokens), OUT, ids, 0.0, "start" if i == 0 else "tool", "tool_use", 0.0)
                 for i, (ids, tokens) in enumerate(requests))
    w = Workload("fidelity", BLOCK_SIZE, (Session("turns", (Agent("root", None, "main", reqs),)),), False)
    spec = ReplaySpec(workload=w, profile=parse_profile(DEFAULT_PROFILE), policies=("lru-dram",), concs=(1,),
                      hbm_blocks=(HBM_BLOCKS,), dram_blocks=DRAM_BLOCKS, ssd_blocks=0, scheduler="plain")
    row = run_point(spec, "lru-dram", 1, HBM_BLOCKS)
    return {"computed": row["prefill_tokens_computed"], "hbm": row["prefill_tokens_hit_hbm"],
            "dram": row["prefill_tokens_hit_dram"]}


@pytest.fixture(scope="module")
def both(tmp_path_factory: pytest.TempPathFactory) -> dict:
    if not TRACE.exists():  # a clone with nothing beside it (issue 43): skipped with the reason, as the main suite's
        pytest.skip(f"dev traces not found: {TRACE} (expected ../shared/traces beside the checkout)")
    tmp = tmp_path_factory.mktemp("fidelity")
    requests = _requests()
    rec = tmp / "recording"  # the engine also records what it serves (issue 25; checked below)
    spec = {"model": str(make_model(tmp / "model")), "max_tokens": OUT,
            "engine": {**ENGINE, "num_gpu_blocks_override": HBM_BLOCKS + 1, "max_num_seqs": 1},
            "kvtier": {"dram_capacity_blocks": DRAM_BLOCKS, "exclusive_dram": False,
                       "stats_path": str(tmp / "fidelity.stats.json"),
                       "record_path": str(rec)},
            "phases": [{"prompts": [tokens]} for _, tokens in requests]}
    run = run_child(tmp, "fidelity", spec)
    last = run["phases"][-1]
    prompt_tokens = sum(len(tokens) for _, tokens in requests)
    engine = {"hbm": last["local_hits"], "dram": last["external_hits"]}
    engine["computed"] = prompt_tokens - engine["hbm"] - engine["dram"]
    return {"engine": engine, "replay": _replay(requests), "prompt_tokens": prompt_tokens, "recording": rec,
            "requests": requests}


def test_replay_matches_the_engine_within_two_percent(both: dict) -> None:
    e, r, total = both["engine"], both["replay"], both["prompt_tokens"]
    diffs = {k: (r[k] - e[k]) / total for k in ("computed", "hbm", "dram")}
    print(f"prompt tokens {total}; engine {e}; replay {r}; replay - engine, as a share of prompt tokens: "
          + ", ".join(f"{k} {v:+.2%}" for k, v in diffs.items()))
    assert e["dram"] > 0 and e["hbm"] > 0 and e["computed"] > 0  # every path is exercised
    assert all(abs(v) <= 0.02 for v in diffs.values()), diffs


def test_the_recording_holds_every_request_and_no_prompt(both: dict) -> None:
    from kvtier.replay import load_trace

    files = sorted(both["recording"].glob("*.json"))
    assert len(files) == 1  # untagged requests, one at a time: one trace in the engine's order
    obj = json.loads(files[0].read_text())
    assert obj["block_size"] == BLOCK_SIZE and obj["hash_id_scope"] == "global"
    requests = both["requests"]
    assert [r["in"] for r in obj["requests"]] == [len(tokens) for _, tokens in requests]
    assert all(r["out"] == OUT and r["stop"] == "end_turn" for r in obj["requests"])
    assert all(set(r) == {"t", "type", "model", "in", "out", "hash_ids", "out_hash_ids", "stop", "api_time",
                          "think_time"}
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
    w = load_trace(both["recording"])
    assert w.num_requests() == len(requests) and w.block_size == BLOCK_SIZE


def test_replaying_the_recording_matches_the_engine_within_two_percent(both: dict) -> None:
    from kvtier.replay import load_trace
    from kvtier.replay.profiles import DEFAULT_PROFILE, parse_profile
    from kvtier.replay.run import ReplaySpec, run_point

    w = load_trace(both["recording"])
    spec = ReplaySpec(workload=w, profile=parse_profile(DEFAULT_PROFILE), policies=("lru-dram",), concs=(1,),
                      hbm_blocks=(HBM_BLOCKS,), dram_blocks=DRAM_BLOCKS, ssd_blocks=0, scheduler="plain")
    row = run_point(spec, "lru-dram", 1, HBM_BLOCKS)
    r = {"computed": row["prefill_tokens_computed"], "hbm": row["prefill_tokens_hit_hbm"],
         "dram": row["prefill_tokens_hit_dram"]}
    e, total = both["engine"], both["prompt_tokens"]
    diffs = {k: (r[k] - e[k]) / total for k in ("computed", "hbm", "dram")}
    print(f"prompt tokens {total}; engine {e}; replay of the recording {r}; replay - engine, as a share of "
          "prompt tokens: " + ", ".join(f"{k} {v:+.2%}" for k, v in diffs.items()))
    assert e["dram"] > 0 and e["hbm"] > 0 and e["computed"] > 0
    assert all(abs(v) <= 0.02 for v in diffs.values()), diffs
