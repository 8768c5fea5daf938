"""Live placement in the connector's scheduler half, on vLLM's real ``BlockPool``.

A stand-in for vLLM's scheduler (``_Engine``) allocates, caches and frees
blocks through the pool's public calls exactly as vLLM does around the
connector's hooks, with a clock the test moves. Shown here:

* HBM holds stay within their budget and every block reference they take is
  given back (the pool's free count comes back to where it started);
* an agent resumed inside its predicted wait finds its context in HBM,
  which other traffic flushed otherwise;
* an SSD -> DRAM prefetch the worker finishes after the agent's request
  arrived is counted late (and one finished first, on time).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from kvtier_vllm.metadata import KVTierWorkerMetadata
from kvtier_vllm.scheduler import KVTierScheduler
from kvtier_vllm.settings import ConnectorSettings, EngineFacts
from vllm.v1.core.block_pool import BlockPool

from kvtier.keys import BlockKey
from kvtier.sdk import tag_request
from kvtier.sdk.params import tenant_session

pytestmark = pytest.mark.vllm_interface  # no engine: also run against newer vLLMs (scripts/vllm_next.sh)

BS = 32


class _Request:
    def __init__(self, req_id: str, hashes: list[bytes], params: dict | None) -> None:
        self.request_id = req_id
        self.block_hashes = hashes
        self.num_tokens = len(hashes) * BS + 5  # a partial last block: its tokens are never offered
        self.num_computed_tokens = 0
        self.kv_transfer_params = params
        self.lora_request = None


class _Engine:
    """vLLM's side of the hooks around a real block pool (one KV cache group)."""

    def __init__(self, num_gpu_blocks: int, _settings: ConnectorSettings | None = None, **extra) -> None:
        facts = EngineFacts("tiny", "bfloat16", BS, 2, 2, 32, "fused", "sha256")
        settings = _settings or ConnectorSettings.build({"dram_capacity_blocks": 8, "exclusive_dram": False, **extra},
                                                        facts, env={})
        ns = settings.config.namespace.to_namespace(settings.config.layout.to_layout())
        self.sched = KVTierScheduler(settings, ns, BS, 1)
        self.block_ids: dict[str, list[int]] = {}
        self.sched.bind_kv_cache_manager(SimpleNamespace(get_block_ids=lambda r: (self.block_ids[r],)))
        self.pool = BlockPool(num_gpu_blocks, True, BS)
        self.sched.bind_gpu_block_pool(self.pool)
        self.now = 1000.0
        self.sched.placement.clock = lambda: self.now

    def step(self, scheduled: dict[str, int] | None = None):
        meta = self.sched.build_connector_meta(SimpleNamespace(num_scheduled_tokens=scheduled or {},
                                                               preempted_req_ids=set()))
        plans = {w.plan_id: (1, [True] * len(w.rows)) for job in meta.stores for w in job.writes}
        self.sched.update_connector_output(KVTierWorkerMetadata(plans, {job.job_id: 1 for job in meta.stores}))
        return meta

    def serve(self, req_id: str, hashes: list[bytes], params: dict | None = None) -> int:
        """Arrive, allocate (prefix hit first), run, cache, finish, free. Returns HBM-hit blocks."""
        req = _Request(req_id, hashes, params)
        self.sched.on_new_request(req)
        hit = []
        for h in hashes:
            got = self.pool.get_cached_block(h, [0])
            if not got:
                break
            hit.append(got[0])
        self.pool.touch(hit)
        blocks = hit + self.pool.get_new_blocks(len(hashes) + 1 - len(hit))
        self.block_ids[req_id] = [b.block_id for b in blocks]
        self.step({req_id: req.num_tokens})
        self.pool.cache_full_blocks(req, blocks, len(hit), len(hashes), BS, 0)
        self.sched.request_finished(req)
        self.pool.free_blocks(reversed(blocks))
        return len(hit)


def _ctx(agent: int, n: int) -> list[bytes]:
    return [bytes([agent, i]) * 16 for i in range(n)]


def _tag(agent: int, wait_s: float | None = 30.0, **kw) -> dict:
    return tag_request({}, "s", f"agent-{agent}", wait_s, **kw)["kv_transfer_params"]


def test_no_wait_starts_for_an_agent_with_another_request_in_the_engine() -> None:
    """Two requests of one agent at once (parallel calls): the first to finish starts no wait (its agent is
    still running, and a hold would keep a running agent's blocks); the second, the last, does."""
    eng = _Engine(101, placement="ttl")
    other = _Request("a-2", _ctx(1, 6), _tag(1, 30.0))
    eng.sched.on_new_request(other)
    eng.serve("a-1", _ctx(1, 4), _tag(1, 30.0))
    c = eng.sched.counters
    assert (c["waits_not_started_busy"], c["tool_waits"]) == (1, 0)
    assert eng.sched.placement.holds.held_blocks == 0
    eng.sched.request_finished(other)
    assert c["tool_waits"] == 1


def test_holds_stay_within_their_budget_and_return_every_block() -> None:
    eng = _Engine(41, placement="ttl", hbm_hold_budget_fraction=0.25)  # 40 usable: at most 10 held
    holds = eng.sched.placement.holds
    assert holds is not None and holds.budget_blocks == 10
    free_at_start = eng.pool.get_num_free_blocks()
    for a in range(5):  # five agents of 4 blocks start tool waits: two fit the budget
        eng.serve(f"a{a}-1", _ctx(a, 4), _tag(a))
        assert holds.held_blocks <= holds.budget_blocks
        assert eng.pool.get_num_free_blocks() == free_at_start - holds.held_blocks
    assert holds.held_blocks == 8 and eng.sched.counters["hbm_hold_refused"] == 3
    assert eng.serve("a0-2", _ctx(0, 6), _tag(0, None)) == 4  # back within its wait: all 4 held blocks hit
    eng.step()  # its hold was given back once the new request was allocated
    assert holds.held_blocks == 4
    eng.now += 60.0  # agent 1 never comes back: its hold lapses at its TTL (ttl's prior, 10 s)
    eng.step()
    assert holds.held_blocks == 0 and eng.sched.counters["hbm_hold_expired_blocks"] == 4
    assert eng.pool.get_num_free_blocks() == free_at_start
    eng.serve("a2-2", _ctx(2, 5), _tag(2))  # a new hold, then a reset: nothing may stay referenced
    assert holds.held_blocks == 5
    eng.sched.reset()
    assert holds.held_blocks == 0 and eng.pool.get_num_free_blocks() == free_at_start


@pytest.mark.parametrize("hold", [True, False])
def test_an_agent_resumed_inside_its_predicted_wait_hits_hbm(hold: bool) -> None:
    eng = _Engine(101, placement="kvtier", hbm_hold=hold)  # the critical reserve: 5% of 100 blocks
    eng.serve("a-1", _ctx(1, 4), _tag(1, 30.0))
    # a critical agent, a long wait, low pressure: the policy keeps it (refused with holds off)
    assert eng.sched.counters["decision_reserve"] == (1 if hold else 0)
    assert eng.sched.counters["hbm_hold_disabled"] == (0 if hold else 1)
    eng.serve("other", _ctx(9, eng.pool.get_num_free_blocks() - 1))  # untagged traffic takes every free block
    eng.now += 5.0  # well inside the predicted 30 s
    hits = eng.serve("a-2", _ctx(1, 6), _tag(1, None))
    assert hits == (4 if hold else 0)
    eng.step()
    assert eng.sched.placement.holds.held_blocks == 0


def _ssd_only_agent(tmp_path: Path) -> tuple[_Engine, list[bytes]]:
    """A non-critical agent whose context is on SSD only, starting a 1 s tool wait."""
    eng = _Engine(101, placement="kvtier", ssd_path=str(tmp_path / "ssd"), ssd_capacity_blocks=64)
    ctx = _ctx(1, 4)
    eng.serve("a-1", ctx, _tag(1, 1.0, criticality=0.2))
    eng.sched.manager.evict("dram", 8)
    assert eng.sched.counters["decision_low_pressure"] == 1
    return eng, ctx


def _fire_prefetch(eng: _Engine):
    eng.now += 1.0  # the prefetch is due just before the predicted return
    (job,) = eng.step().promotions
    assert len(job.keys) == 4
    return job


def _report(eng: _Engine, job) -> None:
    eng.sched.update_connector_output(KVTierWorkerMetadata({job.plan_id: (1, [True] * len(job.keys))}, {}))


def test_a_prefetch_that_lands_after_its_request_arrived_is_late(tmp_path: Path) -> None:
    eng, ctx = _ssd_only_agent(tmp_path)
    job = _fire_prefetch(eng)
    eng.sched.on_new_request(_Request("a-2", ctx + _ctx(2, 1), _tag(1, None)))  # back before the worker reported
    assert eng.sched.counters["prefetch_late"] == 0  # counted once the promotion reports
    _report(eng, job)
    c = eng.sched.counters
    assert (c["prefetches"], c["prefetch_late"], c["prefetch_on_time"]) == (1, 1, 0)
    assert eng.sched.manager.ready_blocks("dram") == 4  # late, but in DRAM now


def test_a_prefetch_whose_ssd_reads_fail_is_counted_and_leaves_nothing_in_dram(tmp_path: Path) -> None:
    """The worker reports 3 of the prefetch's 4 SSD -> DRAM copies failed (a read that did not
    verify): ``promote_failed_blocks`` counts them, only the one that landed is in DRAM, and the
    failed SSD copies are offered no more (as after a failed load): the agent's next request finds
    the one block in DRAM and recomputes the rest, rather than read a block that already failed."""
    eng, ctx = _ssd_only_agent(tmp_path)
    job = _fire_prefetch(eng)
    ssd_before = eng.sched.manager.ready_blocks("ssd")
    eng.sched.update_connector_output(KVTierWorkerMetadata({job.plan_id: (1, [True, False, False, False])}, {}))
    m = eng.sched.manager
    assert eng.sched.counters["promote_failed_blocks"] == 3
    assert m.ready_blocks("dram") == 1 and m.ready_blocks("ssd") == ssd_before - 3
    failed = [BlockKey(k) for k in job.keys[1:]]
    assert not any(m.contains(k, "ssd") for k in failed)
    assert m.lookup([BlockKey(k) for k in job.keys]).num_blocks == 1


def test_a_prefetch_that_lands_first_is_on_time(tmp_path: Path) -> None:
    eng, ctx = _ssd_only_agent(tmp_path)
    _report(eng, _fire_prefetch(eng))
    eng.sched.on_new_request(_Request("a-2", ctx + _ctx(2, 1), _tag(1, None)))
    c = eng.sched.counters
    assert (c["prefetches"], c["prefetch_late"], c["prefetch_on_time"]) == (1, 0, 1)


def test_a_prefetch_is_cancelled_when_the_tool_returns_before_it_starts(tmp_path: Path) -> None:
    """The early request cancels the timed prefetch; still queued after the next
    scheduling pass, it has its SSD blocks staged into DRAM instead."""
    eng, ctx = _ssd_only_agent(tmp_path)
    eng.now += 0.2
    eng.sched.on_new_request(_Request("a-2", ctx + _ctx(2, 1), _tag(1, None)))
    eng.now += 1.0
    (job,) = eng.step().promotions
    assert len(job.keys) == 4
    c = eng.sched.counters
    assert (c["prefetch_cancelled"], c["prefetches"], c["staged_blocks"]) == (1, 0, 4)
    _report(eng, job)
    assert eng.sched.manager.ready_blocks("dram") == 4
    assert eng.step().promotions == []  # once


def _step_until(eng: _Engine, counter: str, timeout_s: float = 10.0) -> None:
    """Scheduler steps until ``counter`` moves (hints arrive on another thread)."""
    import time

    deadline = time.monotonic() + timeout_s
    while eng.sched.counters[counter] == 0 and time.monotonic() < deadline:
        eng.step()
        time.sleep(0.02)


def test_a_tool_call_announced_to_the_hosted_hint_server_starts_the_wait() -> None:
    """``hint_server`` in the extra config: the scheduler process serves the hint
    plane; a tool call the agent framework announces there starts that agent's
    wait (its requests carry only the session and agent ids), and the DAG says
    it is critical: the policy holds its HBM blocks. The request's end starts a
    ``turn_end`` wait first (the call is announced only after the response), which
    the announced call re-times: one hold, not two."""
    from kvtier.sdk import HintClient

    eng = _Engine(101, placement="kvtier", hint_server="127.0.0.1:0")
    sched = eng.sched
    try:
        assert sched.hint_address and sched.hint_address.startswith("127.0.0.1:")
        client = HintClient(sched.hint_address)
        with client.session("s"), client.agent("coder") as agent:
            eng.serve("r1", _ctx(1, 4), agent.tag({})["kv_transfer_params"])
            eng.step()
            c = sched.counters
            assert (c["user_waits"], c["tool_waits"]) == (1, 0)  # no tool call yet: the turn ended
            assert sched.placement.is_waiting(("s", agent.agent_id))
            assert not sched.placement.is_waiting(("s", agent.agent_id), tool=True)
            with client.tool_call("bash", expected_s=20.0):
                _step_until(eng, "tool_waits")  # each step polls the hint server (at most every 50 ms)
                for _ in range(3):
                    eng.step()
                assert (c["user_waits"], c["tool_waits"], c["waits_retimed"]) == (1, 1, 1)
                assert sched.placement.is_waiting(("s", agent.agent_id), tool=True)
                assert sched.placement.holds.held_blocks == 4
        # the session ended: the policy retires its context in kvtier's DRAM tier (next victims there)
        _step_until(eng, "sessions_ended")
        assert sched.counters["retired_blocks"] == 4
        client.close()
    finally:
        sched.shutdown()
    assert sched.hints.hosted is None and sched.placement.holds.held_blocks == 0


def test_an_agent_that_ends_in_its_turns_end_wait_gives_its_reserve_back() -> None:
    """With a hint server, an agent's last turn starts a ``turn_end`` wait that the policy may reserve HBM
    for (as without one); the agent's end, reported later, ends the hold and returns the reserve's share
    of the budget (which a finished agent would otherwise keep until its session ended)."""
    from kvtier.sdk import HintClient

    eng = _Engine(101, placement="kvtier", hint_server="127.0.0.1:0")
    sched = eng.sched
    client = HintClient(sched.hint_address)
    try:
        with client.session("s"):
            with client.agent("coder") as agent:
                eng.serve("r1", _ctx(1, 4), agent.tag({})["kv_transfer_params"])
                eng.step()
                assert sched.counters["user_waits"] == 1 and sched.placement.holds.held_blocks == 4
                assert set(sched.policy._reserved) == {("s", agent.agent_id)}
            _step_until(eng, "agents_ended")
            eng.step()
            assert sched.policy._reserved == {} and sched.placement.holds.held_blocks == 0
    finally:
        client.close()
        sched.shutdown()


@pytest.mark.parametrize("stamped", [False, True])
def test_a_separate_hint_server_is_followed_with_hint_watch(stamped: bool) -> None:
    """``hint_watch``: the hint server runs elsewhere (``kvtier serve`` beside several
    engines); the connector follows its agents over gRPC (``HintService.Watch``)
    and acts on an announced tool call as with a hosted one, also where a gateway
    stamps the requests' tenant (the followed view is one tenant's: matched by id)."""
    from kvtier.hints.server import BackgroundHintServer
    from kvtier.sdk import HintClient

    server = BackgroundHintServer()
    address = server.start("127.0.0.1:0")
    eng = _Engine(101, placement="kvtier", hint_watch=address)
    sched = eng.sched
    client = HintClient(address)  # (the followed view is the watcher's tenant's: the SDK client's here)
    try:
        with client.session("s"), client.agent("coder") as agent:
            stamp = {"kvtier_tenant": "acme"} if stamped else {}
            eng.serve("r1", _ctx(1, 4), {**agent.tag({})["kv_transfer_params"], **stamp})
            with client.tool_call("bash", expected_s=20.0):
                _step_until(eng, "tool_waits")
                assert sched.placement.holds.held_blocks == 4
        _step_until(eng, "sessions_ended")
        assert sched.counters["retired_blocks"] == 4
    finally:
        client.close()
        sched.shutdown()
        server.stop()
    assert sched.placement.holds.held_blocks == 0


@pytest.mark.parametrize("policy", [None, "lru"])
def test_host_tiers_evict_by_predicted_next_use(policy: str | None) -> None:
    """kvtier orders the connector's DRAM by predicted next use, fed by the tool-wait
    hints: an agent that just started a 5-minute tool call goes before one that has
    waited 10 s on a 1-second one; plain LRU (the tiers' policy set) does the reverse."""
    eng = _Engine(101, placement="kvtier", hbm_hold=False, **({"policy": policy} if policy else {}))
    dram = eng.sched.manager._tier("dram")
    eng.serve("a-1", _ctx(1, 4), _tag(1, 1.0))
    quick = set(dram.slots)
    eng.now += 10.0
    eng.serve("b-1", _ctx(2, 4), _tag(2, 300.0))
    slow = set(dram.slots) - quick
    assert len(quick) == len(slow) == 4
    eng.serve("other", _ctx(3, 4))  # untagged traffic needs 4 of the 8 DRAM blocks
    kept = set(dram.slots)
    assert kept >= (quick if policy is None else slow) and not kept & (slow if policy is None else quick)
    eng.sched.manager.check_invariants()


@pytest.mark.parametrize("hinted", [True, False])
def test_exclusive_dram_puts_hbm_in_next_use_order(hinted: bool) -> None:
    """With ``exclusive_dram`` the idle HBM blocks of waiting agents go to the tail of
    vLLM's free queue in kvtier's next-use order (``touch`` / ``free_blocks``), once vLLM
    has freed them: vLLM's own LRU reuse then takes the agent due furthest first. Three
    agents run in order and start tool waits of 1, 9 and 5 s: untagged traffic that needs
    all but one context's blocks leaves the one due first (the oldest, LRU's first victim).
    Without hints every agent waits on its user and the order stays LRU's."""
    eng = _Engine(16, placement="kvtier", exclusive_dram=True, hbm_hold=False)  # 15 usable: three 5-block requests
    waits = (1.0, 9.0, 5.0)
    for a, w in enumerate(waits):
        eng.serve(f"a{a}", _ctx(a, 4), _tag(a, w if hinted else None))
    eng.step()  # vLLM's next step: the last agent's blocks are freed by now
    assert eng.sched.counters["hbm_ordered_blocks"] > 0 or not hinted
    eng.serve("other", _ctx(9, eng.pool.get_num_free_blocks() - 5))
    cached = {a: sum(bool(eng.pool.get_cached_block(h, [0])) for h in _ctx(a, 4)) for a in range(3)}
    assert cached == ({0: 4, 1: 0, 2: 0} if hinted else {0: 0, 1: 0, 2: 4}), cached
    assert all(eng.pool.blocks[i].ref_cnt == 0 for i in range(1, 16))  # no reference kept


@pytest.mark.parametrize("announced,plane", [(True, "hosted"), (False, "hosted"), (True, "watched")])
def test_a_shared_round_keeps_its_prefix_until_its_last_agent_ran(announced: bool, plane: str) -> None:
    """An all-gather round announced on the hint plane (``SessionHandle.shared_round``)
    with its three agents; each agent's request carries ``tag_round`` (the shared prefix
    is its first 6 blocks). The round is a reference count: after the first agent ran,
    its shared prefix stays held in HBM and pinned in the tiers while agents remain,
    so the others hit it in HBM although other traffic took every free block between
    them; after the last one the hold and the pins are given back. Not announced: the
    traffic evicts the prefix (kvtier's DRAM tier, 8 blocks here, is flushed too).
    ``watched``: the hint server runs apart (``kvtier serve``) and the connector follows
    it (``hint_watch``): its Watch view carries the rounds."""
    from contextlib import ExitStack

    from kvtier.hints.server import BackgroundHintServer
    from kvtier.sdk import HintClient, tag_round

    server = None
    if plane == "watched":
        server = BackgroundHintServer()
        address = server.start("127.0.0.1:0")
        eng = _Engine(101, placement="kvtier", hint_watch=address)
    else:
        eng = _Engine(101, placement="kvtier", hint_server="127.0.0.1:0")
        address = eng.sched.hint_address
    sched = eng.sched
    shared = _ctx(7, 6)
    client = HintClient(address)
    hits = []
    try:
        with ExitStack() as stack:
            session = stack.enter_context(client.session("s"))
            for a in range(3):
                stack.enter_context(session.agent("debater", agent_id=f"a{a}"))
            if announced:
                stack.enter_context(session.shared_round("r1", ["a0", "a1", "a2"]))
                _step_until_true(eng, lambda: ("s", "r1") in sched.rounds.announced)
            for a in range(3):
                params = tag_round(tag_request({}, "s", f"a{a}"), "r1", 6 * BS)["kv_transfer_params"]
                hits.append(eng.serve(f"a{a}", shared + _ctx(a, 2), params))
                if a == 0 and announced:
                    assert sched.placement.holds.held_blocks == 6
                    assert all(sched.manager.is_pinned(k) for k in sched.rounds.tracked[("s", "r1")].keys)
                eng.serve(f"other-{a}", _ctx(20 + a, eng.pool.get_num_free_blocks() - 1))  # takes every free block
            eng.step()
            assert sched.placement.holds.held_blocks == 0  # the last agent ran: released
            assert not any(sched.manager.is_pinned(k) for k in sched.rounds.tracked[("s", "r1")].keys)
            assert sched.counters["shared_round_releases"] == (1 if announced else 0)
            # an agent of the finished round asks again: the round is not held a second time
            eng.serve("a0-again", shared + _ctx(0, 3), tag_round(tag_request({}, "s", "a0"), "r1", 6 * BS)
                      ["kv_transfer_params"])
            assert sched.placement.holds.held_blocks == 0 and sched.counters["shared_round_holds"] == int(announced)
        # the round (and the session) ended: forgotten once the scheduler sees it
        if announced:
            _step_until_true(eng, lambda: not sched.rounds.tracked)
        assert hits == ([0, 6, 6] if announced else [0, 0, 0])
    finally:
        client.close()
        sched.shutdown()
        if server is not None:
            server.stop()


def _step_until_true(eng: _Engine, done, timeout_s: float = 10.0) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while not done() and time.monotonic() < deadline:
        eng.step()
        time.sleep(0.02)
    assert done()


@pytest.mark.parametrize("tenant_share", [0.5, 1.0])
def test_a_tenant_flooding_holds_and_sessions_leaves_another_tenant_its_hold_and_hits(tenant_share: float) -> None:
    """One tenant's client floods: 30 sessions, each an agent claiming criticality 1 and a
    60 s tool wait. Another tenant's one agent then waits on a tool; untagged traffic
    takes every free block; the agent comes back. With ``hbm_hold_tenant_fraction`` 0.5
    the flood holds at most half the hold budget and at most 8 of its agents are
    remembered (``max_tracked_agents_per_tenant``): the other agent gets its hold and
    hits all 4 blocks. With no per-tenant bound (1.0) the flood takes the whole budget
    and the other agent's hold is refused (0 hits): the bound is what protects it."""
    eng = _Engine(201, placement="ttl", hbm_hold_budget_fraction=0.5, hbm_hold_tenant_fraction=tenant_share,
                  max_tracked_agents_per_tenant=8)  # 200 usable blocks: 100 held at most, 50 per tenant
    holds, placement = eng.sched.placement.holds, eng.sched.placement
    free_at_start = eng.pool.get_num_free_blocks()

    def flood_tag(i: int) -> dict:
        return {**tag_request({}, f"flood-{i}", "a", 60.0, criticality=1.0)["kv_transfer_params"],
                "kvtier_tenant": "noisy"}

    for i in range(30):
        eng.serve(f"flood-{i}", _ctx(100 + i, 4), flood_tag(i))
    assert holds.tenant_blocks("noisy") <= holds.tenant_budget_blocks == int(tenant_share * 100)
    assert placement.tracked_waiting("noisy") == 8
    victim = {**_tag(1, 30.0), "kvtier_tenant": "quiet"}
    eng.serve("quiet-1", _ctx(1, 4), victim)
    assert placement.tracked_waiting("quiet") == 1
    eng.serve("other", _ctx(9, eng.pool.get_num_free_blocks() - 1))  # untagged traffic takes every free block
    eng.now += 5.0
    hits = eng.serve("quiet-2", _ctx(1, 6), {**_tag(1, None), "kvtier_tenant": "quiet"})
    c = eng.sched.counters
    if tenant_share < 1.0:
        assert hits == 4 and holds.tenant_blocks("noisy") == 48  # 12 of the flood's agents, 4 blocks each
        assert c["hbm_hold_refused_tenant"] == 18 and c["agents_forgotten_tenant"] == 22
    else:
        assert hits == 0 and holds.held_blocks == 100 and c["hbm_hold_refused_tenant"] == 0
    eng.now += 120.0  # every hold lapses; nothing stays referenced
    eng.step()
    assert holds.held_blocks == 0 and eng.pool.get_num_free_blocks() == free_at_start


@pytest.mark.parametrize("auth", [False, True])
def test_two_tenants_sharing_a_session_and_agent_id_keep_their_own_waits_and_context(tmp_path: Path,
                                                                                     auth: bool) -> None:
    """Two tenants of one hosted hint server both name session ``s`` and agent ``coder``
    (ids are the client's choice), their requests stamped with their tenant
    (``kvtier_tenant``, as a gateway would). Each finishes a turn; then only ``acme``
    announces a tool call. That starts ``acme``'s tool wait, not ``zeta``'s, and holds
    ``acme``'s own context: after untagged traffic takes every free block, ``acme``'s
    agent comes back to all 4 of its blocks in HBM. Keyed by the session alone, the two
    agents were one, whose last context (``zeta``'s) was held instead. With a token file
    the tenant is the token's; without, the one the client names."""
    from kvtier.sdk import HintClient

    extra: dict = {"hint_server": "127.0.0.1:0"}
    if auth:
        (tmp_path / "tokens").write_text("acme tok-acme\nzeta tok-zeta\n")
        extra["hint_server_token_file"] = str(tmp_path / "tokens")
    eng = _Engine(101, placement="kvtier", **extra)
    sched, placement = eng.sched, eng.sched.placement
    clients = {t: HintClient(sched.hint_address, **({"token": f"tok-{t}"} if auth else {"tenant": t}))
               for t in ("acme", "zeta")}

    def params(t: str, agent) -> dict:
        return {**agent.tag({})["kv_transfer_params"], "kvtier_tenant": t}

    try:
        a, z = clients["acme"], clients["zeta"]
        with a.session("s"), a.agent(agent_id="coder") as a_agent, z.session("s"), z.agent(agent_id="coder") as z_agent:
            eng.serve("acme-1", _ctx(1, 4), params("acme", a_agent))
            eng.serve("zeta-1", _ctx(2, 4), params("zeta", z_agent))
            acme, zeta = (tenant_session("acme", "s"), "coder"), (tenant_session("zeta", "s"), "coder")
            assert placement.is_waiting(acme) and placement.is_waiting(zeta)
            with a_agent.tool_call("bash", expected_s=20.0):
                _step_until(eng, "tool_waits")
                assert placement.is_waiting(acme, tool=True) and not placement.is_waiting(zeta, tool=True)
                eng.serve("other", _ctx(9, eng.pool.get_num_free_blocks() - 1))  # untagged: every free block
                eng.now += 5.0
                assert eng.serve("acme-2", _ctx(1, 6), params("acme", a_agent)) == 4
    finally:
        for c in clients.values():
            c.close()
        sched.shutdown()


def test_a_tenant_over_its_bound_forgets_its_own_oldest_finished_context_not_anothers() -> None:
    """``max_tracked_agents_per_tenant`` 2: ``noisy`` finishes turns of 4 agents after ``quiet``
    finished one. ``noisy`` forgets its 2 oldest agents' contexts (a tool call announced for one
    of them then starts no tool wait); ``quiet``'s call still finds its context and starts its."""
    from kvtier.sdk import HintClient

    eng = _Engine(101, placement="kvtier", hint_server="127.0.0.1:0", max_tracked_agents_per_tenant=2)
    sched = eng.sched
    noisy, quiet = (HintClient(sched.hint_address, tenant=t) for t in ("noisy", "quiet"))
    try:
        with noisy.session("s"), quiet.session("s"), quiet.agent(agent_id="q") as q, \
                noisy.agent(agent_id="n0", session_id="s") as n0:
            eng.serve("q-1", _ctx(1, 4), {**q.tag({})["kv_transfer_params"], "kvtier_tenant": "quiet"})
            agents = [n0] + [noisy.agent(agent_id=f"n{i}", session_id="s") for i in range(1, 4)]  # only n0 announced
            for i, n in enumerate(agents):
                eng.serve(f"n-{i}", _ctx(10 + i, 2), {**n.tag({})["kv_transfer_params"], "kvtier_tenant": "noisy"})
            assert sched.counters["finished_contexts_forgotten_tenant"] == 2
            with n0.tool_call("bash", expected_s=20.0), q.tool_call("bash", expected_s=20.0):
                _step_until(eng, "tool_waits")
                for _ in range(5):
                    eng.step()
                assert sched.placement.is_waiting((tenant_session("quiet", "s"), "q"), tool=True)
                assert not sched.placement.is_waiting((tenant_session("noisy", "s"), "n0"), tool=True)
    finally:
        noisy.close()
        quiet.close()
        sched.shutdown()


def test_a_tool_wait_the_request_said_is_re_timed_once_by_the_hint_servers_prediction() -> None:
    """A request that said its tool wait (the middleware's guess for a forced tool call) starts a tool wait
    when it finishes; the call announced after the response re-times it once with the server's prediction
    (``waits_retimed``), the same wait (``tool_waits`` stays 1); later polls leave it."""
    import time

    from kvtier.sdk import HintClient, tag_request

    eng = _Engine(101, placement="kvtier", hint_server="127.0.0.1:0")
    sched = eng.sched
    try:
        client = HintClient(sched.hint_address)
        with client.session("s"), client.agent("coder") as agent:
            said = tag_request({}, "s", agent.agent_id, tool_wait_s=2.0)["kv_transfer_params"]
            eng.serve("r1", _ctx(1, 4), said)
            eng.step()
            c = sched.counters
            assert (c["user_waits"], c["tool_waits"], c["waits_retimed"]) == (0, 1, 0)
            assert sched.placement.is_waiting(("s", agent.agent_id), tool=True)
            with client.tool_call("bash", expected_s=20.0):
                _step_until(eng, "waits_retimed")
                for _ in range(4):  # more polls (at most every 50 ms) see the same call: no second re-time
                    eng.step()
                    time.sleep(0.06)
                assert (c["user_waits"], c["tool_waits"], c["waits_retimed"]) == (0, 1, 1)
        client.close()
    finally:
        sched.shutdown()
