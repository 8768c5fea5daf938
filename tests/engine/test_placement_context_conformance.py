"""One conformance suite for both :class:`~kvtier.placement.PlacementContext` implementations.

Each test runs against the replay :class:`~kvtier.replay.sim.Simulator` (never ``run``; on its
default ``full`` surface and on the one the live connector claims) and the live connector's
``EnginePlacement`` on vLLM's real ``BlockPool``. Computed blocks are cached as each host caches
them (live: vLLM's pool, then ``waiting_starts`` gives the connector their hashes); time moves as
each host moves it (a sim event-loop pass; live, a scheduler step's ``scheduled`` and ``tick``).
HBM 16 blocks, DRAM 16, no SSD; pin budgets half of HBM. Answers that differ on purpose are
pinned per context in the ``test_by_design_*`` tests, so that a change to either is seen.
"""

from __future__ import annotations

import itertools
from collections import Counter
from types import SimpleNamespace
from typing import Sequence

import pytest
from kvtier_vllm.placement import SURFACE, EnginePlacement

from kvtier.agents import AgentGraph
from kvtier.keys import BlockKey
from kvtier.manager import TierManager, TierSpec
from kvtier.placement import make_placement
from kvtier.replay.model import Workload
from kvtier.replay.profiles import get_profile
from kvtier.replay.sim import SimConfig, Simulator

pytestmark = pytest.mark.vllm_interface  # no engine: also run against newer vLLMs (scripts/vllm_next.sh)

# (the conftest leaves out only test_vllm_*.py where vLLM is missing: the main venv skips this module)
BlockPool = pytest.importorskip("vllm.v1.core.block_pool").BlockPool

BS, HBM, DRAM = 16, 16, 16
PROFILE = get_profile("h100-80gb", "llama-3.1-8b")
_ids = itertools.count(1)


def _keys(n: int) -> list[BlockKey]:
    return [BlockKey(next(_ids)) for _ in range(n)]


def _store(mgr: TierManager, tier: str, keys: Sequence[BlockKey]) -> None:
    mgr.complete_store(mgr.prepare_store(tier, keys), True)


class _Sim:
    kind = "sim"  # the replay's context: a Simulator over an empty workload, never run

    def __init__(self, surface: str) -> None:
        cfg = SimConfig(hbm_blocks=HBM, dram_blocks=DRAM, surface=surface, scheduler="plain")
        self.surface = surface
        self.sim = Simulator(Workload("conformance", BS, (), False), cfg, make_placement("lru-dram"), PROFILE)
        self.ctx, self.mgr = self.sim.ctx, self.sim.mgr
        self.session = 0

    def agent(self, agent_id: str) -> tuple[int, str]:
        return (self.session, agent_id)

    def cache(self, keys: Sequence[BlockKey], dram: bool = False) -> None:
        """A request computed ``keys``: cached in HBM (and written through to DRAM)."""
        _store(self.mgr, "hbm", keys)
        if dram:
            _store(self.mgr, "dram", keys)

    def evict_hbm(self, n: int) -> None:
        self.mgr.evict("hbm", n)

    def advance(self, dt: float) -> None:
        self.sim.now += dt
        self.sim.advance()  # one engine pass: the events due (timers, lapsed pins, landed moves)

    def announce(self, now: float) -> None:
        """The hint plane learns session 0: a root agent and its sub-agent."""
        self.sim.graph.start_session("replay", str(self.session), now)
        self.sim.graph.spawn_agent("replay", str(self.session), "root", now)
        self.sim.graph.spawn_agent("replay", str(self.session), "sub", now, parent_id="root")


class _Live:
    kind = "live"  # the connector's context as its scheduler builds it, on vLLM's block pool

    def __init__(self) -> None:
        self.clock = 1000.0
        self.mgr = TierManager([TierSpec("dram", DRAM)])
        self.ctx = EnginePlacement(self.mgr, BS, PROFILE.kv_bytes_per_block(BS), Counter(), clock=lambda: self.clock)
        self.pool = BlockPool(HBM + 1, True, BS)  # one is vLLM's null block
        self.ctx.bind_block_pool(self.pool)
        self.session = "s0"
        self._requests = itertools.count()

    def agent(self, agent_id: str) -> tuple[str, str]:
        return (self.session, agent_id)

    def cache(self, keys: Sequence[BlockKey], dram: bool = False) -> None:
        """A request computed ``keys``: vLLM caches and frees its blocks; its end tells the
        connector the keys' block hashes (``waiting_starts``, as the scheduler does)."""
        hashes = [int(k).to_bytes(8, "big") for k in keys]
        blocks = self.pool.get_new_blocks(len(keys))
        self.pool.cache_full_blocks(SimpleNamespace(block_hashes=hashes), blocks, 0, len(keys), BS, 0)
        self.pool.free_blocks(reversed(blocks))
        self.ctx.waiting_starts(("cache", str(next(self._requests))), keys, hashes, 0)
        if dram:
            _store(self.mgr, "dram", keys)

    def evict_hbm(self, n: int) -> None:
        """Other requests take ``n`` free blocks (vLLM evicts from its free queue's head)."""
        self.pool.free_blocks(self.pool.get_new_blocks(min(n, self.pool.get_num_free_blocks())))

    def advance(self, dt: float) -> None:
        self.clock += dt
        self.ctx.scheduled({})  # a scheduler step: holds let go of are given back
        self.ctx.tick()  # timers due, holds expired

    def announce(self, now: float) -> None:
        """The hosted hint server learns the session; the scheduler reads it as ``_read_hosted`` does."""
        graph = AgentGraph()
        graph.start_session("t", self.session, now)
        graph.spawn_agent("t", self.session, "root", now)
        graph.spawn_agent("t", self.session, "sub", now, parent_id="root")

        def facts(agent: tuple[str, str]) -> tuple[float, str | None] | None:
            s = graph.session("t", agent[0])
            if s is None or agent[1] not in s.agents:
                return None
            return graph.criticalities("t", agent[0], now).get(agent[1], 0.0), s.agents[agent[1]].parent_id

        self.ctx.graph_reader = facts


@pytest.fixture(params=["sim-full", f"sim-{SURFACE.name}", "live"])
def host(request: pytest.FixtureRequest) -> _Sim | _Live:
    return _Live() if request.param == "live" else _Sim(request.param.removeprefix("sim-"))


def flood(host: _Sim | _Live) -> None:
    host.evict_hbm(HBM)  # HBM is needed whole: everything evictable goes


def test_a_fresh_context_reports_an_idle_engine_and_knows_no_agent(host) -> None:
    ctx = host.ctx
    assert isinstance(ctx.now, float)
    assert (ctx.block_size, ctx.hbm_capacity_blocks) == (BS, HBM)
    assert (ctx.running_blocks(), ctx.hbm_pressure(), ctx.waiting_demand_blocks()) == (0, 0.0, 0)
    assert list(ctx.tool_history_s()) == []
    assert ctx.tiers_enabled() == ("hbm", "dram")
    assert (ctx.is_waiting(host.agent("nobody")), ctx.parent_of(host.agent("nobody"))) == (False, None)


def test_the_hint_plane_gives_parents_and_criticality(host) -> None:
    host.announce(host.ctx.now)
    ctx = host.ctx
    assert (ctx.parent_of(host.agent("sub")), ctx.parent_of(host.agent("root"))) == ("root", None)
    assert ctx.criticality(host.agent("root")) == 1.0  # on the critical path
    assert 0.0 <= ctx.criticality(host.agent("sub")) <= 1.0


def test_blocks_in_counts_what_each_tier_holds(host) -> None:
    a, b = _keys(4), _keys(3)
    host.cache(a, dram=True)
    host.cache(b)
    ctx = host.ctx
    assert [ctx.blocks_in(a, t) for t in ("hbm", "dram", "ssd")] == [4, 4, 0]
    assert [ctx.blocks_in(b, t) for t in ("hbm", "dram", "ssd")] == [3, 0, 0]
    assert ctx.blocks_in(_keys(2), "hbm") == 0


def test_pinned_blocks_survive_eviction_until_unpinned(host) -> None:
    a = _keys(4)
    host.cache(a)
    assert host.ctx.pin(a, 60.0) is True
    assert host.ctx.hbm_pressure() == pytest.approx(4 / HBM)  # pinned blocks are in use
    flood(host)
    assert host.ctx.blocks_in(a, "hbm") == 4
    host.ctx.unpin(a)
    host.advance(0.0)
    flood(host)
    assert host.ctx.blocks_in(a, "hbm") == 0


def test_a_pin_lapses_at_its_ttl(host) -> None:
    a = _keys(4)
    host.cache(a)
    assert host.ctx.pin(a, 5.0) is True
    host.advance(4.0)
    flood(host)
    assert host.ctx.blocks_in(a, "hbm") == 4
    host.advance(2.0)
    flood(host)
    assert host.ctx.blocks_in(a, "hbm") == 0


def test_pin_refuses_what_it_cannot_hold(host) -> None:
    ctx = host.ctx
    cached, big = _keys(4), _keys(10)  # 10 blocks: over the budget (half of 16)
    host.cache(cached)
    host.cache(big)
    assert (ctx.pin([], 10.0), ctx.pin(_keys(3), 10.0), ctx.pin(cached, 0.0)) == (False, False, False)
    assert ctx.pin(big, 10.0) is False
    flood(host)
    assert ctx.blocks_in(big, "hbm") == ctx.blocks_in(cached, "hbm") == 0


@pytest.mark.parametrize("touched", [True, False])
def test_touch_makes_blocks_most_recent(host, touched: bool) -> None:
    a, b, c = _keys(4), _keys(4), _keys(8)  # cached in this order: HBM is full, ``a`` the oldest
    for keys in (a, b, c):
        host.cache(keys)
    if touched:
        host.ctx.touch(a)
    host.evict_hbm(4)
    assert (host.ctx.blocks_in(a, "hbm"), host.ctx.blocks_in(b, "hbm")) == ((4, 0) if touched else (0, 4))


def test_offload_counts_blocks_the_lower_tier_holds_once_moves_land(host) -> None:
    ctx = host.ctx
    copied, hbm_only = _keys(4), _keys(3)
    host.cache(copied, dram=True)
    host.cache(hbm_only)
    assert ctx.offload(copied, "dram") == 4  # written through: the DRAM copies count
    n = ctx.offload(hbm_only, "dram")
    assert 0 <= n <= 3
    host.advance(1.0)
    # the full surface moves HBM-only blocks down; the live connector (and the surface it claims) cannot
    # copy a block out of vLLM's HBM on request: only what was written through is there
    moved = 3 if getattr(host, "surface", None) == "full" else 0
    assert ctx.blocks_in(copied, "dram") == 4 and ctx.blocks_in(hbm_only, "dram") == moved
    assert ctx.offload(copied, "ssd") == ctx.offload(_keys(2), "dram") == 0  # no such tier; nothing cached


def test_discard_counts_the_hbm_copies_it_freed(host) -> None:
    a = _keys(4)
    host.cache(a)
    n = host.ctx.discard(a)
    assert 0 <= n <= 4 and host.ctx.blocks_in(a, "hbm") == 4 - n
    assert n == (4 if getattr(host, "surface", None) == "full" else 0)  # 0 live and on vLLM's surfaces


def test_drop_empties_the_lower_tiers_and_counts_every_copy(host) -> None:
    ctx, a = host.ctx, _keys(4)
    host.cache(a, dram=True)
    before = {t: ctx.blocks_in(a, t) for t in ctx.tiers_enabled()}
    n = ctx.drop(a)
    after = {t: ctx.blocks_in(a, t) for t in ctx.tiers_enabled()}
    assert after["dram"] == 0 and n == sum(before.values()) - sum(after.values()) >= 4
    assert ctx.drop(a) == 0


@pytest.mark.parametrize("verb", ["deprioritize", "retire"])
def test_deprioritized_and_retired_copies_are_the_next_victims_below(host, verb: str) -> None:
    old, mine, rest = _keys(4), _keys(4), _keys(8)  # DRAM full, ``old`` least recent
    for keys in (old, mine, rest):
        _store(host.mgr, "dram", keys)
    n = host.ctx.deprioritize(mine, ("dram",)) if verb == "deprioritize" else host.ctx.retire(mine)
    assert n == 4
    _store(host.mgr, "dram", _keys(4))  # DRAM must make room for 4
    assert (host.ctx.blocks_in(mine, "dram"), host.ctx.blocks_in(old, "dram")) == (0, 4)


def test_private_start_is_where_a_chain_leaves_a_shared_prefix(host) -> None:
    shared, x, y, lone = _keys(2), _keys(2), _keys(2), _keys(3)
    for keys in (shared + x, shared + y, lone):
        host.cache(keys, dram=True)
    assert (host.ctx.private_start(shared + x), host.ctx.private_start(lone)) == (2, 0)


@pytest.mark.parametrize("link", ["hbm->dram", "dram->hbm"])
def test_transfer_time_is_non_negative_and_grows_with_blocks(host, link: str) -> None:
    times = [host.ctx.transfer_time_s(n, link) for n in (0, 1, 2, 8, 64, 4096)]
    assert times[0] >= 0.0 and times == sorted(times) and times[-1] > times[1]


def test_recompute_time_is_non_negative_and_grows_with_tokens(host) -> None:
    times = [host.ctx.recompute_time_s(n) for n in (0, 1, BS, 1024, 32768)]
    assert times[0] >= 0.0 and times == sorted(times) and times[-1] > times[2]


def test_load_wait_is_non_negative_and_finite(host) -> None:
    wait = host.ctx.load_wait_s()
    assert 0.0 <= wait < float("inf")


@pytest.mark.parametrize("link", ["dram->hbm", "ssd->hbm"])
def test_a_fresh_context_has_no_copy_queued_and_no_prefill_ahead(host, link: str) -> None:
    assert host.ctx.queued_transfer_s(link) == 0.0
    assert host.ctx.prefill_ahead_s() == 0.0


def test_call_at_runs_the_callback_once_when_due(host) -> None:
    fired: list[str] = []
    host.ctx.call_at(host.ctx.now + 5.0, fired.append, "due")
    host.advance(4.0)
    assert fired == []
    host.advance(2.0)
    host.ctx.call_at(host.ctx.now - 1.0, fired.append, "past")  # a time gone by: at the next pass
    host.advance(0.0)
    host.advance(10.0)
    assert fired == ["due", "past"]


def test_count_adds_to_the_counters_and_stage_promotes_nothing_at_once(host) -> None:
    host.ctx.count("conformance_x")
    host.ctx.count("conformance_x", 2)
    assert host.ctx.counters["conformance_x"] == 3
    a = _keys(3)
    host.cache(a, dram=True)
    assert host.ctx.stage(a) == 0


# ------------------------------------------------------------ differences by design


def test_by_design_an_unknown_agents_criticality(host) -> None:
    """Replay: 0.0 (the hint plane's DAG has no such agent). Live: 1.0 (an agent nobody said
    more about is taken as its own critical path)."""
    assert host.ctx.criticality(host.agent("nobody")) == {"sim": 0.0, "live": 1.0}[host.kind]


def test_by_design_remaining_path_s(host) -> None:
    """Replay: the session's critical path from the hint plane (> 0 while agents remain).
    Live: always 0.0 (not wired; no policy reads it)."""
    host.announce(host.ctx.now)
    got = host.ctx.remaining_path_s(host.session)
    assert (got > 0.0) if host.kind == "sim" else got == 0.0


def test_by_design_running_blocks_and_holds(host) -> None:
    """Replay: blocks of running requests only (pins apart). Live: vLLM's KV usage, which
    counts the blocks a hold references."""
    a = _keys(4)
    host.cache(a)
    assert host.ctx.pin(a, 60.0)
    assert host.ctx.running_blocks() == {"sim": 0, "live": 4}[host.kind]
