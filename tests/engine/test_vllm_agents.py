"""Agent-aware retention through the SDK's hints, in a real vLLM engine.

Two agents alternate turns with tool waits in between (A1 B1 A2 B2 A3 B3,
each turn its agent's whole context so far plus a tool result). The engine's
own KV pool (11 usable blocks of 32 tokens: ``num_gpu_blocks_override``) and kvtier's
DRAM tier (10 blocks) each hold about one agent's context, not both, so the
agent that comes back has always been pushed out of HBM by the other one.

* Without hints kvtier's DRAM tier is LRU: storing the other agent's context
  evicts most of the returning agent's (tail first), so each turn recomputes
  most of its context.
* With hints (``kvtier.sdk.tag_request(..., tool_wait_s=30)`` puts the
  session, agent and expected tool wait into ``kv_transfer_params``), the
  connector pins a waiting agent's context for its expected wait; the other
  agent's stores go where there is room instead of evicting it, and the
  waiting agent comes back to a DRAM hit.

One engine runs both: the unhinted pair first (its blocks stay evictable),
then the hinted pair on other tokens. Prefill computed per turn = prompt
tokens - vLLM prefix-cache hits - kvtier hits (vLLM's own counters).
"""

from __future__ import annotations

import pytest

from kvtier.sdk import tag_request

from .engine_support import ENGINE, make_model, run_child

pytestmark = pytest.mark.slow

TURNS = 3
HBM_BLOCKS = 12  # one is vLLM's null block: 352 tokens, one agent's context (<= 328), not two


def _turns(base: int) -> list[list[int]]:
    """Context of turns 1..TURNS of one agent: 192 tokens, then +64 per turn
    (the 8 generated tokens are not part of it: a new tool result each time)."""
    ctx = [(base + i * 7) % 997 + 3 for i in range(192)]
    out = [list(ctx)]
    for t in range(1, TURNS):
        ctx = ctx + [(base + 5000 + t * 131 + i * 11) % 997 + 3 for i in range(64)]
        out.append(list(ctx))
    return out


def _phases(a: list[list[int]], b: list[list[int]], hinted: bool, tag: str) -> list[dict]:
    phases = []
    for t in range(TURNS):
        for name, turns in (("a", a), ("b", b)):
            params = None
            if hinted:
                last = t == TURNS - 1
                params = tag_request({}, f"session-{tag}", name, None if last else 30.0)["kv_transfer_params"]
            phases.append({"prompts": [turns[t]], "kv_transfer_params": [params]})
    return phases


@pytest.fixture(scope="module")
def agents(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("agents")
    model = make_model(tmp / "model")
    plain = _phases(_turns(1), _turns(2), hinted=False, tag="plain")
    hinted = _phases(_turns(3), _turns(4), hinted=True, tag="hinted")
    spec = {"model": str(model),
            "engine": {**ENGINE, "num_gpu_blocks_override": HBM_BLOCKS, "max_model_len": (HBM_BLOCKS - 1) * 32,
                       "max_num_seqs": 1},
            "kvtier": {"dram_capacity_blocks": 10, "stats_path": str(tmp / "agents.stats.json")},
            "phases": plain + hinted}
    run = run_child(tmp, "agents", spec)
    computed, prev_local, prev_ext = [], 0.0, 0.0
    for phase, ph in zip(spec["phases"], run["phases"]):
        local, ext = ph["local_hits"] - prev_local, ph["external_hits"] - prev_ext
        prev_local, prev_ext = ph["local_hits"], ph["external_hits"]
        computed.append(len(phase["prompts"][0]) - local - ext)
    n = len(plain)
    return {"run": run, "computed": computed, "plain": computed[:n], "hinted": computed[n:]}


def test_hints_make_agents_compute_fewer_prefill_tokens(agents: dict) -> None:
    plain, hinted = sum(agents["plain"]), sum(agents["hinted"])
    print(f"prefill computed per turn: without hints {agents['plain']} = {plain}; "
          f"with hints {agents['hinted']} = {hinted}")
    assert hinted < plain
    counters = agents["run"]["phases"][-1]["stats"]["counters"]
    assert counters.get("tool_wait_pinned_blocks", 0) > 0  # the hints were read and acted on


def test_first_turns_compute_the_same_either_way(agents: dict) -> None:
    # A1 and B1 find nothing anywhere, hinted or not: the difference is retention alone
    assert agents["plain"][:2] == agents["hinted"][:2]
