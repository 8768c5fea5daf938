"""Trace readers and the workload model, on the real public traces and on crafted bad input."""

from __future__ import annotations

import copy
import io
import json
import math
import tarfile
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.errors import ConfigError, KVTierError
from kvtier.replay import (
    Request,
    Session,
    Agent,
    TraceError,
    Workload,
    load_trace,
    load_trace_objects,
    load_trace_with_report,
    reblock,
)
from kvtier.replay.model import common_prefix_len

TRACES = Path(__file__).resolve().parents[1].parent / "shared" / "traces"
EXAMPLE = TRACES / "weka_claude_code" / "example_trace_0277_with_subagents.json"
DEV_TARBALL = TRACES / "weka_claude_code" / "weka_dev_120.tar.xz"
MOONCAKE = TRACES / "mooncake_fast25" / "conversation_trace.jsonl"

needs_traces = pytest.mark.skipif(
    not (EXAMPLE.exists() and DEV_TARBALL.exists() and MOONCAKE.exists()),
    reason=f"public traces not found under {TRACES} (expected ../shared/traces beside the checkout)",
)


@pytest.fixture(scope="module")
def example() -> Workload:
    return load_trace(EXAMPLE)


@pytest.fixture(scope="module")
def example_json() -> dict:
    return json.loads(EXAMPLE.read_text())


@pytest.fixture(scope="module")
def dev() -> tuple[Workload, float]:
    started = time.perf_counter()
    workload, report = load_trace_with_report(DEV_TARBALL)
    assert report.num_skipped == 0
    return workload, time.perf_counter() - started


def _strip_sources(w: Workload) -> tuple[Session, ...]:
    return tuple(replace(s, source="") for s in w.sessions)


def _raw_requests(entries: list) -> list[dict]:
    """API requests of one agent (sub-agent entries skipped), in order."""
    return [e for e in entries if e["type"] != "subagent"]


# ---------------------------------------------------------------------------
# Real traces


@needs_traces
def test_example_trace_agent_tree(example: Workload) -> None:
    # trace_0277: request 0 spawns three Explore agents in parallel, request 1
    # (t=228) waits for all of them; request 6 spawns a Plan agent joined by 7.
    (s,) = example.sessions
    example.check_invariants()
    assert (example.block_size, example.open_loop) == (64, False)
    assert [(a.agent_id, a.parent_id, a.agent_type, len(a.requests), a.spawn_after, a.join_before) for a in s.agents] == [
        ("root", None, "main", 9, None, None),
        ("agent_001", "root", "Explore", 4, 0, 1),
        ("agent_002", "root", "Explore", 12, 0, 1),
        ("agent_003", "root", "Explore", 17, 0, 1),
        ("agent_004", "root", "Plan", 11, 6, 7),
    ]
    join = s.root.requests[1]
    assert join.depends_on == ("agent_001", "agent_002", "agent_003")
    assert join.gap_cause == "subagent_join"
    # agent_003 returned at t=211.347; the parent sent request 1 at t=228.
    assert join.gap_s == pytest.approx(228.0 - 211.347)
    assert s.root.requests[7].depends_on == ("agent_004",)
    # A tool-loop request is paced by its own think_time (8.0 s before t=248).
    assert (s.root.requests[2].gap_s, s.root.requests[2].gap_cause) == (8.0, "tool")
    # agent_001 started at 79.224 - 59.750 s, 0.69 s after request 0 ended (18.78 s).
    first = s.agent("agent_001").requests[0]
    assert first.gap_cause == "start"
    assert first.arrival_s == pytest.approx(79.224 - 59.750)
    assert first.gap_s == pytest.approx(79.224 - 59.750 - 18.78)
    assert s.agent("agent_001").requests[1].arrival_s == pytest.approx(79.224 - 59.750 + 6.0)


@needs_traces
def test_example_block_ids_are_a_bijection_of_trace_ids(example: Workload, example_json: dict) -> None:
    # Full blocks only: the Weka traces list in // 64 ids, all kept, and the
    # local -> global remapping is one-to-one within the trace.
    (s,) = example.sessions
    raw_agents = [example_json["requests"]] + [e["requests"] for e in example_json["requests"] if e["type"] == "subagent"]
    local_to_global: dict[int, int] = {}
    for agent, raw in zip(s.agents, raw_agents):
        for req, raw_req in zip(agent.requests, _raw_requests(raw), strict=True):
            assert len(req.block_ids) == len(raw_req["hash_ids"]) == raw_req["in"] // 64
            for a, b in zip(raw_req["hash_ids"], req.block_ids):
                assert local_to_global.setdefault(a, b) == b
    assert len(set(local_to_global.values())) == len(local_to_global) == example.num_distinct_blocks()


@needs_traces
def test_dev_tarball_loads(dev: tuple[Workload, float]) -> None:
    workload, seconds = dev
    workload.check_invariants()
    assert len(workload.sessions) == 120
    assert sum(s.has_subagents() for s in workload.sessions) == 9  # as the README says
    assert sum(len(s.agents) - 1 for s in workload.sessions) == 36
    assert workload.num_requests() == 9473
    ids = [s.session_id for s in workload.sessions]
    assert ids == sorted(ids)  # members read in sorted name order, not archive order
    assert all(s.source.startswith(f"{DEV_TARBALL}:traces/trace_") for s in workload.sessions)
    assert seconds < 30, f"loading the dev tarball took {seconds:.1f} s"
    # Traces are local-scope: no block is shared by two sessions.
    seen: dict[int, str] = {}
    for s, _, r in workload.iter_requests():
        for b in r.block_ids[:1]:
            assert seen.setdefault(b, s.session_id) == s.session_id


@needs_traces
def test_dev_async_subagents_are_not_joined(dev: tuple[Workload, float]) -> None:
    # trace_0295 launches four general-purpose agents with status
    # "async_launched"; the parent goes on without waiting for them.
    (s,) = [s for s in dev[0].sessions if s.session_id == "trace_0295"]
    background = [a for a in s.agents if a.status == "async_launched"]
    assert len(background) == 4
    assert all(a.join_before is None and a.spawn_after is not None for a in background)
    assert not any(set(r.depends_on) & {a.agent_id for a in background} for r in s.root.requests)


@needs_traces
def test_dev_tarball_same_as_parsed_objects(dev: tuple[Workload, float]) -> None:
    # The fast hash_ids path (raw text, prefix reuse) gives exactly what a
    # plain json.loads of every member gives.
    with tarfile.open(DEV_TARBALL) as tar:
        members = sorted((m for m in tar.getmembers() if m.isfile()), key=lambda m: m.name)[:12]
        objs = [json.load(tar.extractfile(m)) for m in members]
    plain = load_trace_objects(objs)
    assert _strip_sources(plain) == _strip_sources(dev[0])[:12]


@pytest.fixture(scope="module")
def mooncake() -> tuple[Workload, object]:
    return load_trace_with_report(MOONCAKE)


@needs_traces
def test_mooncake_loads(mooncake) -> None:
    workload, report = mooncake
    workload.check_invariants()
    assert (workload.open_loop, workload.block_size, report.num_loaded) == (True, 512, 12031)
    assert workload.num_requests() == len(workload.sessions) == 12031
    first = json.loads(MOONCAKE.read_text().split("\n", 1)[0])
    r0 = workload.sessions[0].root.requests[0]
    assert (r0.input_tokens, r0.output_tokens, r0.arrival_s) == (6758, 500, 0.0)
    # Mooncake lists ceil(in / 512) ids; the trailing partial block's id is dropped.
    assert len(first["hash_ids"]) == 14 and len(r0.block_ids) == 6758 // 512 == 13
    assert all(len(r.block_ids) == r.input_tokens // 512 for _, _, r in workload.iter_requests())
    # Ids are shared across lines: hash id 0 is everyone's first block.
    assert workload.sessions[1].root.requests[0].block_ids[0] == r0.block_ids[0]
    assert workload.sessions[-1].start_s == pytest.approx(3536.999)


# ---------------------------------------------------------------------------
# Re-blocking


@needs_traces
def test_merge_keeps_shared_prefixes_shared(example: Workload) -> None:
    merged = reblock(example, 128)
    merged.check_invariants()
    assert merged.block_size == 128
    old_reqs = [r for _, _, r in example.iter_requests()]
    new_reqs = [r for _, _, r in merged.iter_requests()]
    for a, b in zip(old_reqs, new_reqs):
        assert len(b.block_ids) == len(a.block_ids) // 2
    # Any two requests sharing 2j leading 64-blocks share exactly j leading 128-blocks.
    for i in range(0, len(old_reqs), 5):
        for j in range(i + 1, len(old_reqs), 7):
            k = common_prefix_len(old_reqs[i].block_ids, old_reqs[j].block_ids)
            limit = min(len(new_reqs[i].block_ids), len(new_reqs[j].block_ids))
            assert common_prefix_len(new_reqs[i].block_ids, new_reqs[j].block_ids) == min(k // 2, limit)
    # The three Explore agents share their system prompt, and still do.
    firsts = [a.requests[0].block_ids for a in merged.sessions[0].agents[1:4]]
    assert common_prefix_len(firsts[0], firsts[1]) >= 50
    assert load_trace(EXAMPLE, block_size=128) == merged


def test_merged_ids_depend_only_on_constituents() -> None:
    def one(ids: tuple[int, ...], name: str) -> Session:
        r = Request(0, 64 * len(ids), 1, ids, 0.0, "start", "", 0.0)
        return Session(name, (Agent("root", None, "main", (r,)),))

    a = Workload("a", 64, (one((1, 2, 3, 4), "x"), one((1, 2, 9, 9), "y")), False)
    b = Workload("b", 64, (one((7, 7, 7, 7), "z"), one((1, 2, 3, 4, 5), "x")), False)
    ma, mb = reblock(a, 128), reblock(b, 128)
    x_a, y_a = (s.root.requests[0].block_ids for s in ma.sessions)
    x_b = mb.sessions[1].root.requests[0].block_ids
    assert x_a == x_b  # same constituents, same ids, whatever else is in the workload
    assert len(x_b) == 2  # (1,2) (3,4); the lone 5 is not a full 128-block
    assert x_a[0] == y_a[0] and x_a[1] != y_a[1]
    # Splitting is deterministic and doubles the blocks; merging the split back
    # is not the identity (ids are derived) but keeps the sharing pattern.
    split = reblock(ma, 64)
    assert split == reblock(ma, 64)
    sx, sy = (s.root.requests[0].block_ids for s in split.sessions)
    assert len(sx) == 4 and sx[:2] == sy[:2] and sx[2:] != sy[2:]
    assert len(set(sx)) == 4


@needs_traces
def test_split_then_merge_round_trip_pattern(example: Workload) -> None:
    merged = reblock(example, 128)
    split = reblock(merged, 32)
    split.check_invariants()
    old = [r.block_ids for _, _, r in merged.iter_requests()]
    new = [r.block_ids for _, _, r in split.iter_requests()]
    for a, b in zip(old, new):
        assert len(b) == 4 * len(a)
    for i in range(1, len(old)):
        assert common_prefix_len(new[i - 1], new[i]) == 4 * common_prefix_len(old[i - 1], old[i])
    # Tokens that were a partial 128-block have no ids after the split.
    assert any(len(r.block_ids) < r.input_tokens // 32 for _, _, r in split.iter_requests())


def test_reblock_rejects_sizes_that_do_not_divide() -> None:
    w = Workload("w", 64, (), False)
    with pytest.raises(ValueError, match=r"block_size=64.*new_block_size=96"):
        reblock(w, 96)
    with pytest.raises(ValueError, match="positive"):
        reblock(w, 0)
    assert reblock(w, 64) is w


@needs_traces
def test_mooncake_reblock_to_engine_sizes(mooncake) -> None:
    w = reblock(mooncake[0], 256)
    assert w.block_size == 256
    r = w.sessions[0].root.requests[0]
    assert len(r.block_ids) == 2 * 13
    assert w.sessions[1].root.requests[0].block_ids[:2] == r.block_ids[:2]


# ---------------------------------------------------------------------------
# Sub-agent timing forms


def _to_absolute(trace: dict) -> dict:
    out = copy.deepcopy(trace)
    for e in out["requests"]:
        if e["type"] == "subagent":
            start = e["t"] - e["duration_ms"] / 1000.0
            for r in e["requests"]:
                r["t"] = round(r["t"] + start, 3)
    return out


@needs_traces
def test_relative_and_absolute_subagent_times(example_json: dict, tmp_path: Path) -> None:
    rel = load_trace_objects([example_json])
    absolute = load_trace_objects([_to_absolute(example_json)])
    ra = [r for _, _, r in rel.iter_requests()]
    aa = [r for _, _, r in absolute.iter_requests()]
    assert [r.block_ids for r in ra] == [r.block_ids for r in aa]
    assert [r.depends_on for r in ra] == [r.depends_on for r in aa]
    assert [r.gap_s for r in ra] == pytest.approx([r.gap_s for r in aa], abs=2e-3)
    assert [r.arrival_s for r in ra] == pytest.approx([r.arrival_s for r in aa], abs=2e-3)


def test_subagent_without_duration_starts_at_t() -> None:
    trace = _tiny_trace()
    sub = trace["requests"][1]
    del sub["duration_ms"]
    sub["t"] = 3.0
    (s,) = load_trace_objects([trace]).sessions
    child = s.agent("agent_001")
    assert child.requests[0].arrival_s == 3.0
    assert child.requests[0].gap_s == pytest.approx(3.0 - 1.0)  # parent request 0 ended at 1.0
    assert s.root.requests[1].depends_on == ("agent_001",)


# ---------------------------------------------------------------------------
# Bad input


def _tiny_trace() -> dict:
    """Root: r0 (tool_use) → sub-agent (2 requests) → r1 joins it → r2 (end_turn) → r3."""

    def req(t: float, n_in: int, ids: list[int], stop: str = "tool_use", think: float = 0.0) -> dict:
        return {"t": t, "type": "n", "model": "m", "in": n_in, "out": 10, "hash_ids": ids, "input_types": ["text"],
                "output_types": ["text"], "stop": stop, "api_time": 1.0, "think_time": think}

    return {
        "id": "tiny", "models": ["m"], "block_size": 64, "hash_id_scope": "local", "tool_tokens": 1,
        "system_tokens": 1,
        "requests": [
            req(0.0, 130, [1, 2]),
            {"t": 12.0, "type": "subagent", "agent_id": "agent_001", "subagent_type": "Explore",
             "duration_ms": 10500, "status": "completed",
             "requests": [req(0.0, 70, [50]), req(5.0, 200, [50, 51, 52], "end_turn", 4.0)]},
            req(15.0, 260, [1, 2, 3, 4], think=14.0),
            req(20.0, 300, [1, 2, 3, 4], "end_turn", 4.0),
            req(90.0, 320, [1, 2, 3, 4, 5], think=69.0),
        ],
    }


def test_tiny_trace_semantics() -> None:
    (s,) = load_trace_objects([_tiny_trace()]).sessions
    root, child = s.agents
    assert (child.spawn_after, child.join_before) == (0, 1)
    assert [(r.gap_s, r.gap_cause) for r in root.requests] == [
        (0.0, "start"), (15.0 - 12.0, "subagent_join"), (4.0, "tool"), (69.0, "user")
    ]
    assert [(r.gap_s, r.gap_cause, r.arrival_s) for r in child.requests] == [(0.5, "start", 1.5), (4.0, "tool", 6.5)]
    # Full blocks only: 130 tokens → 2 blocks; 300 tokens → 4 blocks.
    assert [len(r.block_ids) for r in root.requests] == [2, 4, 4, 5]


def _write(path: Path, obj: object) -> Path:
    path.write_text(json.dumps(obj))
    return path


BAD_CASES = [
    # (mutation, expected location, expected words in the problem, kind)
    (lambda t: t["requests"][2].pop("in"), "requests[2]", "missing field 'in'", "missing"),
    (lambda t: t["requests"][3].__setitem__("out", "10"), "requests[3].out", "expected an int", "type"),
    (lambda t: t["requests"][4].__setitem__("in", -5), "requests[4].in", "non-negative", "value"),
    (lambda t: t["requests"][1]["requests"][1].__setitem__("hash_ids", "x"), "requests[1].requests[1].hash_ids",
     "array of ints", "type"),
    (lambda t: t["requests"][1]["requests"][0].__setitem__("hash_ids", [50, 1.5]), "requests[1].requests[0].hash_ids[1]",
     "int block id", "type"),
    (lambda t: t["requests"][0].__setitem__("hash_ids", [1, 2, 3, 4]), "requests[0].hash_ids", "at most 3 blocks",
     "value"),
    (lambda t: t["requests"][0].__setitem__("think_time", float("nan")), "requests[0].think_time", "finite", "value"),
    (lambda t: t["requests"][2].__setitem__("type", "x"), "requests[2].type", "unknown request type", "value"),
    (lambda t: t["requests"][1].__setitem__("requests", {}), "requests[1].requests", "expected an array", "type"),
    (lambda t: t.__setitem__("block_size", 0), "block_size", "positive", "value"),
    (lambda t: t.pop("requests"), "", "missing field 'requests'", "missing"),
]


@pytest.mark.parametrize("mutate, location, words, kind", BAD_CASES)
def test_bad_field_names_file_and_request(tmp_path: Path, mutate, location: str, words: str, kind: str) -> None:
    trace = _tiny_trace()
    mutate(trace)
    path = _write(tmp_path / "bad.json", trace)
    with pytest.raises(TraceError) as info:
        load_trace(path)
    err = info.value
    assert isinstance(err, KVTierError) and isinstance(err, ValueError)
    assert str(path) in str(err) and location in str(err) and words in str(err), str(err)
    assert (err.location, err.kind) == (location, kind)


def test_truncated_json_names_the_request(tmp_path: Path) -> None:
    text = json.dumps(_tiny_trace())
    cut = text.index('"hash_ids": [1, 2, 3, 4, 5]') + 20  # inside requests[4].hash_ids
    path = tmp_path / "trunc.json"
    path.write_text(text[:cut])
    with pytest.raises(TraceError, match=r"trunc\.json: requests\[4\]\.hash_ids\[\d+\]: malformed JSON") as info:
        load_trace(path)
    assert info.value.kind == "malformed"


def test_malformed_hash_ids_tail_is_caught(tmp_path: Path) -> None:
    # The fast path parses only the new tail of each hash_ids array: a bad
    # tail after a reused prefix must still fail, at the right request.
    text = json.dumps(_tiny_trace()).replace('"hash_ids": [1, 2, 3, 4, 5]', '"hash_ids": [1, 2, 3, 4, "5"]')
    path = tmp_path / "tail.json"
    path.write_text(text)
    with pytest.raises(TraceError, match=r"requests\[4\]\.hash_ids\[4\]: expected an int block id"):
        load_trace(path)
    path.write_text(text.replace('4, "5"]', "4,]"))
    with pytest.raises(TraceError, match=r"requests\[4\]|malformed"):
        load_trace(path)


def test_garbage_bytes_and_deep_nesting(tmp_path: Path) -> None:
    path = tmp_path / "g.json"
    for data in (b"\xff\xfe\x00garbage", b"[" * 100_000, b"", b"[]", b'{"requests": 7}', b"1e999999"):
        path.write_bytes(data)
        with pytest.raises(TraceError, match="g.json"):
            load_trace(path)


def test_mooncake_bad_lines(tmp_path: Path) -> None:
    good = {"timestamp": 5, "input_length": 1000, "output_length": 3, "hash_ids": [0, 1]}
    lines = [json.dumps(good), json.dumps({**good, "input_length": -1}), '{"timestamp": 1', json.dumps(good),
             json.dumps({**good, "hash_ids": [0, 1, 2]})]
    path = tmp_path / "m.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(TraceError, match=r"m\.jsonl: line 2\.input_length: expected a non-negative int"):
        load_trace(path)
    w, report = load_trace_with_report(path, skip_bad=True)
    assert len(w.sessions) == 2 and report.num_skipped == 3
    assert report.skipped_by_kind() == {"value": 2, "malformed": 1}
    assert [s.session_id for s in w.sessions] == ["m:1", "m:4"]


def test_skip_bad_in_a_directory_and_a_tarball(tmp_path: Path) -> None:
    traces = tmp_path / "traces"
    traces.mkdir()
    for i in range(3):
        t = _tiny_trace()
        t["id"] = f"good{i}"
        _write(traces / f"good{i}.json", t)
    broken = _tiny_trace()
    broken["requests"][2]["in"] = "many"
    _write(traces / "bad1.json", broken)
    (traces / "bad2.json").write_text('{"requests": [')
    (traces / "README.md").write_text("not a trace")
    with pytest.raises(TraceError, match="bad1.json"):
        load_trace(traces)
    w, report = load_trace_with_report(traces, skip_bad=True)
    assert [s.session_id for s in w.sessions] == ["good0", "good1", "good2"]
    assert report.num_loaded == 3 and report.skipped_by_kind() == {"type": 1, "malformed": 1}

    tarball = tmp_path / "set.tar.gz"
    with tarfile.open(tarball, "w:gz") as tar:
        for p in sorted(traces.iterdir(), reverse=True):  # archive order is not name order
            tar.add(p, arcname=f"traces/{p.name}")
    with pytest.raises(TraceError, match=r"set\.tar\.gz:traces/bad1\.json: requests\[2\]\.in"):
        load_trace(tarball)
    w2, report2 = load_trace_with_report(tarball, skip_bad=True)
    assert [s.session_id for s in w2.sessions] == ["good0", "good1", "good2"]
    assert report2.num_skipped == 2
    assert _strip_sources(w2) == _strip_sources(w)

    truncated = tmp_path / "cut.tar.gz"
    truncated.write_bytes(tarball.read_bytes()[:200])
    with pytest.raises(TraceError, match="corrupt or truncated archive") as info:
        load_trace(truncated)
    assert info.value.kind == "archive"


def test_global_scope_shares_ids_across_traces() -> None:
    a, b = _tiny_trace(), _tiny_trace()
    a["id"], b["id"] = "a", "b"
    local = load_trace_objects([a, b])
    assert not local.sessions[0].root.requests[0].block_ids[0] == local.sessions[1].root.requests[0].block_ids[0]
    a["hash_id_scope"] = b["hash_id_scope"] = "global"
    shared = load_trace_objects([a, b])
    assert shared.sessions[0].root.requests[0].block_ids == shared.sessions[1].root.requests[0].block_ids
    a["hash_id_scope"] = "galaxy"
    with pytest.raises(TraceError, match="unknown scope 'galaxy'"):
        load_trace_objects([a])


def test_mixing_open_and_closed_loop_traces_is_refused(tmp_path: Path) -> None:
    _write(tmp_path / "a.json", _tiny_trace())
    (tmp_path / "b.jsonl").write_text(json.dumps({"timestamp": 0, "input_length": 10, "output_length": 1,
                                                  "hash_ids": [0]}) + "\n")
    with pytest.raises(TraceError, match="cannot mix"):
        load_trace(tmp_path)
    w, report = load_trace_with_report(tmp_path, skip_bad=True)
    assert len(w.sessions) == 1 and report.skipped_by_kind() == {"format": 1}


def test_missing_path_and_bad_block_size(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_trace(tmp_path / "nope.json")
    with pytest.raises(ValueError, match="block_size"):
        load_trace_objects([_tiny_trace()], block_size=-64)
    with pytest.raises(TraceError, match=r"block_size=64 to new_block_size=96"):
        load_trace_objects([_tiny_trace()], block_size=96)


# ---------------------------------------------------------------------------
# Property: garbage in → TraceError out, never anything else

_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=12,
)


def _paths(obj: object, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += _paths(v, prefix + (i,))
    return out


@st.composite
def _mutated_traces(draw: st.DrawFn) -> dict:
    trace = _tiny_trace()
    for _ in range(draw(st.integers(1, 3))):
        paths = [p for p in _paths(trace) if p]
        path = draw(st.sampled_from(paths))
        parent = trace
        for key in path[:-1]:
            parent = parent[key]
        if draw(st.booleans()) and isinstance(parent, dict):
            del parent[path[-1]]
        else:
            parent[path[-1]] = draw(_json_values)
    return trace


def _load_bytes_or_trace_error(path: Path, data: bytes) -> None:
    path.write_bytes(data)
    for skip_bad in (False, True):
        try:
            w = load_trace(path, skip_bad=skip_bad)
        except TraceError:
            continue
        w.check_invariants()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_mutated_traces())
def test_mutated_traces_raise_only_trace_error(trace: dict) -> None:
    try:
        w = load_trace_objects([trace])
    except TraceError:
        return
    w.check_invariants()


_WORK = Path(tempfile.mkdtemp(prefix="kvtier-fuzz-"))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_mutated_json_text_raises_only_trace_error(data: st.DataObject) -> None:
    text = json.dumps(_tiny_trace()).encode()
    choice = data.draw(st.integers(0, 3))
    if choice == 0:  # truncate
        text = text[: data.draw(st.integers(0, len(text)))]
    elif choice == 1:  # overwrite a few bytes
        for _ in range(data.draw(st.integers(1, 4))):
            i = data.draw(st.integers(0, len(text) - 1))
            text = text[:i] + data.draw(st.binary(min_size=1, max_size=3)) + text[i + 1 :]
    elif choice == 2:  # splice characters that matter to the hash_ids fast path
        i = data.draw(st.integers(0, len(text)))
        text = text[:i] + data.draw(st.sampled_from([b"]", b"[", b",", b'"', b"\\u0000#0", b" ", b"-", b"{"])) + text[i:]
    else:
        text = data.draw(st.binary(max_size=64))
    for suffix in ("t.json", "t.jsonl", "t.tar.gz"):
        _load_bytes_or_trace_error(_WORK / suffix, text)


def test_tar_of_garbage_member_raises_trace_error(tmp_path: Path) -> None:
    tarball = tmp_path / "x.tar"
    with tarfile.open(tarball, "w") as tar:
        info = tarfile.TarInfo("traces/a.json")
        payload = b'{"requests": [{"type": "n"'
        info.size = len(payload)
        tar.addfile(info, io.BytesIO(payload))
    with pytest.raises(TraceError, match=r"x\.tar:traces/a\.json: requests\[0\]"):
        load_trace(tarball)


def test_derived_ids_are_pinned_across_processes() -> None:
    # Ids in [0, 2**63) take the vectorised splitmix64 path, others SHAKE-128;
    # both are fixed functions of the source ids (never Python's hash()).
    r = Request(0, 256, 1, (0, 1, -5, 2**70), 0.0, "start", "", 0.0)
    w = Workload("w", 64, (Session("s", (Agent("root", None, "main", (r,)),)),), False)
    assert reblock(w, 128).sessions[0].root.requests[0].block_ids == (5900388399510858394, 5873795162243741206)
    assert reblock(w, 32).sessions[0].root.requests[0].block_ids[:3] == (
        5494354158007679094, 4630606794518354596, 5562886563891668802
    )


def _declaring(trace_id: str, tools: int, system: int, first_ids: list[int], sub_type: str = "Explore") -> dict:
    t = _tiny_trace()
    t["id"], t["tool_tokens"], t["system_tokens"] = trace_id, tools, system
    t["requests"][0]["hash_ids"] = first_ids
    t["requests"][0]["in"] = 64 * len(first_ids)
    t["requests"][1].update(tool_tokens=64, system_tokens=64, subagent_type=sub_type)
    t["requests"][1]["requests"][0].update(hash_ids=[50, 51], **{"in": 130})
    return t


def test_declared_prefix_is_keyed_by_kind_tools_and_system() -> None:
    # Block size 64: tools of 128 tokens are blocks 0-1; a system prompt of 64
    # more tokens is block 2. Raw ids differ per trace (they are local).
    a = _declaring("a", 128, 64, [1, 2, 3, 9])
    b = _declaring("b", 128, 64, [7, 8, 6, 5])      # same tools, same system: shares blocks 0-2
    c = _declaring("c", 128, 100, [4, 3, 2, 1])     # same tools, other system: shares blocks 0-1
    d = _declaring("d", 192, 0, [1, 2, 3, 4], "Plan")  # other tools: shares nothing
    none = load_trace_objects([a, b, c, d])
    first = [s.root.requests[0].block_ids for s in none.sessions]
    assert len({ids[0] for ids in first}) == 4
    w = load_trace_objects([a, b, c, d], shared_prefix="declared")
    w.check_invariants()
    ra, rb, rc, rd = (s.root.requests[0].block_ids for s in w.sessions)
    assert ra[:3] == rb[:3] and ra[3] != rb[3]
    assert rc[:2] == ra[:2] and rc[2] != ra[2]
    assert not set(rd) & (set(ra) | set(rb) | set(rc))
    # Later requests reuse the trace's own ids: r1 of "a" lists raw ids 1, 2, 3, 4.
    assert w.sessions[0].root.requests[1].block_ids[:3] == ra[:3]
    # Sub-agents: "Explore" (a, b, c) share their declared 128-token prefix (2 blocks of the
    # 3-block r1); "Plan" (d) does not share with them; the root's ids are never a sub-agent's.
    subs = [s.agents[1].requests[1].block_ids for s in w.sessions]
    assert subs[0][:2] == subs[1][:2] == subs[2][:2] and subs[0][2] != subs[1][2]
    assert subs[3][0] not in {subs[0][0], subs[0][1]}
    assert not set(subs[0][:2]) & set(ra)


def test_declared_prefix_read_from_files_and_rolled_back_with_a_skipped_trace(tmp_path: Path) -> None:
    a = _declaring("a", 128, 64, [1, 2, 3, 9])
    bad = _declaring("b", 128, 100, [7, 8, 6, 5])
    bad["requests"][2]["in"] = "many"  # fails after its prefix was keyed (a new system-prompt key)
    c = _declaring("c", 128, 100, [5, 6, 7, 8])
    for name, t in (("a", a), ("b", bad), ("c", c)):
        _write(tmp_path / f"{name}.json", t)
    w, report = load_trace_with_report(tmp_path, skip_bad=True, shared_prefix="declared")
    assert report.num_skipped == 1 and [s.session_id for s in w.sessions] == ["a", "c"]
    ra, rc = (s.root.requests[0].block_ids for s in w.sessions)
    assert ra[:2] == rc[:2] and ra[2] != rc[2]
    # Dense ids with no gap and no collision: the skipped trace's ids were given back.
    ids = {i for s in w.sessions for ag in s.agents for r in ag.requests for i in r.block_ids}
    assert ids == set(range(len(ids)))
    strip = lambda w: tuple(replace(s, source="") for s in w.sessions)  # noqa: E731
    assert strip(w) == strip(load_trace_objects([a, c], shared_prefix="declared"))
    with pytest.raises(ConfigError, match="shared_prefix"):
        load_trace_objects([a], shared_prefix="global")


def test_mooncake_partial_block_id_is_kept_apart(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 1100, "output_length": 1, "hash_ids": [1, 2, 3]}\n'
                    '{"timestamp": 5, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2]}\n')
    w = load_trace(path)
    r0, r1 = (s.root.requests[0] for s in w.sessions)
    assert r0.block_ids == r1.block_ids and r0.partial_block is not None and r1.partial_block is None
    assert r0.partial_block not in r0.block_ids
    assert all(s.root.requests[0].partial_block is None for s in w.reblock(1024).sessions)


@needs_traces
def test_the_turn_end_wait_is_the_tuning_halfs_median_after_an_end_turn() -> None:
    """``TURN_END_GAP_S``: what follows a turn that called no tool, over the tuning half,
    a user's turn (its gap) or the agent's end (never), at the median."""
    from kvtier.placement.base import TURN_END_GAP_S
    from kvtier.replay.run import split_workload

    w = split_workload(load_trace(DEV_TARBALL), "tune")
    gaps = [r.gap_s for s in w.sessions for a in s.agents for r in a.requests[1:] if r.gap_cause == "user"]
    ends = sum(len(s.agents) for s in w.sessions)
    mixture = sorted(gaps) + [math.inf] * ends
    assert (len(gaps), ends) == (385, 77)
    assert mixture[len(mixture) // 2] == TURN_END_GAP_S
