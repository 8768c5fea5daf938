"""TokenCake-style application workloads: shapes, prefixes, joins, arrivals, tools, replay."""

from __future__ import annotations

import doctest
import math
import statistics
from dataclasses import replace

import pytest

import kvtier.replay.appgen
from kvtier.errors import ConfigError
from kvtier.replay.appgen import DEFAULT_TOOLS, AppGenConfig, ToolSpec, app_workload, describe
from kvtier.replay.model import Session, Workload, common_prefix_len
from kvtier.placement import make_placement
from kvtier.replay.profiles import parse_profile
from kvtier.replay.run import ReplaySpec, run_point
from kvtier.replay.sim import SimConfig, Simulator

APPS = ("code-writer", "deep-research", "mixed")
CODE_TOOLS = {"read_file", "compile", "run_tests"}
RESEARCH_TOOLS = {"web_search", "fetch_page"}


def small(app: str = "code-writer", **kw: object) -> AppGenConfig:
    return AppGenConfig(app=app, **{"num_apps": 12, "seed": 3, **kw})


def kind(s: Session) -> str:
    return s.source.removeprefix("appgen:")


def sys_blocks(cfg: AppGenConfig) -> int:
    return cfg.system_prompt_tokens // cfg.block_size


def test_module_doctest() -> None:
    assert doctest.testmod(kvtier.replay.appgen).failed == 0


@pytest.mark.parametrize("app", APPS)
def test_invariants_and_open_loop(app: str) -> None:
    w = app_workload(AppGenConfig(app=app))
    w.check_invariants()
    assert w.open_loop and w.block_size == 64 and len(w.sessions) == 40
    kinds = {kind(s) for s in w.sessions}
    assert kinds == ({"code-writer", "deep-research"} if app == "mixed" else {app})
    for s in w.sessions:
        for a in s.agents:
            for r in a.requests:  # every full block has an id, no more
                assert len(r.block_ids) == r.input_tokens // w.block_size
                assert r.arrival_s == s.root.requests[0].arrival_s == s.start_s


@pytest.mark.parametrize("app", ("code-writer", "deep-research"))
def test_default_size_is_a_real_load_for_an_8b_model(app: str) -> None:
    d = describe(app_workload(AppGenConfig(app=app)))
    assert d["apps"] == 40 and d["apps_by_kind"] == {app: 40}
    assert 50_000 <= d["mean_prompt_tokens_per_app"] <= 200_000


def test_seeded_determinism_seed_sensitivity_and_app_k_stability() -> None:
    a = app_workload(small("mixed"))
    assert a == app_workload(small("mixed"))
    assert a.sessions != app_workload(small("mixed", seed=4)).sessions
    # App k (shape and arrival) depends on (seed, k), not on how many apps were asked for.
    assert app_workload(small("mixed", num_apps=5)).sessions == a.sessions[:5]


def test_poisson_arrivals_mean_gap_and_dispersion() -> None:
    # Light apps (huge blocks, few calls) so 1000 arrivals build fast; arrivals ignore the shape.
    cfg = AppGenConfig(app="deep-research", num_apps=1000, rate_per_s=2.0, seed=11, block_size=4096,
                       searcher_fanout=(1, 1), searcher_rounds=(1, 1), writer_calls=(1, 1))
    arrivals = [s.root.requests[0].arrival_s for s in app_workload(cfg).sessions]
    gaps = [b - a for a, b in zip([0.0, *arrivals], arrivals)]
    assert all(g > 0 for g in gaps)
    mean = statistics.fmean(gaps)
    assert abs(mean - 0.5) < 0.04  # 1/rate; the standard error is 0.016
    assert 0.9 < statistics.pstdev(gaps) / mean < 1.1  # exponential: coefficient of variation 1
    # The arrivals do not depend on the shape of the apps.
    other = app_workload(replace(cfg, app="code-writer", num_apps=50, block_size=64)).sessions
    assert [s.root.requests[0].arrival_s for s in other] == arrivals[:50]


def test_fanout_within_configured_range_and_covers_it() -> None:
    w = app_workload(AppGenConfig(app="mixed", num_apps=60, seed=5))
    seen: dict[str, set[int]] = {"coder": set(), "searcher": set()}
    for s in w.sessions:
        types = [a.agent_type for a in s.agents]
        if kind(s) == "code-writer":
            assert types[0] == "planner" and types.count("reviewer") == 1
            seen["coder"].add(types.count("coder"))
        else:
            assert types[0] == "lead" and types.count("writer") == 1
            seen["searcher"].add(types.count("searcher"))
    assert seen == {"coder": {2, 3, 4}, "searcher": {3, 4, 5, 6}}
    w = app_workload(small("code-writer", coder_fanout=(5, 5)))
    assert all(sum(a.agent_type == "coder" for a in s.agents) == 5 for s in w.sessions)


@pytest.mark.parametrize("app", ("code-writer", "deep-research"))
def test_subagents_fork_the_parent_context_and_nothing_else(app: str) -> None:
    cfg = small(app)
    w = app_workload(cfg)
    bs = cfg.block_size
    for s in w.sessions:
        for a in s.agents[1:]:
            parent = s.agent(a.parent_id)
            spawner = parent.requests[a.spawn_after]
            fork = (spawner.input_tokens + spawner.output_tokens) // bs  # prompt + output of the spawn call
            first = a.requests[0].block_ids
            assert first[: len(spawner.block_ids)] == spawner.block_ids
            # The parent's next prompt holds the same output blocks: the fork point is shared.
            assert first[:fork] == parent.requests[a.spawn_after + 1].block_ids[:fork]
        for x, y in zip(s.agents[1:], s.agents[2:]):  # siblings share exactly the fork, then diverge
            if x.spawn_after == y.spawn_after:
                sp = s.root.requests[x.spawn_after]
                fork = (sp.input_tokens + sp.output_tokens) // bs
                assert common_prefix_len(x.requests[0].block_ids, y.requests[0].block_ids) == fork


@pytest.mark.parametrize("app", APPS)
def test_every_prompt_extends_the_previous_one(app: str) -> None:
    w = app_workload(small(app))
    for _, a, r in w.iter_requests():
        if r.index:
            prev = a.requests[r.index - 1]
            assert r.block_ids[: len(prev.block_ids)] == prev.block_ids
            assert r.input_tokens >= prev.input_tokens + prev.output_tokens


def test_block_ids_are_shared_only_by_construction() -> None:
    cfg = small("mixed", num_apps=10)
    w = app_workload(cfg)
    n_sys = sys_blocks(cfg)
    blocks = [{b for a in s.agents for r in a.requests for b in r.block_ids} for s in w.sessions]
    heads = {kind(s): s.root.requests[0].block_ids[:n_sys] for s in w.sessions}
    assert len(heads) == 2 and set(heads["code-writer"]).isdisjoint(heads["deep-research"])
    for i, si in enumerate(w.sessions):
        assert si.root.requests[0].block_ids[:n_sys] == heads[kind(si)]  # one system prompt per kind
        for j in range(i + 1, len(w.sessions)):
            shared = blocks[i] & blocks[j]
            sj = w.sessions[j]
            assert shared == (set(heads[kind(si)]) if kind(si) == kind(sj) else set())


@pytest.mark.parametrize("app", ("code-writer", "deep-research"))
def test_joins_depend_on_every_subagent_group(app: str) -> None:
    w = app_workload(small(app))
    workers, closer = ("coder", "reviewer") if app == "code-writer" else ("searcher", "writer")
    for s in w.sessions:
        root = s.root
        group = [a for a in s.agents if a.agent_type == workers]
        (last,) = [a for a in s.agents if a.agent_type == closer]
        j = group[0].join_before
        assert all(a.spawn_after == j - 1 and a.join_before == j for a in group)  # one parallel group
        assert root.requests[j].depends_on == tuple(a.agent_id for a in group)
        assert root.requests[j].gap_cause == "subagent_join" and root.requests[j].gap_s == 0.0
        # The closer is spawned by the joining call and joined by the final one.
        assert (last.spawn_after, last.join_before) == (j, j + 1) == (j, len(root.requests) - 1)
        assert root.requests[-1].depends_on == (last.agent_id,) and root.requests[-1].stop == "end_turn"
        assert sum(bool(r.depends_on) for r in root.requests) == 2


@pytest.mark.parametrize("app", APPS)
def test_tool_calls_stop_with_tool_use_and_gap_the_tool(app: str) -> None:
    w = app_workload(small(app))
    for s, a, r in w.iter_requests():
        if r.index == 0:
            assert (r.gap_cause, r.gap_s, r.depends_on) == ("start", 0.0, ())
        else:
            assert a.requests[r.index - 1].stop == "tool_use"
            assert r.gap_cause == ("subagent_join" if r.depends_on else "tool")
            assert r.gap_s > 0 if r.gap_cause == "tool" else r.gap_s == 0.0
        assert (r.stop == "end_turn") == (r.index == len(a.requests) - 1)


def test_tool_durations_follow_the_configured_distribution() -> None:
    # sigma 0: every tool gap is exactly its tool's median, so each shape calls only its own tools.
    medians = {"read_file": 0.25, "compile": 1.5, "run_tests": 3.5, "web_search": 7.0, "fetch_page": 2.5}
    tools = tuple(ToolSpec(t.name, medians[t.name], 0.0, t.result_tokens) for t in DEFAULT_TOOLS)
    w = app_workload(small("mixed", num_apps=30, tools=tools))
    for s, _, r in w.iter_requests():
        if r.gap_cause == "tool":
            names = CODE_TOOLS if kind(s) == "code-writer" else RESEARCH_TOOLS
            assert r.gap_s in {medians[n] for n in names}
    # Lognormal: with one median for every tool, the sample median lands near it.
    tools = tuple(ToolSpec(t.name, 3.0, 0.8, t.result_tokens) for t in DEFAULT_TOOLS)
    gaps = [r.gap_s for _, _, r in app_workload(small("mixed", num_apps=60, tools=tools)).iter_requests()
            if r.gap_cause == "tool"]
    assert len(gaps) > 500
    assert 2.7 < statistics.median(gaps) < 3.3
    assert 0.7 < statistics.pstdev([math.log(g) for g in gaps]) < 0.9


def test_describe_counts() -> None:
    w = app_workload(small("mixed"))
    d = describe(w)
    tool_gaps = [r.gap_s for _, _, r in w.iter_requests() if r.gap_cause == "tool"]
    assert d["apps"] == 12 and sum(d["apps_by_kind"].values()) == 12
    assert d["agents"] == sum(len(s.agents) for s in w.sessions)
    assert (d["requests"], d["tool_calls"]) == (w.num_requests(), len(tool_gaps))
    assert d["mean_tool_s"] == pytest.approx(statistics.fmean(tool_gaps))
    assert (d["prompt_tokens"], d["distinct_blocks"]) == (w.total_input_tokens(), w.num_distinct_blocks())
    assert describe(Workload("empty", 64, (), True))["mean_tool_s"] is None


def test_replay_serves_every_request_and_starts_apps_at_their_arrival() -> None:
    w = app_workload(small("mixed", num_apps=8, rate_per_s=0.5))
    profile = parse_profile("h100-80gb:llama-3.1-8b")
    spec = ReplaySpec(workload=w, profile=profile, policies=("lru",), hbm_blocks=(2000,))
    row = run_point(spec, "lru", 8, 2000)
    assert row["num_requests"] == w.num_requests()
    assert row["e2e_mean_s"] > 0 and row["hit_rate_hbm"] > 0.3  # multi-turn and forked prefixes hit
    result = Simulator(w, SimConfig(hbm_blocks=2000), make_placement("lru"), profile).run()
    assert len(result.session_latency_s) == len(w.sessions)
    first_ready: dict[int, float] = {}
    for rec in result.records:
        first_ready[rec.session] = min(first_ready.get(rec.session, math.inf), rec.ready_s)
    for k, s in enumerate(w.sessions):  # open loop: app k starts at its arrival (to within one engine step)
        assert s.root.requests[0].arrival_s <= first_ready[k] < s.root.requests[0].arrival_s + 0.1


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("app", "chatbot"),
        ("num_apps", 0),
        ("num_apps", 2.5),
        ("rate_per_s", 0.0),
        ("rate_per_s", math.inf),
        ("seed", -1),
        ("block_size", 0),
        ("mixed_code_writer_fraction", 1.5),
        ("system_prompt_tokens", -1),
        ("task_tokens", 0.0),
        ("output_tokens", math.nan),
        ("token_sigma", -0.1),
        ("coder_fanout", (3, 2)),
        ("searcher_fanout", (0, 4)),
        ("coder_calls", (1, True)),
        ("planner_calls", 2),
        ("coder_tools", (("grep", 1.0),)),
        ("coder_tools", ()),
    ],
)
def test_bad_config_names_the_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=rf"AppGenConfig\.{field}"):
        AppGenConfig(**{field: value})


def test_bad_tool_specs_name_the_tool_and_field() -> None:
    bad = tuple(replace(t, median_s=-1.0) if t.name == "web_search" else t for t in DEFAULT_TOOLS)
    with pytest.raises(ConfigError, match=r"AppGenConfig\.tools\[web_search\]\.median_s"):
        AppGenConfig(tools=bad)
    with pytest.raises(ConfigError, match=r"AppGenConfig\.tools=.*missing tools \['fetch_page'\]"):
        AppGenConfig(tools=DEFAULT_TOOLS[:-1])
