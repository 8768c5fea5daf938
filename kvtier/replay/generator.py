"""Synthetic Claude-Code-like agent sessions in the AgentX / Weka trace schema.

Owns: a seeded generator of coding-agent sessions (root agent, parallel
sub-agent groups, tool loops, human turns, context compaction) whose JSON is
field-for-field the schema of ``../shared/traces/weka_claude_code`` and loads
through :func:`kvtier.replay.readers.load_trace`. Deterministic for a seed
(numpy ``Generator``); session ``k`` depends only on ``(seed, k)``.

Calibration (see ``tests/test_generator.py`` for the asserted tolerances):
the published figures over 710 Claude Code traces (input p50 104k / p90 234k
tokens, output p50 216, think time p50 10 s / p90 162 s, p50 11 new blocks
per request, 44% of sessions with sub-agents) and, for shapes the traces' README does
not give, the 120 public dev traces: tool+system prompt of about 12.4k+2.8k
tokens, 52 requests per session at p50 (p90 158), sub-agents spawned in
parallel groups of 1-3 with about 11 requests each, think time after a tool
call p50 8 s vs after an ``end_turn`` p50 100 s, compaction back to the
system prefix plus a summary once the context passes ~170k tokens (480k for
the 40% of sessions on a long-context model).

Every trace is ``hash_id_scope: "local"`` and declares its tools + system
prompt in ``tool_tokens`` / ``system_tokens`` (sub-agent entries their own),
so aiperf's ``WekaTrace`` model accepts it. All sessions declare the same
prefix, and sub-agents of one type the same as each other: loaded with
``shared_prefix="declared"`` (what :func:`default_workload` and ``kvtier
replay`` on the embedded workload do), they share those blocks across
sessions, as every session of one deployment sends the same tools and
system prompt; loaded with the default ``"none"``, or replayed by aiperf,
each session's prefix is its own.

>>> traces = generate_coding_sessions(2, seed=1, config=GeneratorConfig(max_requests_per_agent=3))
>>> [len([r for r in t["requests"] if r["type"] != "subagent"]) <= 3 for t in traces]
[True, True]
>>> traces[0]["requests"][0]["hash_ids"][:3] == traces[1]["requests"][0]["hash_ids"][:3]
True
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from .model import Workload
from .readers import load_trace_objects

ROOT_MODEL = "claude-opus-4-5-20251101"
SMALL_MODEL = "claude-haiku-4-5-20251001"
_PRIVATE_ID_BITS = 20  # ids of session k live in [(k + 1) << 20, (k + 2) << 20)
_SUBAGENT_PREFIX_BASE = 100_000


@dataclass(frozen=True, slots=True)
class GeneratorConfig:
    """Distribution parameters; lognormals are given by median and sigma (of the log).

    ``max_requests_per_agent`` caps turns of every agent (``None``: no cap);
    a cap shortens sessions and so shrinks contexts below the calibrated sizes.
    """

    block_size: int = 64
    tool_tokens: int = 12416
    system_tokens: int = 2752
    first_prompt_median_tokens: float = 4000.0
    first_prompt_sigma: float = 1.0
    resumed_session_fraction: float = 0.4
    resumed_context_median_tokens: float = 95000.0
    resumed_context_sigma: float = 0.6
    turns_median: float = 56.0
    turns_sigma: float = 0.9
    max_requests_per_agent: int | None = None
    appended_median_tokens: float = 220.0
    appended_sigma: float = 1.9
    session_growth_sigma: float = 0.85
    output_median_tokens: float = 218.0
    output_sigma: float = 1.1
    output_max_tokens: int = 32000
    end_turn_prob: float = 0.15
    tool_think_median_s: float = 10.0
    tool_think_sigma: float = 1.7
    user_think_median_s: float = 120.0
    user_think_sigma: float = 2.3
    side_request_prob: float = 0.1
    compaction_threshold_tokens: int = 170_000
    long_context_fraction: float = 0.4
    long_context_threshold_tokens: int = 480_000
    compaction_keep: tuple[float, float] = (0.3, 0.75)
    subagent_session_fraction: float = 0.44
    spawn_points_extra_mean: float = 1.0
    group_sizes: tuple[int, ...] = (1, 2, 3)
    group_size_probs: tuple[float, ...] = (0.42, 0.26, 0.32)
    subagent_types: tuple[str, ...] = ("Explore", "Plan", "general-purpose")
    subagent_type_probs: tuple[float, ...] = (0.85, 0.1, 0.05)
    subagent_tool_tokens: int = 7424
    subagent_system_tokens: int = 1024
    subagent_prompt_median_tokens: float = 2500.0
    subagent_turns_median: float = 10.0
    subagent_turns_sigma: float = 0.5
    subagent_appended_median_tokens: float = 1200.0
    subagent_appended_sigma: float = 1.5
    subagent_think_median_s: float = 6.0
    subagent_think_sigma: float = 0.7
    subagent_result_median_tokens: float = 1500.0
    join_gap_median_s: float = 10.0
    join_gap_sigma: float = 1.0

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"GeneratorConfig.block_size={self.block_size!r}: must be > 0")
        if self.max_requests_per_agent is not None and self.max_requests_per_agent < 1:
            raise ValueError(
                f"GeneratorConfig.max_requests_per_agent={self.max_requests_per_agent!r}: must be >= 1 or None"
            )


DEFAULT_CONFIG = GeneratorConfig()


def generate_coding_sessions(
    num_sessions: int, seed: int = 0, *, config: GeneratorConfig = DEFAULT_CONFIG
) -> list[dict[str, Any]]:
    """``num_sessions`` AgentX / Weka trace objects (JSON-ready dicts), deterministic for ``seed``.

    O(total hash ids). Session ``k`` is the same whatever ``num_sessions`` is.
    """
    if num_sessions < 0 or num_sessions >= (1 << (62 - _PRIVATE_ID_BITS)):
        raise ValueError(f"num_sessions={num_sessions!r}: must be in [0, 2**{62 - _PRIVATE_ID_BITS})")
    children = np.random.SeedSequence(seed).spawn(num_sessions)
    return [_SessionBuilder(config, np.random.default_rng(ss), seed, k).build() for k, ss in enumerate(children)]


def default_workload(
    seed: int = 0,
    num_sessions: int = 40,
    *,
    max_requests_per_agent: int | None = 48,
    config: GeneratorConfig = DEFAULT_CONFIG,
    shared_prefix: str = "declared",
) -> Workload:
    """A small generated workload, loaded through the trace reader.

    Defaults (40 sessions, at most 48 requests per agent) keep a replay of
    several policies well under a minute on two cores. ``shared_prefix``:
    as :func:`~kvtier.replay.readers.load_trace` (default ``"declared"``:
    sessions share the tools + system prompt they declare).
    """
    cfg = replace(config, max_requests_per_agent=max_requests_per_agent)
    traces = generate_coding_sessions(num_sessions, seed, config=cfg)
    return load_trace_objects(traces, name=f"generated-seed{seed}", shared_prefix=shared_prefix)


def write_traces(directory: str | Path, traces: Sequence[dict[str, Any]]) -> list[Path]:
    """Write one ``<id>.json`` per trace into ``directory`` (created if missing); return the paths."""
    out_dir = Path(directory)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, trace in enumerate(traces):
        path = out_dir / f"{trace.get('id', f'trace_{i:04d}')}.json"
        path.write_text(json.dumps(trace, separators=(",", ":")))
        paths.append(path)
    return paths


# ---------------------------------------------------------------------------


class _Context:
    """An append-only prompt: token count and the ids of its full blocks."""

    __slots__ = ("tokens", "ids", "prefix_blocks", "_ids_source", "block_size")

    def __init__(self, prefix_ids: list[int], prefix_tokens: int, ids_source: _IdSource, block_size: int) -> None:
        self.block_size = block_size
        self.tokens = prefix_tokens
        self.ids = list(prefix_ids)
        self.prefix_blocks = len(prefix_ids)
        self._ids_source = ids_source

    def append(self, tokens: int) -> None:
        self.tokens += tokens
        self.ids.extend(self._ids_source.take(self.tokens // self.block_size - len(self.ids)))

    def compact(self, keep_tokens: int) -> None:
        """Replace everything after the shared prefix by a fresh summary."""
        del self.ids[self.prefix_blocks :]
        self.tokens = self.prefix_blocks * self.block_size
        self.append(keep_tokens)

    def side(self, tokens: int) -> tuple[int, list[int]]:
        """A branch off the context (not kept): its size and block ids."""
        total = self.tokens + tokens
        return total, self.ids + self._ids_source.take(total // self.block_size - len(self.ids))


class _IdSource:
    __slots__ = ("next_id", "end")

    def __init__(self, slot: int) -> None:
        self.next_id = (slot + 1) << _PRIVATE_ID_BITS
        self.end = (slot + 2) << _PRIVATE_ID_BITS

    def take(self, n: int) -> list[int]:
        if n <= 0:
            return []
        first = self.next_id
        self.next_id += n
        if self.next_id > self.end:
            raise ValueError("a generated session needs more than 2**20 private block ids; lower the turn counts")
        return list(range(first, first + n))


class _SessionBuilder:
    def __init__(self, cfg: GeneratorConfig, rng: np.random.Generator, seed: int, k: int) -> None:
        self.cfg, self.rng, self.k = cfg, rng, k
        self.trace_id = f"gen{seed}_{k:04d}"
        self.ids = _IdSource(k)
        self.num_subagents = 0
        self.models = {ROOT_MODEL}
        self.tokens = {"parent": [0, 0], "subagent": [0, 0]}
        # Sessions differ in how much each tool result adds (small edits vs whole-file reads).
        self.growth = float(np.exp(cfg.session_growth_sigma * rng.standard_normal()))
        self.entries: list[dict[str, Any]] = []
        self.threshold = cfg.compaction_threshold_tokens
        self.ctx: _Context | None = None
        self.prev_end, self.prev_stop, self.prev_out = 0.0, "", 0
        self.pending_ends: list[float] = []
        self.pending_results = 0

    # -- sampling helpers
    def lognormal(self, median: float, sigma: float) -> float:
        return float(median * np.exp(sigma * self.rng.standard_normal()))

    def turns(self, median: float, sigma: float, minimum: int) -> int:
        n = max(minimum, int(round(self.lognormal(median, sigma))))
        cap = self.cfg.max_requests_per_agent
        return min(n, cap) if cap is not None else n

    def output_tokens(self) -> int:
        sampled = round(self.lognormal(self.cfg.output_median_tokens, self.cfg.output_sigma))
        return int(min(self.cfg.output_max_tokens, max(1, sampled)))

    def api_time_s(self, input_tokens: int, output_tokens: int, model: str) -> float:
        rate = 120.0 if model == SMALL_MODEL else 55.0
        return round(0.4 + input_tokens * 4e-6 + output_tokens / rate, 2)

    def request(
        self, t: float, kind: str, model: str, ctx_tokens: int, ids: list[int], out: int, stop: str,
        think: float, api: float, first: bool, prev_stop: str,
    ) -> dict[str, Any]:
        input_type = "text" if first or prev_stop != "tool_use" else "tool_result"
        output_types = ["text", "tool_use"] if stop == "tool_use" else (["text"] if stop else [])
        return {
            "t": round(t, 3), "type": kind, "model": model, "in": ctx_tokens, "out": out, "hash_ids": ids,
            "input_types": [input_type], "output_types": output_types, "stop": stop,
            "api_time": api, "think_time": round(think, 2),
        }

    # -- the root agent
    def build(self) -> dict[str, Any]:
        """One trace: ``n_turns`` root requests (tool loop, human turns, side calls) and sub-agent groups."""
        cfg, rng = self.cfg, self.rng
        with_subagents = rng.random() < cfg.subagent_session_fraction
        n_turns = self.turns(cfg.turns_median, cfg.turns_sigma, 2 if with_subagents else 1)
        spawn_at: set[int] = set()
        if with_subagents and n_turns >= 2:
            count = min(n_turns - 1, 1 + int(rng.poisson(cfg.spawn_points_extra_mean)))
            spawn_at = {int(x) for x in rng.choice(n_turns - 1, size=count, replace=False)}
        long_context = rng.random() < cfg.long_context_fraction  # a 1M-token model compacts later
        self.threshold = cfg.long_context_threshold_tokens if long_context else cfg.compaction_threshold_tokens
        self.ctx = self.root_context()
        index = 0
        while index < n_turns:  # side requests count against the turn budget
            self.root_request(index, last=index == n_turns - 1, spawns=index in spawn_at)
            index += 1
            if index - 1 in spawn_at:
                self.spawn_group()
            elif index < n_turns - 1 and index not in spawn_at and rng.random() < cfg.side_request_prob:
                self.side_request()
                index += 1
        return self.trace()

    def root_context(self) -> _Context:
        cfg = self.cfg
        prefix_tokens = cfg.tool_tokens + cfg.system_tokens
        ctx = _Context(list(range(1, 1 + prefix_tokens // cfg.block_size)), prefix_tokens, self.ids, cfg.block_size)
        if self.rng.random() < cfg.resumed_session_fraction:  # a resumed conversation starts large
            first = self.lognormal(cfg.resumed_context_median_tokens, cfg.resumed_context_sigma)
        else:
            first = self.lognormal(cfg.first_prompt_median_tokens, cfg.first_prompt_sigma)
        ctx.append(int(min(first, 0.9 * self.threshold)))
        return ctx

    def root_request(self, index: int, *, last: bool, spawns: bool) -> None:
        cfg, ctx = self.cfg, self.ctx
        think, sent = 0.0, 0.0
        if index > 0:
            ctx.append(self.prev_out + self.appended() + self.pending_results)
            self.maybe_compact(ctx, self.threshold)
            if self.pending_ends:  # the join: wait for the last sub-agent, then a short gap
                sent = max(self.pending_ends) + self.lognormal(cfg.join_gap_median_s, cfg.join_gap_sigma)
            else:
                sent = self.prev_end + self.think(self.prev_stop)
            think = sent - self.prev_end
            self.pending_ends, self.pending_results = [], 0
        if spawns:  # the Task tool call that spawns sub-agents
            stop = "tool_use"
        else:
            stop = "end_turn" if last or self.rng.random() < cfg.end_turn_prob else "tool_use"
        out = self.output_tokens()
        api = self.api_time_s(ctx.tokens, out, ROOT_MODEL)
        self.entries.append(
            self.request(sent, "n", ROOT_MODEL, ctx.tokens, list(ctx.ids), out, stop, think, api, index == 0,
                         self.prev_stop)
        )
        self.count("parent", ctx.tokens, out)
        self.prev_end, self.prev_stop, self.prev_out = sent + api, stop, out

    def spawn_group(self) -> None:
        """1-3 sub-agents started in parallel after the last root request; the next one joins them."""
        cfg, rng = self.cfg, self.rng
        subs = [self.subagent(self.prev_end + rng.uniform(0.2, 1.0)) for _ in range(self.group_size())]
        subs.sort(key=lambda e: e["t"])  # the traces list sub-agents by return time
        self.entries.extend(subs)
        self.pending_ends = [e["t"] for e in subs]
        self.pending_results = sum(int(self.lognormal(cfg.subagent_result_median_tokens, 0.6)) for _ in subs)

    def side_request(self) -> None:
        """An ``s`` call that branches off the context without extending it."""
        side_in, side_ids = self.ctx.side(int(self.lognormal(600.0, 1.0)))
        think = self.think(self.prev_stop)
        out = self.output_tokens()
        api = self.api_time_s(side_in, out, ROOT_MODEL)
        sent = self.prev_end + think
        self.entries.append(
            self.request(sent, "s", ROOT_MODEL, side_in, side_ids, out, self.prev_stop, think, api, False,
                         self.prev_stop)
        )
        self.count("parent", side_in, out)
        self.prev_end = sent + api

    def maybe_compact(self, ctx: _Context, threshold: int) -> None:
        """Past ``threshold`` tokens, keep the shared prefix plus a summary of a random fraction."""
        if ctx.tokens > threshold:
            kept = int(ctx.tokens * self.rng.uniform(*self.cfg.compaction_keep))
            ctx.compact(max(0, kept - ctx.prefix_blocks * self.cfg.block_size))

    def appended(self) -> int:
        return max(0, int(self.growth * self.lognormal(self.cfg.appended_median_tokens, self.cfg.appended_sigma)))

    def think(self, prev_stop: str) -> float:
        cfg = self.cfg
        if prev_stop == "tool_use":
            return self.lognormal(cfg.tool_think_median_s, cfg.tool_think_sigma)
        return self.lognormal(cfg.user_think_median_s, cfg.user_think_sigma)

    def group_size(self) -> int:
        cfg = self.cfg
        return int(self.rng.choice(np.array(cfg.group_sizes), p=np.array(cfg.group_size_probs)))

    def count(self, who: str, input_tokens: int, output_tokens: int) -> None:
        self.tokens[who][0] += input_tokens
        self.tokens[who][1] += output_tokens

    # -- sub-agents
    def subagent(self, start_s: float) -> dict[str, Any]:
        cfg, rng = self.cfg, self.rng
        self.num_subagents += 1
        type_index = int(rng.choice(len(cfg.subagent_types), p=np.array(cfg.subagent_type_probs)))
        agent_type = cfg.subagent_types[type_index]
        model = SMALL_MODEL if agent_type == "Explore" else ROOT_MODEL
        self.models.add(model)
        prefix_tokens = cfg.subagent_tool_tokens + cfg.subagent_system_tokens
        base = _SUBAGENT_PREFIX_BASE * (type_index + 1)
        prefix_ids = list(range(base, base + prefix_tokens // cfg.block_size))
        ctx = _Context(prefix_ids, prefix_tokens, self.ids, cfg.block_size)
        ctx.append(int(self.lognormal(cfg.subagent_prompt_median_tokens, 0.5)))
        n = self.turns(cfg.subagent_turns_median, cfg.subagent_turns_sigma, 2)
        requests: list[dict[str, Any]] = []
        t, prev_out, tool_uses, total = 0.0, 0, 0, 0
        for j in range(n):
            think = 0.0
            if j > 0:
                added = self.lognormal(cfg.subagent_appended_median_tokens, cfg.subagent_appended_sigma)
                ctx.append(prev_out + max(0, int(added)))
                self.maybe_compact(ctx, cfg.compaction_threshold_tokens)
                think = self.lognormal(cfg.subagent_think_median_s, cfg.subagent_think_sigma)
                t += think
            stop = "end_turn" if j == n - 1 else "tool_use"
            out = self.output_tokens()
            api = self.api_time_s(ctx.tokens, out, model)
            requests.append(
                self.request(t, "n", model, ctx.tokens, list(ctx.ids), out, stop, think, api, j == 0, "tool_use")
            )
            self.count("subagent", ctx.tokens, out)
            tool_uses += stop == "tool_use"
            total += ctx.tokens + out
            t += api
            prev_out = out
        duration_s = t + float(rng.uniform(0.2, 1.5))
        return {
            "t": round(start_s + duration_s, 3), "type": "subagent", "agent_id": f"agent_{self.num_subagents:03d}",
            "subagent_type": agent_type, "duration_ms": int(round(duration_s * 1000)), "total_tokens": total,
            "tool_use_count": tool_uses, "status": "completed", "requests": requests, "models": [model],
            "tool_tokens": cfg.subagent_tool_tokens, "system_tokens": cfg.subagent_system_tokens,
        }

    def trace(self) -> dict[str, Any]:
        (p_in, p_out), (s_in, s_out) = self.tokens["parent"], self.tokens["subagent"]
        return {
            "id": self.trace_id,
            "models": sorted(self.models),
            "block_size": self.cfg.block_size,
            "hash_id_scope": "local",
            "tool_tokens": self.cfg.tool_tokens,
            "system_tokens": self.cfg.system_tokens,
            "requests": self.entries,
            "totals": {
                "parent_tokens": {"input": p_in, "output": p_out},
                "subagent_tokens": {"input": s_in, "output": s_out},
                "combined_tokens": {"input": p_in + s_in, "output": p_out + s_out},
                "subagent_count": self.num_subagents,
            },
        }
