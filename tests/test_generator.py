"""The synthetic coding-session generator: determinism, schema, reader round trip, calibration."""

from __future__ import annotations

import doctest
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

import kvtier.replay
import kvtier.replay.generator
import kvtier.replay.model
from kvtier.replay import (
    GeneratorConfig,
    default_workload,
    generate_coding_sessions,
    load_trace,
    load_trace_objects,
    write_traces,
)
from kvtier.replay.model import common_prefix_len

TRACES = Path(__file__).resolve().parents[1].parent / "shared" / "traces"
EXAMPLE = TRACES / "weka_claude_code" / "example_trace_0277_with_subagents.json"

SMALL = GeneratorConfig(max_requests_per_agent=6)


def test_same_seed_same_sessions_and_session_k_is_stable() -> None:
    a = generate_coding_sessions(4, seed=7, config=SMALL)
    assert a == generate_coding_sessions(4, seed=7, config=SMALL)
    assert a != generate_coding_sessions(4, seed=8, config=SMALL)
    # Session k depends only on (seed, k), not on how many sessions were asked for.
    assert generate_coding_sessions(2, seed=7, config=SMALL) == a[:2]
    assert generate_coding_sessions(0, seed=7) == []


@pytest.mark.skipif(not EXAMPLE.exists(), reason=f"public traces not found under {TRACES}")
def test_schema_matches_the_real_traces() -> None:
    real = json.loads(EXAMPLE.read_text())
    real_request_keys = {k for r in real["requests"] if r["type"] != "subagent" for k in r}
    real_sub = next(r for r in real["requests"] if r["type"] == "subagent")
    traces = generate_coding_sessions(30, seed=3, config=SMALL)
    assert {k for t in traces for k in t} == set(real)
    subs = [e for t in traces for e in t["requests"] if e["type"] == "subagent"]
    assert subs and {k for e in subs for k in e} == set(real_sub)
    requests = [e for t in traces for e in t["requests"] if e["type"] != "subagent"]
    requests += [r for e in subs for r in e["requests"]]
    assert {k for r in requests for k in r} == real_request_keys
    assert {r["type"] for r in requests} <= {"n", "s"} and {r["stop"] for r in requests} <= {"tool_use", "end_turn", ""}
    assert all(t["block_size"] == 64 and t["hash_id_scope"] == "local" for t in traces)
    # Full blocks only, as in the real traces: len(hash_ids) == in // 64.
    assert all(len(r["hash_ids"]) == r["in"] // 64 for r in requests)


def test_written_traces_load_through_the_reader(tmp_path: Path) -> None:
    traces = generate_coding_sessions(5, seed=11, config=SMALL)
    paths = write_traces(tmp_path / "gen", traces)
    assert [p.name for p in paths] == [f"gen11_{k:04d}.json" for k in range(5)]
    from_files = load_trace(tmp_path / "gen")
    from_files.check_invariants()
    from_objects = load_trace_objects(traces)
    strip = lambda w: tuple(replace(s, source="") for s in w.sessions)  # noqa: E731
    assert strip(from_files) == strip(from_objects)
    assert [s.session_id for s in from_files.sessions] == [t["id"] for t in traces]
    declared = load_trace(tmp_path / "gen", shared_prefix="declared")
    assert strip(declared) == strip(load_trace_objects(traces, shared_prefix="declared"))
    # Declared prefixes shared: fewer distinct blocks than with every session's prefix its own.
    assert declared.num_distinct_blocks() < from_files.num_distinct_blocks()


def test_declared_prefix_gives_the_sharing_the_old_global_scope_gave() -> None:
    # Until this change the generator wrote hash_id_scope "global" (which aiperf
    # rejects) to share the tools + system prefix across sessions. The same
    # traces with scope "local" read with shared_prefix="declared" must give
    # exactly that workload, so replay figures keep their meaning.
    traces = generate_coding_sessions(12, seed=5, config=SMALL)
    assert any(e["type"] == "subagent" for t in traces for e in t["requests"])
    as_global = [{**t, "hash_id_scope": "global"} for t in traces]
    declared = load_trace_objects(traces, shared_prefix="declared")
    assert declared.sessions == load_trace_objects(as_global).sessions
    private = load_trace_objects(traces)
    roots = [s.root.requests[0].block_ids for s in private.sessions]
    assert len({r[0] for r in roots}) == len(roots)  # no two sessions share a block
    prefix = (SMALL.tool_tokens + SMALL.system_tokens) // SMALL.block_size
    shared = {s.root.requests[0].block_ids[:prefix] for s in declared.sessions}
    assert len(shared) == 1 and len(next(iter(shared))) == prefix
    # the block after the declared prefix is each session's own
    assert len({s.root.requests[0].block_ids[prefix] for s in declared.sessions}) == len(declared.sessions)


def test_default_workload_is_small_and_shares_the_system_prefix() -> None:
    w = default_workload(seed=0, num_sessions=12, max_requests_per_agent=10)
    w.check_invariants()
    assert (w.block_size, w.open_loop, len(w.sessions)) == (64, False, 12)
    assert w.num_requests() < 12 * 10 * 8
    # Tools + system prompt: 12416 + 2752 tokens = 237 blocks, the same ids in every session.
    firsts = [s.root.requests[0].block_ids for s in w.sessions]
    assert all(common_prefix_len(firsts[0], f) == 237 for f in firsts[1:])
    # Sub-agents of one type share their own prefix across sessions (132 blocks).
    explore = [a.requests[0].block_ids for s in w.sessions for a in s.agents if a.agent_type == "Explore"]
    assert len(explore) >= 2 and common_prefix_len(explore[0], explore[1]) == 132
    assert explore[0][0] not in set(firsts[0])
    assert default_workload(seed=0, num_sessions=12, max_requests_per_agent=10) == w


def test_default_workload_size_for_replay() -> None:
    # The default must replay several policies within minutes on two cores.
    w = default_workload()
    assert 30 <= len(w.sessions) <= 60
    assert all(len(a.requests) <= 48 for s in w.sessions for a in s.agents)
    assert sum(len(r.block_ids) for _, _, r in w.iter_requests()) < 4_000_000


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="max_requests_per_agent=0"):
        GeneratorConfig(max_requests_per_agent=0)
    with pytest.raises(ValueError, match="block_size"):
        GeneratorConfig(block_size=0)
    with pytest.raises(ValueError, match="num_sessions"):
        generate_coding_sessions(-1)


def test_doctests() -> None:
    for module in (kvtier.replay, kvtier.replay.generator, kvtier.replay.model):
        assert doctest.testmod(module).failed == 0, module.__name__


# ---------------------------------------------------------------------------
# Calibration against the traces README (710 public Claude Code traces) and
# AgentX's 44% of sessions with sub-agents. Tolerances leave room for the
# sampling noise of 250 sessions (per-seed spread measured over seeds 0-3).


@pytest.fixture(scope="module")
def sample() -> list[dict]:
    return generate_coding_sessions(250, seed=0)


def _agent_streams(trace: dict) -> list[list[dict]]:
    streams = [[e for e in trace["requests"] if e["type"] != "subagent"]]
    streams += [e["requests"] for e in trace["requests"] if e["type"] == "subagent"]
    return streams


def test_calibration_of_sizes_and_times(sample: list[dict]) -> None:
    requests = [r for t in sample for s in _agent_streams(t) for r in s]
    inputs = np.array([r["in"] for r in requests])
    outputs = np.array([r["out"] for r in requests])
    thinks = np.array([r["think_time"] for t in sample for s in _agent_streams(t) for r in s[1:]])
    assert 104_000 * 0.8 <= np.percentile(inputs, 50) <= 104_000 * 1.2
    assert 234_000 * 0.65 <= np.percentile(inputs, 90) <= 234_000 * 1.35
    assert 216 * 0.85 <= np.percentile(outputs, 50) <= 216 * 1.15
    assert np.percentile(outputs, 99) > 8 * np.percentile(outputs, 50)  # heavy tail
    assert 10 * 0.75 <= np.percentile(thinks, 50) <= 10 * 1.25
    assert 162 * 0.65 <= np.percentile(thinks, 90) <= 162 * 1.35


def test_calibration_of_growth_subagents_and_compaction(sample: list[dict]) -> None:
    new_blocks, compactions = [], 0
    for t in sample:
        for stream in _agent_streams(t):
            for prev, cur in zip(stream, stream[1:]):
                kept = common_prefix_len(prev["hash_ids"], cur["hash_ids"])
                new_blocks.append(len(cur["hash_ids"]) - kept)
                compactions += kept < len(prev["hash_ids"]) // 2
    assert 8 <= np.percentile(new_blocks, 50) <= 15  # README: p50 11 new blocks per request
    assert 0.002 * len(new_blocks) <= compactions <= 0.03 * len(new_blocks)  # dev traces: ~1.5%
    with_subagents = sum(any(e["type"] == "subagent" for e in t["requests"]) for t in sample)
    assert 0.36 <= with_subagents / len(sample) <= 0.52
    per_session = [len(_agent_streams(t)[0]) for t in sample]
    assert 40 <= np.percentile(per_session, 50) <= 65  # dev traces: p50 52 requests per session
