"""All-gather rounds: a workload generator and a round-level replay with an SLO capacity search.

Owns: the round-based multi-agent workload (GenerativeAgents / debate /
map-reduce shape: N agents with private histories; each round every agent
reads new private input and the outputs the others produced in the previous
round, in its own order, then writes its own output) and the cost of running
it on one profile under three KV strategies. Pure float arithmetic over
:class:`~kvtier.replay.profiles.Profile`; must not touch bytes or torch.
Separate from the request-level simulator (:mod:`kvtier.replay.sim`): it
prices whole rounds, which is what a round latency SLO bounds.

Strategies (``ROUND_POLICIES``):

* ``lru`` — vLLM prefix caching in HBM. Each agent receives the shared outputs
  after its own history, in its own order, so their chained prefix keys never
  match another agent's (:func:`prefix_hits` computes this from the generated
  block ids): every agent prefills every received output and keeps a full
  copy. KV beyond HBM is evicted and recomputed (charged as prefill).
* ``lru-dram`` — the same, but full per-agent copies that overflow HBM live in
  host DRAM and are swapped in and out over the host link every round.
* ``kvtier`` — master + mirrors. A segment's master is its producer's own
  output KV (already computed while decoding). Every other agent reuses it and
  recomputes ``recompute_fraction`` of the positions in its own context
  (prefill compute); its mirror materialises only the blocks that differ
  (``diff_block_fraction`` of the segment, restored on device from master +
  diff: HBM traffic), and shares the identical ones with the master. Overflow
  swaps to DRAM like ``lru-dram``.

Round latency (every agent in one continuous-batching engine, all of a round's
prefills packed into steps of ``max_batch_tokens``, then ``output_tokens``
decode steps with all agents batched)::

    round_s = swap_s + restore_s + prefill_s + decode_s

with ``swap_s`` = overflow bytes over ``dram->hbm`` and back over ``hbm->dram``
(not overlapped with compute: conservative for the DRAM strategies),
``restore_s`` = materialised mirror bytes read and written once at HBM
bandwidth, ``prefill_s`` / ``decode_s`` from :meth:`Profile.step_time_chunks_s`.
Peak KV is counted at the end of each round's decode. The SLO holds when the
slowest round is within ``slo_round_s``. ``latency="full"`` (default) bounds
``round_s``; ``latency="ttft"`` bounds the time until every agent of the round
has its first output token (``swap_s + restore_s + prefill_s`` + one decode
step), the part of a round that shared-context reuse changes.
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

ROUND_POLICIES: tuple[str, ...] = ("lru", "lru-dram", "kvtier")
ROUND_LATENCIES: tuple[str, ...] = ("full", "ttft")
DEFAULT_SLO_ROUND_S = 1.5


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
    """Replay settings: the SLO, kvtier's mirror figures (defaults: the block-granular
    recompute of ``kvtier bench shared``, 15% of positions in 15% of blocks), HBM
    utilisation, DRAM capacity for the DRAM strategies, and the step token budget.
    ``hbm_blocks``: HBM KV capacity in blocks of the workload's block size
    (default: what the profile's HBM holds after weights at ``gpu_memory_utilization``)."""

    slo_round_s: float = DEFAULT_SLO_ROUND_S
    recompute_fraction: float = 0.15
    diff_block_fraction: float = 0.15
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
        for name in ("recompute_fraction", "diff_block_fraction"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ConfigError(f"rounds.{name}", value, "must be in [0, 1]")
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


def round_costs(workload: RoundsWorkload, profile: Profile, policy: str, config: RoundsConfig) -> list[RoundCost]:
    """Cost of every round of ``workload`` under ``policy`` (one of :data:`ROUND_POLICIES`)."""
    if policy not in ROUND_POLICIES:
        raise ConfigError("rounds.policy", policy, f"valid: {list(ROUND_POLICIES)}")
    w, n = workload, workload.num_agents
    kv_per_token = profile.model.kv_bytes_per_token * profile.kv_copies
    hbm_tokens = _hbm_kv_tokens(w, profile, config)
    shared_in = (n - 1) * w.output_tokens
    out: list[RoundCost] = []
    for r in range(w.num_rounds):
        context = w.private_tokens + r * (w.observe_tokens + w.output_tokens + shared_in)
        received = shared_in if r else 0  # round 0 has no outputs to gather yet
        if policy == "kvtier":
            computed = w.observe_tokens + round(config.recompute_fraction * received)
            chunk_context = context + received - round(config.recompute_fraction * received)
            own = w.private_tokens + (r + 1) * (w.observe_tokens + w.output_tokens)
            mirrored = r * shared_in
            kv_tokens = n * (own + round(config.diff_block_fraction * mirrored))
            restore_bytes = n * config.diff_block_fraction * received * kv_per_token
        else:
            computed = w.observe_tokens + received
            chunk_context = context
            kv_tokens = n * (context + w.observe_tokens + received + w.output_tokens)
            restore_bytes = 0.0
        overflow = max(0, kv_tokens - hbm_tokens)
        swap_s = 0.0
        extra: list[tuple[int, int]] = []
        if overflow and policy == "lru":
            extra = [(overflow, 0)]  # evicted prefixes are recomputed (cheapest: no context)
        elif overflow:
            if overflow * kv_per_token > config.dram_bytes:
                raise ConfigError("rounds.dram_bytes", config.dram_bytes, "too small for the overflow; raise it")
            swap_s = (profile.transfer_time_s(overflow * kv_per_token, "dram->hbm")
                      + profile.transfer_time_s(overflow * kv_per_token, "hbm->dram"))
        prefill_s = _prefill_s(profile, [(computed, chunk_context)] * n + extra, config.max_batch_tokens)
        decode_ctx = n * (context + w.observe_tokens + received)
        steps = [profile.step_time_s(0, 0, n, decode_ctx + n * t) for t in range(w.output_tokens)]
        decode_s = sum(steps)
        restore_s = 2.0 * restore_bytes / (profile.hardware.hbm_bw_bytes_s * profile.num_chips)
        prefill_tokens = n * computed + (overflow if policy == "lru" else 0)
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
    """Capacity of every policy and the ratios against ``lru`` and ``lru-dram``; the JSON report."""
    rows = []
    for policy in policies:
        if progress:
            progress(f"[replay rounds] capacity search: {policy}")
        rows.append(capacity(workload, profile, policy, config))
    by = {r["policy"]: r["max_agents"] for r in rows}
    ratios = {}
    if "kvtier" in by:
        for base in ("lru", "lru-dram"):
            if by.get(base):
                ratios[f"kvtier_vs_{base}"] = by["kvtier"] / by[base]
    return {
        "workload": {f: getattr(workload, f) for f in workload.__dataclass_fields__},
        "config": {f: getattr(config, f) for f in config.__dataclass_fields__},
        "profile": profile.spec,
        "hbm_kv_tokens": _hbm_kv_tokens(workload, profile, config),
        "prefix_hits_round1": prefix_hits(replace(workload, num_agents=min(workload.num_agents, 8),
                                                  num_rounds=2), 1),
        "capacity": rows,
        "ratios": ratios,
    }


def format_rounds_table(report: dict[str, Any]) -> str:
    lines = [(f"round SLO {report['config']['slo_round_s'] * 1e3:.0f} ms ({report['config']['latency']} round "
              f"latency) on {report['profile']}: largest number of concurrent agents (slowest round within the SLO)")]
    lines.append(f"{'policy':>10}  {'agents':>6}  {'round ms':>9}  {'ttft ms':>8}  {'prefill ms':>10}  {'decode ms':>9}  "
                 f"{'swap ms':>8}  {'peak KV tok':>11}")
    for row in report["capacity"]:
        pt = next((p for p in row["points"] if p["num_agents"] == row["max_agents"]), None)
        if pt is None:
            lines.append(f"{row['policy']:>10}  {0:>6}")
            continue
        lines.append(f"{row['policy']:>10}  {row['max_agents']:>6}  {pt['round_s_max'] * 1e3:>9.0f}  "
                     f"{pt['ttft_s_max'] * 1e3:>8.0f}  {pt['prefill_s'] * 1e3:>10.0f}  {pt['decode_s'] * 1e3:>9.0f}  "
                     f"{pt['swap_s'] * 1e3:>8.0f}  {pt['kv_tokens_peak']:>11}")
    for k, v in report["ratios"].items():
        lines.append(f"{k}: {v:.2f}x")
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
                label=f"{row['policy']} (max {row['max_agents']})")
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
