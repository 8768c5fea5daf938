"""Load or recompute per request (kvtier.placement.loadrule): each rule's defining behaviour,
llm-d's selective load and its queue gate, and the replay applying the rule it is given."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvtier.errors import ConfigError
from kvtier.placement import make_placement
from kvtier.placement.loadrule import LOAD_RULES, SelectiveLoad, make_load_rule
from kvtier.replay.generator import default_workload
from kvtier.replay.profiles import DEFAULT_PROFILE, parse_profile
from kvtier.replay.sim import SimConfig, Simulator


class _Policy:
    """Answers ``should_load`` with ``answer`` and counts the questions."""

    def __init__(self, answer: bool) -> None:
        self.answer, self.asked = answer, 0

    def should_load(self, ctx, by_tier, context_tokens) -> bool:
        self.asked += 1
        return self.answer


def _ctx(now: float = 0.0, block_size: int = 64) -> SimpleNamespace:
    return SimpleNamespace(now=now, block_size=block_size)


@pytest.mark.parametrize("rule, chooses, answer, loads, asked", [
    ("surface", True, False, False, 1),  # full: the policy decides
    ("surface", False, False, True, 0),  # the vLLM surfaces: every hit loads
    ("always", True, False, True, 0),
    ("never", False, True, False, 0),
    ("cost", False, False, False, 1),  # the policy's cost model on any surface
    ("cost", True, True, True, 1),
])
def test_each_rule_loads_or_recomputes_as_named(rule: str, chooses: bool, answer: bool, loads: bool,
                                                asked: int) -> None:
    policy = _Policy(answer)
    assert make_load_rule(rule).load(policy, _ctx(), {"ssd": 4}, chooses) is loads
    assert policy.asked == asked


def test_llm_d_loads_from_1024_external_tokens() -> None:
    """With 64-token blocks, 15 host-tier blocks (960 tokens) are recomputed and 16 (1,024) loaded;
    the tiers add up."""
    rule = SelectiveLoad()
    assert not rule.load(_Policy(True), _ctx(), {"ssd": 15}, True)
    assert rule.load(_Policy(False), _ctx(), {"ssd": 16}, True)
    assert rule.load(_Policy(False), _ctx(), {"dram": 8, "ssd": 8}, True)


def test_llm_d_gate_closes_at_a_mean_of_8_waiting_and_opens_at_4() -> None:
    """Samples of 0 then 16 waiting, 2 s apart (one half-life), make the mean 8: the gate closes and
    a 4,096-token hit is recomputed. A sample at the same moment adds nothing (5 waiting: still 8,
    closed). A sample of 0 two seconds later halves it to 4: open again."""
    rule = SelectiveLoad()
    big = {"ssd": 64}
    rule.observe(0.0, 0)
    assert rule.load(_Policy(False), _ctx(), big, True)
    rule.observe(2.0, 16)
    assert rule.mean_waiting == pytest.approx(8.0) and not rule.load(_Policy(False), _ctx(), big, True)
    rule.observe(2.0, 5)
    assert rule.mean_waiting == pytest.approx(8.0) and not rule.gate_open
    rule.observe(4.0, 0)
    assert rule.mean_waiting == pytest.approx(4.0) and rule.load(_Policy(False), _ctx(), big, True)


def test_an_unknown_rule_names_the_setting_and_the_valid_ones() -> None:
    with pytest.raises(ConfigError, match="--load-rule.*always"):
        make_load_rule("sometimes")
    assert set(LOAD_RULES) == {"surface", "always", "never", "cost", "llm-d"}


class _CostCtx:
    """A context for the cost model: one 64-token block moves in 0.1 s, 1,000 tokens compute per second."""

    block_size = 64

    def __init__(self, queued_s: float = 0.0, ahead: int = 0, wait_s: float = 0.0) -> None:
        self.queued_s, self.ahead, self.wait_s = queued_s, ahead, wait_s

    def load_wait_s(self) -> float:
        return self.wait_s

    def queued_transfer_s(self, link: str) -> float:
        return self.queued_s

    def transfer_time_s(self, num_blocks: int, link: str) -> float:
        return 0.1 * num_blocks

    def recompute_time_s(self, num_tokens: int) -> float:
        return num_tokens / 1000.0

    def prefill_ahead_s(self) -> float:
        return self.ahead / 1000.0


@pytest.mark.parametrize("ctx, loads", [
    (_CostCtx(), False),  # 0.1 s to load against 0.064 s to recompute
    (_CostCtx(ahead=100), True),  # behind 100 tokens of prefill the load hides: 0.1 s against 0.164 s
    (_CostCtx(ahead=100, queued_s=0.2), False),  # 0.2 s of copies queued on the link first: 0.3 s
    (_CostCtx(ahead=100, wait_s=0.1), False),  # and a step's wait: 0.2 s
])
def test_the_cost_model_weighs_the_link_queue_and_the_prefill_ahead(ctx: _CostCtx, loads: bool) -> None:
    policy = make_placement("kvtier")
    assert policy.should_load(ctx, {"ssd": 1}, 0) is loads
    assert make_load_rule("cost").load(policy, ctx, {"ssd": 1}, False) is loads


def test_the_replay_recomputes_every_host_tier_hit_under_never() -> None:
    """On the vLLM surface with DRAM: ``always`` (what ``surface`` does there) loads DRAM hits,
    ``never`` recomputes them, computing more prefill and counting each recomputed hit."""
    w = default_workload(0, 4, max_requests_per_agent=12)
    profile = parse_profile(DEFAULT_PROFILE)
    out = {}
    for rule in ("surface", "always", "never"):
        sim = Simulator(w, SimConfig(hbm_blocks=400, dram_blocks=2400, conc=4, surface="vllm", load_rule=rule),
                        make_placement("kvtier"), profile)
        res = sim.run()
        sim.mgr.check_invariants()
        out[rule] = res
    dram_hits = {r: sum(rec.hit_dram_tokens for rec in res.records) for r, res in out.items()}
    computed = {r: sum(rec.computed_tokens for rec in res.records) for r, res in out.items()}
    assert dram_hits["always"] == dram_hits["surface"] > 0 and dram_hits["never"] == 0
    assert computed["never"] > computed["always"] == computed["surface"]
    assert out["never"].counters["hits_recomputed"] > 0 and "hits_recomputed" not in out["always"].counters
