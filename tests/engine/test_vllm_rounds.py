"""Exact sharing of an all-gather round's context in a real engine, through the SDK's round-aware layout.

Four agents, three rounds. Each round every agent's prompt is built by
:class:`kvtier.sdk.rounds.RoundLayout`: the preamble and the outputs of the
rounds so far (the engine's own greedy outputs, by agent id), then the
agent's private part (its persona and this round's task). The four prompts of
a round go to the engine together.

Two engines take the same prompts round by round:

* ``kvtier``: vLLM's prefix caching plus the kvtier connector (DRAM tier);
* ``plain``: no prefix caching and no connector.

Shown: the round's new shared tokens are computed once per round, not once
per agent (vLLM's own hit counters plus kvtier's external hits), the outputs
equal the plain engine's, and the KV kvtier stores is the shared blocks once
plus each agent's private blocks (within one block per agent and round).
"""

from __future__ import annotations

import hashlib

import pytest

from kvtier.sdk.rounds import RoundLayout

from .engine_support import BLOCK_SIZE, ENGINE, TINY_LLAMA, ServedEngine, make_model

pytestmark = pytest.mark.slow

AGENTS, ROUNDS, OUT = 4, 3, 32
PREAMBLE_TOKENS, PERSONA_TOKENS, TASK_TOKENS = 8 * BLOCK_SIZE, 2 * BLOCK_SIZE, 17


def _tokens(label: str, n: int) -> list[int]:
    seed = hashlib.blake2b(label.encode(), digest_size=32).digest()
    return [seed[j % 32] * 3 + j % 7 + 3 for j in range(n)]


def _private(agent: int, rnd: int) -> list[int]:
    return _tokens(f"persona-{agent}", PERSONA_TOKENS) + _tokens(f"task-{agent}-{rnd}", TASK_TOKENS)


@pytest.fixture(scope="module")
def rounds(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("rounds")
    model = make_model(tmp / "model", config={**TINY_LLAMA, "max_position_embeddings": 4096})
    engine = {**ENGINE, "max_model_len": 4096, "max_num_batched_tokens": 8192}
    stats = tmp / "kvtier.stats.json"
    cached = ServedEngine(tmp, "kvtier", {"model": str(model), "max_tokens": OUT, "engine": engine,
                                          "kvtier": {"dram_capacity_blocks": 4096, "exclusive_dram": False,
                                                     "stats_path": str(stats)}})
    plain = ServedEngine(tmp, "plain", {"model": str(model), "max_tokens": OUT,
                                        "engine": {**engine, "enable_prefix_caching": False}})
    layout = RoundLayout(_tokens("preamble", PREAMBLE_TOKENS))
    out, prev = [], {"local": 0.0, "ext": 0.0, "stored": 0}
    cached_blocks = 0  # shared full blocks cached by the end of the last round
    try:
        for rnd in range(ROUNDS):
            prompts = [layout.prompt(_private(a, rnd)) for a in range(AGENTS)]
            shared = prompts[0].shared_tokens
            ran = cached.run({"prompts": [p.tokens for p in prompts]})
            ref = plain.run({"prompts": [p.tokens for p in prompts]})
            now = {"local": ran["local_hits"], "ext": ran["external_hits"],
                   "stored": ran["stats"]["counters"].get("stored_blocks_dram", 0)}
            hit = (now["local"] - prev["local"]) + (now["ext"] - prev["ext"])
            out.append({
                "prompt_tokens": sum(len(p.tokens) for p in prompts),
                "computed": int(sum(len(p.tokens) for p in prompts) - hit),
                "new_shared": shared - cached_blocks * BLOCK_SIZE,  # the round's shared tokens not cached before
                "shared": shared, "private": len(prompts[0].tokens) - shared,
                "new_shared_blocks": prompts[0].shared_blocks(BLOCK_SIZE) - cached_blocks,
                # each agent's own full blocks, with those its answer fills (all but the last token have KV)
                "private_blocks": [(len(p.tokens) + OUT - 1) // BLOCK_SIZE - p.shared_blocks(BLOCK_SIZE)
                                   for p in prompts],
                "stored": now["stored"] - prev["stored"],
                "outputs": [r["token_ids"] for r in ran["outputs"]],
                "plain_outputs": [r["token_ids"] for r in ref["outputs"]],
            })
            prev, cached_blocks = now, prompts[0].shared_blocks(BLOCK_SIZE)
            layout.add_round({f"agent-{a}": out[-1]["outputs"][a] for a in range(AGENTS)})
    finally:
        cached.close()
        plain.close()
    print(f"\n{'round':>5}{'prompt':>8}{'computed':>10}{'new shared':>12}{'private x4':>12}{'stored':>8}"
          f"{'storage saved':>15}")
    for i, r in enumerate(out):
        s, p = r["shared"], r["private"]
        print(f"{i + 1:>5}{r['prompt_tokens']:>8}{r['computed']:>10}{r['new_shared']:>12}{AGENTS * p:>12}"
              f"{r['stored']:>8}{AGENTS * (s + p) / (s + AGENTS * p):>14.2f}x")
    return out


def test_the_shared_prefix_is_computed_once_per_round(rounds: list[dict]) -> None:
    # the figures the README quotes: here every shared prefix ends on a block boundary (a 256-token
    # preamble, then 4 x 32 output tokens a round), so exactly the new shared tokens once plus every private part
    assert [r["computed"] for r in rounds] == [r["new_shared"] + AGENTS * r["private"] for r in rounds] \
        == [580, 452, 452]
    for i, r in enumerate(rounds):
        # once: the new shared tokens, plus each agent's private part and the block where it begins
        assert r["computed"] <= r["new_shared"] + AGENTS * (r["private"] + BLOCK_SIZE), (i, r["computed"])
        # and not per agent: computing it for every agent would take this much more
        assert r["computed"] < AGENTS * r["new_shared"], (i, r["computed"])


def test_outputs_equal_the_engine_without_any_cache(rounds: list[dict]) -> None:
    for r in rounds:
        assert r["outputs"] == r["plain_outputs"]


def test_kvtier_stores_the_shared_blocks_once(rounds: list[dict]) -> None:
    """Unique blocks stored: the round's new shared blocks once, plus every agent's
    own (within one block per agent); a store per agent would take N x the shared."""
    for i, r in enumerate(rounds):
        once = r["new_shared_blocks"] + sum(r["private_blocks"])
        assert abs(r["stored"] - once) <= AGENTS, (i, r["stored"], once)
        assert r["stored"] < AGENTS * r["new_shared_blocks"] + sum(r["private_blocks"]), i


def test_unique_kv_bytes_match_the_sharing_formula(rounds: list[dict]) -> None:
    """After each round, the blocks kvtier holds for that round's N prompts (every shared
    block once, each agent's own) come to S + N * P tokens within one block per agent, S
    the shared prefix and P an agent's tokens after it (prompt and answer): the storage of
    N full copies over it is N (S + P) / (S + N P)."""
    stored = private_before = 0
    for i, r in enumerate(rounds):
        stored += r["stored"]
        unique = (stored - private_before) * BLOCK_SIZE  # earlier rounds' private blocks belong to no prompt now
        s, p = r["shared"], r["private"] + OUT - 1  # the last answer token has no KV
        assert abs(unique - (s + AGENTS * p)) <= AGENTS * BLOCK_SIZE, (i, unique, s + AGENTS * p)
        formula = AGENTS * (s + p) / (s + AGENTS * p)
        assert AGENTS * (s + p) / unique == pytest.approx(formula, rel=AGENTS * BLOCK_SIZE / unique), i
        private_before += r["stored"] - r["new_shared_blocks"]
