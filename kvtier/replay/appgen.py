"""Synthetic multi-agent *application* workloads in the style of TokenCake.

Owns: a seeded generator of agent applications (a root agent that fans out
to parallel sub-agents, tool calls between LLM calls, joins) arriving as a
Poisson process, built directly as a :class:`~kvtier.replay.model.Workload`,
and :func:`describe`, a one-dictionary summary of any such workload. Must not
simulate, read or write files, or print: it only builds values.

TokenCake (arXiv 2510.18586) evaluates on a "Code-Writer" and a
"Deep-Research" application: agent DAGs whose agents stop for external tool
or function calls, with applications arriving at a Poisson rate. The paper
does not publish the exact graphs or token sizes; the shapes below are
*modelled on its description*, and every size and duration is a knob of
:class:`AppGenConfig`.

* **Code-Writer** -- a ``planner`` root makes 1-2 calls (``read_file``
  between them); its last planning call spawns ``k`` parallel ``coder``
  sub-agents (``coder_fanout``), each a loop of LLM calls and tool calls
  (``read_file`` / ``compile`` / ``run_tests``) ending in a summary. The
  planner's next call joins every coder (``depends_on``) and spawns one
  ``reviewer`` (``read_file`` then ``run_tests`` calls); the planner's final
  call joins the reviewer and ends the application.
* **Deep-Research** -- a ``lead`` root plans and spawns ``k`` ``searcher``
  sub-agents (``searcher_fanout``), each doing 1-2 rounds of ``web_search``
  (slow, heavy tailed) then ``fetch_page`` (large results) before a summary;
  the lead joins them and spawns a ``writer`` (``fetch_page`` between its
  calls, a long report last); the lead's final call joins the writer.

Prompt and block-id rules:

* Every agent's context is append-only: each call's prompt is the previous
  prompt + its output + whatever came back (tool result, sub-agent
  summaries), so multi-turn prefix reuse exists.
* All applications of one kind share that kind's system prompt blocks (the
  same ids); a sub-agent's first prompt is its parent's context at the spawn
  (prompt + output of the spawning call) followed by its own instruction.
* Every other block id is private to one application and unique across the
  workload (application ``k`` draws from ``[(k + 1) << 32, (k + 2) << 32)``).

Arrivals: application ``k`` starts at the ``k``-th point of a Poisson process
of rate ``rate_per_s`` (cumulative exponential gaps). The workload is
``open_loop``: the simulator starts each session at its root's first
``arrival_s`` and paces everything inside it by dependencies and ``gap_s``.
Every request of an application carries the application's arrival as its
``arrival_s`` (a lower bound of its send time; only the root's first is read).

Deterministic for a seed (numpy ``Generator``); the shape of application
``k`` depends only on ``(seed, k)`` and the arrivals only on ``(seed,
rate_per_s)``, never on ``num_apps``.

>>> w = app_workload(AppGenConfig(app="mixed", num_apps=3, seed=1))
>>> w.open_loop, len(w.sessions), w.sessions[0].root.requests[0].arrival_s > 0
(True, 3, True)
>>> w.check_invariants()
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NoReturn

import numpy as np

from ..errors import ConfigError
from .model import ROOT_AGENT_ID, Agent, BlockId, GapCause, Request, Session, Workload

APP_KINDS: tuple[str, ...] = ("code-writer", "deep-research")
"""The application shapes; ``AppGenConfig.app`` may also be ``"mixed"``."""

_SHARED_ID_BITS = 20  # the system prompt of kind t lives in [(t + 1) << 20, (t + 2) << 20)
_PRIVATE_ID_BITS = 32  # the private ids of application k live in [(k + 1) << 32, (k + 2) << 32)
_MAX_APPS = 1 << 30  # keeps every id below 2**63
_REQUIRED_TOOLS = ("read_file", "compile", "run_tests", "web_search", "fetch_page")


def _bad(name: str, value: object, problem: str) -> NoReturn:
    raise ConfigError(f"AppGenConfig.{name}", value, problem)


def _is_real(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _check_int(name: str, value: object, lo: int, hi: int | None) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < lo or (hi is not None and value > hi):
        _bad(name, value, f"must be an int >= {lo}" + (f" and <= {hi}" if hi is not None else ""))


def _check_range(name: str, value: object) -> None:
    ok = (isinstance(value, tuple) and len(value) == 2
          and all(isinstance(v, int) and not isinstance(v, bool) for v in value) and 1 <= value[0] <= value[1])
    if not ok:
        _bad(name, value, "must be a (lo, hi) pair of ints with 1 <= lo <= hi")


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """One external tool: lognormal duration (median, sigma of the log) and result size."""

    name: str
    median_s: float
    sigma: float
    result_tokens: int


DEFAULT_TOOLS: tuple[ToolSpec, ...] = (
    ToolSpec("read_file", 0.3, 0.6, 1500),
    ToolSpec("compile", 2.0, 0.5, 250),
    ToolSpec("run_tests", 4.0, 0.6, 700),
    ToolSpec("web_search", 6.0, 1.0, 800),
    ToolSpec("fetch_page", 2.0, 0.7, 2500),
)


@dataclass(frozen=True, slots=True)
class AppGenConfig:
    """What to generate. Token sizes are medians of lognormals of sigma ``token_sigma``;
    ranges ``(lo, hi)`` are inclusive and drawn uniformly.

    ``system_prompt_tokens``: the per-kind system prompt shared by every
    agent of every application of that kind. ``task_tokens``: the user's task
    given to the root. ``instruction_tokens``: what a parent writes into a
    sub-agent's prompt. ``output_tokens``: one intermediate LLM call's answer;
    ``summary_tokens``: a sub-agent's last answer (returned to its parent);
    ``final_tokens``: the root's final answer and the writer's report.
    ``coder_tools``: ``(tool, weight)`` pairs a coder picks from per call.
    Invalid values raise :class:`~kvtier.errors.ConfigError` naming the field.
    """

    app: str = "code-writer"
    num_apps: int = 40
    rate_per_s: float = 0.5
    seed: int = 0
    block_size: int = 64
    mixed_code_writer_fraction: float = 0.5
    system_prompt_tokens: int = 2500
    task_tokens: float = 600.0
    instruction_tokens: float = 300.0
    output_tokens: float = 300.0
    summary_tokens: float = 600.0
    final_tokens: float = 1200.0
    token_sigma: float = 0.5
    tools: tuple[ToolSpec, ...] = DEFAULT_TOOLS
    coder_tools: tuple[tuple[str, float], ...] = (("read_file", 0.3), ("compile", 0.3), ("run_tests", 0.4))
    planner_calls: tuple[int, int] = (1, 2)
    coder_fanout: tuple[int, int] = (2, 4)
    coder_calls: tuple[int, int] = (3, 6)
    reviewer_calls: tuple[int, int] = (2, 3)
    searcher_fanout: tuple[int, int] = (3, 6)
    searcher_rounds: tuple[int, int] = (1, 2)
    writer_calls: tuple[int, int] = (1, 2)
    _tool_by_name: dict[str, ToolSpec] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.app not in (*APP_KINDS, "mixed"):
            _bad("app", self.app, f"must be one of {[*APP_KINDS, 'mixed']}")
        _check_int("num_apps", self.num_apps, 1, _MAX_APPS)
        if not _is_real(self.rate_per_s) or not math.isfinite(self.rate_per_s) or self.rate_per_s <= 0:
            _bad("rate_per_s", self.rate_per_s, "must be a finite number > 0 (applications per second)")
        _check_int("seed", self.seed, 0, None)
        _check_int("block_size", self.block_size, 1, None)
        if not _is_real(self.mixed_code_writer_fraction) or not 0 <= self.mixed_code_writer_fraction <= 1:
            _bad("mixed_code_writer_fraction", self.mixed_code_writer_fraction, "must be in [0, 1]")
        _check_int("system_prompt_tokens", self.system_prompt_tokens, 0, None)
        for name in ("task_tokens", "instruction_tokens", "output_tokens", "summary_tokens", "final_tokens"):
            value = getattr(self, name)
            if not _is_real(value) or not math.isfinite(value) or value < 1:
                _bad(name, value, "must be a finite number >= 1 (a median token count)")
        if not _is_real(self.token_sigma) or not 0 <= self.token_sigma <= 3:
            _bad("token_sigma", self.token_sigma, "must be in [0, 3]")
        for name in ("planner_calls", "coder_fanout", "coder_calls", "reviewer_calls", "searcher_fanout",
                     "searcher_rounds", "writer_calls"):
            _check_range(name, getattr(self, name))
        object.__setattr__(self, "_tool_by_name", self._check_tools())
        self._check_coder_tools()

    def tool(self, name: str) -> ToolSpec:
        """The :class:`ToolSpec` called ``name`` (validated to exist at construction)."""
        return self._tool_by_name[name]

    def _check_tools(self) -> dict[str, ToolSpec]:
        by_name: dict[str, ToolSpec] = {}
        for t in self.tools:
            if not isinstance(t, ToolSpec):
                _bad("tools", t, "every entry must be a ToolSpec")
            where = f"tools[{t.name}]"
            if t.name in by_name:
                _bad("tools", t.name, "duplicate tool name")
            if not _is_real(t.median_s) or not math.isfinite(t.median_s) or t.median_s <= 0:
                _bad(f"{where}.median_s", t.median_s, "must be a finite number > 0 (seconds)")
            if not _is_real(t.sigma) or not 0 <= t.sigma <= 3:
                _bad(f"{where}.sigma", t.sigma, "must be in [0, 3]")
            _check_int(f"{where}.result_tokens", t.result_tokens, 0, None)
            by_name[t.name] = t
        missing = [n for n in _REQUIRED_TOOLS if n not in by_name]
        if missing:
            _bad("tools", tuple(by_name), f"missing tools {missing}; the shapes call {list(_REQUIRED_TOOLS)}")
        return by_name

    def _check_coder_tools(self) -> None:
        if not self.coder_tools:
            _bad("coder_tools", self.coder_tools, "must name at least one (tool, weight) pair")
        for name, weight in self.coder_tools:
            if name not in self._tool_by_name:
                _bad("coder_tools", name, f"unknown tool; known: {sorted(self._tool_by_name)}")
            if not _is_real(weight) or not math.isfinite(weight) or weight <= 0:
                _bad(f"coder_tools[{name}]", weight, "weight must be a finite number > 0")


DEFAULT_APP_CONFIG = AppGenConfig()


def app_workload(config: AppGenConfig = DEFAULT_APP_CONFIG) -> Workload:
    """The workload ``config`` describes: ``num_apps`` open-loop sessions, one per application.

    O(total block ids). Deterministic for ``config``.
    """
    root = np.random.SeedSequence(config.seed)
    arrivals_seq, apps_seq = root.spawn(2)
    gaps = np.random.default_rng(arrivals_seq).exponential(1.0 / config.rate_per_s, size=config.num_apps)
    arrivals = np.cumsum(gaps).tolist()
    sessions = tuple(
        _build_app(config, np.random.default_rng(ss), k, arrivals[k])
        for k, ss in enumerate(apps_seq.spawn(config.num_apps))
    )
    name = f"appgen-{config.app}-seed{config.seed}-rate{config.rate_per_s:g}"
    return Workload(name, config.block_size, sessions, open_loop=True, declared_dag=True)


def describe(workload: Workload) -> dict[str, Any]:
    """A summary of an application workload: counts, tool calls, token and block totals.

    ``apps_by_kind`` counts sessions by their ``source`` (``appgen:<kind>``);
    ``mean_tool_s`` is the mean ``gap_s`` of requests sent after a tool call
    (``None`` without any). O(total block ids).
    """
    tool_gaps = [r.gap_s for _, _, r in workload.iter_requests() if r.gap_cause == "tool"]
    num_apps = len(workload.sessions)
    prompt_tokens = workload.total_input_tokens()
    arrivals = [s.root.requests[0].arrival_s for s in workload.sessions if s.root.requests]
    return {
        "apps": num_apps,
        "apps_by_kind": dict(sorted(Counter(s.source.removeprefix("appgen:") for s in workload.sessions).items())),
        "agents": sum(len(s.agents) for s in workload.sessions),
        "requests": workload.num_requests(),
        "tool_calls": len(tool_gaps),
        "mean_tool_s": sum(tool_gaps) / len(tool_gaps) if tool_gaps else None,
        "prompt_tokens": prompt_tokens,
        "mean_prompt_tokens_per_app": prompt_tokens / num_apps if num_apps else None,
        "output_tokens": workload.total_output_tokens(),
        "distinct_blocks": workload.num_distinct_blocks(),
        "last_arrival_s": max(arrivals) if arrivals else None,
    }


class _Ids:
    """Fresh private block ids of one application."""

    __slots__ = ("next_id",)

    def __init__(self, k: int) -> None:
        self.next_id = (k + 1) << _PRIVATE_ID_BITS

    def take(self, n: int) -> list[BlockId]:
        first = self.next_id
        self.next_id += max(0, n)
        return [BlockId(i) for i in range(first, self.next_id)]


class _Context:
    """An append-only prompt: token count and the ids of its full blocks."""

    __slots__ = ("block_size", "ids", "source", "tokens")

    def __init__(self, tokens: int, ids: list[BlockId], block_size: int, source: _Ids) -> None:
        self.tokens, self.ids, self.block_size, self.source = tokens, ids, block_size, source

    def append(self, tokens: int) -> None:
        self.tokens += tokens
        self.ids.extend(self.source.take(self.tokens // self.block_size - len(self.ids)))

    def fork(self) -> _Context:
        """A copy sharing every full block so far; the partial tail block diverges."""
        return _Context(self.tokens, list(self.ids), self.block_size, self.source)


@dataclass(slots=True)
class _Draft:
    """An agent being built: its context, its requests so far, and how its next one waits."""

    agent_id: str
    parent_id: str | None
    agent_type: str
    ctx: _Context
    arrival_s: float
    spawn_after: int | None = None
    join_before: int | None = None
    requests: list[Request] = field(default_factory=list)
    next_gap: tuple[float, GapCause] = (0.0, "start")
    next_depends_on: tuple[str, ...] = ()

    def call(self, output_tokens: int, stop: str) -> None:
        """One LLM call on the current context; its answer joins the context."""
        gap_s, cause = self.next_gap
        self.requests.append(Request(
            len(self.requests), self.ctx.tokens, output_tokens, tuple(self.ctx.ids), gap_s, cause, stop,
            self.arrival_s, depends_on=self.next_depends_on,
        ))
        self.ctx.append(output_tokens)
        self.next_gap, self.next_depends_on = (0.0, "start"), ()

    def freeze(self) -> Agent:
        return Agent(self.agent_id, self.parent_id, self.agent_type, tuple(self.requests),
                     spawn_after=self.spawn_after, join_before=self.join_before, status="completed")


class _AppBuilder:
    """Builds the session of application ``k`` from its own random stream."""

    def __init__(self, cfg: AppGenConfig, rng: np.random.Generator, k: int, arrival_s: float) -> None:
        self.cfg, self.rng, self.k, self.arrival_s = cfg, rng, k, arrival_s
        self.ids = _Ids(k)
        self.drafts: list[_Draft] = []
        self.type_counts: Counter[str] = Counter()

    # -- sampling
    def tokens(self, median: float) -> int:
        return max(1, round(median * math.exp(self.cfg.token_sigma * self.rng.standard_normal())))

    def count(self, bounds: tuple[int, int]) -> int:
        return int(self.rng.integers(bounds[0], bounds[1] + 1))

    # -- agent operations
    def root(self, kind: str, agent_type: str) -> _Draft:
        bs, tokens = self.cfg.block_size, self.cfg.system_prompt_tokens
        base = (APP_KINDS.index(kind) + 1) << _SHARED_ID_BITS
        shared = [BlockId(base + i) for i in range(tokens // bs)]
        ctx = _Context(tokens, shared, bs, self.ids)
        ctx.append(self.tokens(self.cfg.task_tokens))
        return self.add(_Draft(ROOT_AGENT_ID, None, agent_type, ctx, self.arrival_s))

    def add(self, draft: _Draft) -> _Draft:
        self.drafts.append(draft)
        return draft

    def llm(self, d: _Draft, stop: str = "tool_use", median_tokens: float | None = None) -> None:
        d.call(self.tokens(self.cfg.output_tokens if median_tokens is None else median_tokens), stop)

    def tool(self, d: _Draft, name: str) -> None:
        """``d``'s last call asked for tool ``name``: its result joins the context after its duration."""
        spec = self.cfg.tool(name)
        duration_s = spec.median_s * math.exp(spec.sigma * self.rng.standard_normal())
        d.ctx.append(self.tokens(spec.result_tokens) if spec.result_tokens else 0)
        d.next_gap = (duration_s, "tool")

    def spawn(self, parent: _Draft, agent_type: str, n: int) -> list[_Draft]:
        """``n`` sub-agents started when ``parent``'s last call finishes, each forking its context."""
        out = []
        for _ in range(n):
            self.type_counts[agent_type] += 1
            ctx = parent.ctx.fork()
            ctx.append(self.tokens(self.cfg.instruction_tokens))
            agent_id = f"{agent_type}-{self.type_counts[agent_type]}"
            child = _Draft(agent_id, parent.agent_id, agent_type, ctx, self.arrival_s,
                           spawn_after=len(parent.requests) - 1)
            out.append(self.add(child))
        return out

    def join(self, parent: _Draft, children: list[_Draft]) -> None:
        """``parent``'s next call waits for ``children``; their last answers join its context."""
        for child in children:
            child.join_before = len(parent.requests)
        parent.ctx.append(sum(c.requests[-1].output_tokens for c in children))
        parent.next_gap, parent.next_depends_on = (0.0, "subagent_join"), tuple(c.agent_id for c in children)

    def worker(self, d: _Draft, tools: list[str], last_tokens: float) -> None:
        """A loop of LLM calls with ``tools[i]`` after call ``i``, then a last answer."""
        for name in tools:
            self.llm(d)
            self.tool(d, name)
        self.llm(d, "end_turn", last_tokens)

    def session(self, kind: str) -> Session:
        agents = tuple(d.freeze() for d in self.drafts)
        return Session(f"{kind}-{self.k:04d}", agents, start_s=self.arrival_s, source=f"appgen:{kind}")


def _code_writer(b: _AppBuilder) -> Session:
    cfg = b.cfg
    planner = b.root("code-writer", "planner")
    for _ in range(b.count(cfg.planner_calls) - 1):
        b.llm(planner)
        b.tool(planner, "read_file")
    b.llm(planner)  # the plan; spawns the coders
    coders = b.spawn(planner, "coder", b.count(cfg.coder_fanout))
    names = [n for n, _ in cfg.coder_tools]
    weights = np.array([w for _, w in cfg.coder_tools], dtype=float)
    for coder in coders:
        picks = b.rng.choice(len(names), size=b.count(cfg.coder_calls) - 1, p=weights / weights.sum())
        b.worker(coder, [names[int(i)] for i in picks], cfg.summary_tokens)
    b.join(planner, coders)
    b.llm(planner)  # merges the coders' work; spawns the reviewer
    (reviewer,) = b.spawn(planner, "reviewer", 1)
    n = b.count(cfg.reviewer_calls) - 1
    b.worker(reviewer, ["read_file" if i == 0 and n > 1 else "run_tests" for i in range(n)], cfg.summary_tokens)
    b.join(planner, [reviewer])
    b.llm(planner, "end_turn", cfg.final_tokens)
    return b.session("code-writer")


def _deep_research(b: _AppBuilder) -> Session:
    cfg = b.cfg
    lead = b.root("deep-research", "lead")
    b.llm(lead)  # the research plan; spawns the searchers
    searchers = b.spawn(lead, "searcher", b.count(cfg.searcher_fanout))
    for s in searchers:
        b.worker(s, ["web_search", "fetch_page"] * b.count(cfg.searcher_rounds), cfg.summary_tokens)
    b.join(lead, searchers)
    b.llm(lead)  # outlines the report; spawns the writer
    (writer,) = b.spawn(lead, "writer", 1)
    b.worker(writer, ["fetch_page"] * (b.count(cfg.writer_calls) - 1), cfg.final_tokens)
    b.join(lead, [writer])
    b.llm(lead, "end_turn", cfg.final_tokens)
    return b.session("deep-research")


_SHAPES: dict[str, Callable[[_AppBuilder], Session]] = {
    "code-writer": _code_writer,
    "deep-research": _deep_research,
}


def _build_app(cfg: AppGenConfig, rng: np.random.Generator, k: int, arrival_s: float) -> Session:
    kind = cfg.app
    if kind == "mixed":
        kind = "code-writer" if rng.random() < cfg.mixed_code_writer_fraction else "deep-research"
    return _SHAPES[kind](_AppBuilder(cfg, rng, k, arrival_s))
