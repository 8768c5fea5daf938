"""Cold blocks in the connector (issue 24), with stand-in requests (no engine):
blocks of a request whose agent then waits long go to SSD with the lossy
codec, others exact; a block loaded from a lossy value is never stored again
in any tier; the settings refuse what cannot work, naming the key."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from kvtier_vllm.metadata import KVTierWorkerMetadata
from kvtier_vllm.scheduler import KVTierScheduler
from kvtier_vllm.settings import ConnectorSettings, EngineFacts

from kvtier.errors import ConfigError
from kvtier.sdk.handles import TOOL_WAIT_PARAM

BS = 32
FACTS = EngineFacts("tiny", "bfloat16", BS, 2, 2, 32, "fused", "sha256")


class FakeRequest:
    def __init__(self, req_id: str, tag: int, num_blocks: int = 4, wait_s: float | None = None) -> None:
        self.request_id = req_id
        self.block_hashes = [bytes([tag, i]) * 16 for i in range(num_blocks)]
        self.num_tokens = num_blocks * BS + 2
        self.num_computed_tokens = 0
        self.kv_transfer_params = None if wait_s is None else {TOOL_WAIT_PARAM: wait_s}


class FakeKVCacheManager:
    def __init__(self) -> None:
        self.blocks: dict[str, list[int]] = {}

    def get_block_ids(self, req_id: str) -> tuple[list[int], ...]:
        return (self.blocks[req_id],)


def _sched(tmp_path: Path, **extra) -> tuple[KVTierScheduler, FakeKVCacheManager]:
    settings = ConnectorSettings.build({"dram_capacity_blocks": 4, "ssd_path": str(tmp_path / "ssd"), **extra},
                                       FACTS, env={})
    ns = settings.config.namespace.to_namespace(settings.config.layout.to_layout())
    sched = KVTierScheduler(settings, ns, BS, 1)
    kvm = FakeKVCacheManager()
    sched.bind_kv_cache_manager(kvm)
    return sched, kvm


def _store(sched: KVTierScheduler, kvm: FakeKVCacheManager, req: FakeRequest, first_block: int) -> dict[str, str]:
    """Serve ``req`` cold and report every write done; the codec of each tier's write."""
    kvm.blocks[req.request_id] = list(range(first_block, first_block + 5))
    sched.on_new_request(req)
    sched.get_num_new_matched_tokens(req, 0)
    meta = sched.build_connector_meta(SimpleNamespace(num_scheduled_tokens={req.request_id: req.num_tokens},
                                                      preempted_req_ids=set()))
    (job,) = meta.stores
    sched.update_connector_output(KVTierWorkerMetadata({w.plan_id: (1, [True] * len(w.rows)) for w in job.writes},
                                                       {job.job_id: 1}))
    sched.request_finished(req)
    return {w.tier: w.codec for w in job.writes}


@pytest.mark.parametrize("wait_s, expected", [(120.0, "rq4"), (30.0, "rq4"), (5.0, ""), (None, "")])
def test_blocks_followed_by_a_long_wait_go_to_ssd_compressed(tmp_path: Path, wait_s, expected: str) -> None:
    sched, kvm = _sched(tmp_path, cold_codec="rq4", cold_after_s=30)
    codecs = _store(sched, kvm, FakeRequest("r1", 1, wait_s=wait_s), 10)
    assert codecs == {"dram": "", "ssd": expected}  # DRAM always exact
    assert sched.counters["store_cold_blocks"] == (4 if expected else 0)


@pytest.mark.parametrize("cold", [True, False])
def test_a_block_loaded_from_a_lossy_value_is_never_stored_again(tmp_path: Path, cold: bool) -> None:
    extra = {"cold_codec": "rq4", "cold_after_s": 30} if cold else {}
    sched, kvm = _sched(tmp_path, **extra)
    _store(sched, kvm, FakeRequest("r1", 1, wait_s=120.0), 10)  # DRAM + SSD (lossy when cold)
    _store(sched, kvm, FakeRequest("r3", 3), 20)  # 4 other blocks take DRAM: r1's are on SSD only
    r2 = FakeRequest("r2", 1)  # r1's blocks again
    kvm.blocks["r2"] = [30, 31, 32, 33, 34]
    sched.on_new_request(r2)
    assert sched.get_num_new_matched_tokens(r2, 0) == (4 * BS, True)
    sched.update_state_after_alloc(r2, kvm.blocks["r2"], 4 * BS)
    meta = sched.build_connector_meta(SimpleNamespace(num_scheduled_tokens={}, preempted_req_ids=set()))
    (load,) = meta.loads
    assert load.tiers == ("ssd",) * 4
    sched.update_connector_output(KVTierWorkerMetadata({load.plan_id: (1, [True] * 4)}, {}))
    sched.load_finished(["r2"])
    r2.num_computed_tokens = 4 * BS
    meta = sched.build_connector_meta(SimpleNamespace(num_scheduled_tokens={"r2": 2}, preempted_req_ids=set()))
    stored = {tier: len(w.rows) for job in meta.stores for w in job.writes for tier in [w.tier]}
    if cold:  # the approximation stays where it is: not copied into DRAM as if exact
        assert sched.counters["load_lossy_blocks"] == 4
        assert sched.counters["store_skipped_lossy_blocks"] == 4
        assert stored == {}
    else:  # exact values: the loaded blocks are cached in DRAM again
        assert sched.counters["load_lossy_blocks"] == 0
        assert stored == {"dram": 4}


def test_an_ssd_tier_configured_lossy_marks_every_ssd_load(tmp_path: Path) -> None:
    sched, kvm = _sched(tmp_path, dram_capacity_blocks=0, kvtier={"tiers": {"ssd": {"codec": "rq3"}}})
    assert _store(sched, kvm, FakeRequest("r1", 1), 10) == {"ssd": ""}  # the tier's own codec: rq3
    r2 = FakeRequest("r2", 1)
    kvm.blocks["r2"] = [30, 31, 32, 33, 34]
    sched.on_new_request(r2)
    sched.get_num_new_matched_tokens(r2, 0)
    sched.update_state_after_alloc(r2, kvm.blocks["r2"], 4 * BS)
    assert sched.counters["load_lossy_blocks"] == 4


@pytest.mark.parametrize("extra, key, match", [
    ({"cold_codec": "zstd"}, "cold_codec", "lossy codec"),
    ({"cold_codec": "rq4", "cold_after_s": -1}, "cold_after_s", ">= 0"),
    ({"cold_codec": "rq4", "cold_after_s": "soon"}, "cold_after_s", ">= 0"),
    ({"cold_after_s": 10}, "cold_after_s", "needs cold_codec"),
    ({"cold_codec": "rq4", "ssd_path": None}, "cold_codec", "needs a slow tier"),
])
def test_bad_cold_settings_name_the_key(tmp_path: Path, extra: dict, key: str, match: str) -> None:
    base = {"dram_capacity_blocks": 4, "ssd_path": str(tmp_path / "ssd")}
    with pytest.raises(ConfigError, match=f"kv_connector_extra_config.{key}.*{match}"):
        ConnectorSettings.build({**base, **extra}, FACTS, env={})


@pytest.mark.parametrize("facts, match", [
    (EngineFacts("m", "bfloat16", BS, 4, 1, 288, "mla", "sha256"), "MLA latent width"),  # 576 is accepted
    (EngineFacts("m", "bfloat16", BS, 4, 2, 96, "fused", "sha256"), "power of two"),
])
def test_a_lossy_codec_the_layout_cannot_take_is_refused_at_start(tmp_path: Path, facts, match: str) -> None:
    with pytest.raises(ConfigError, match=f"kv_connector_extra_config.cold_codec.*{match}"):
        ConnectorSettings.build({"ssd_path": str(tmp_path / "a"), "cold_codec": "rq4"}, facts, env={})
    with pytest.raises(ConfigError, match=f"tiers.ssd.codec.*{match}"):
        ConnectorSettings.build({"ssd_path": str(tmp_path / "b"), "kvtier": {"tiers": {"ssd": {"codec": "rq4"}}}},
                                facts, env={})
