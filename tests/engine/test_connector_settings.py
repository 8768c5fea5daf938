"""kv_connector_extra_config parsing and the vLLM version gate (no vLLM needed)."""

from __future__ import annotations

import pytest
from kvtier_vllm.settings import ConnectorSettings, EngineFacts
from kvtier_vllm.version import check_vllm_version

from kvtier.config import RemoteTierConfig
from kvtier.errors import ConfigError

FACTS = EngineFacts("tiny", "bfloat16", 32, 2, 2, 32, "fused", "sha256")


def test_defaults_use_dram_only_and_never_hbm() -> None:
    s = ConnectorSettings.build({}, FACTS, env={})
    assert s.config.enabled_tiers == ("dram",)
    assert s.config.put_tier == "dram" and s.config.write_through
    assert s.rank_ssd_path(0, 1) is None


def test_ssd_path_enables_the_ssd_tier_per_rank(tmp_path) -> None:
    s = ConnectorSettings.build({"ssd_path": str(tmp_path), "dram_capacity_blocks": 0}, FACTS, env={})
    assert s.config.enabled_tiers == ("ssd",)
    assert s.config.put_tier == "ssd"
    assert s.rank_ssd_path(1, 2) == tmp_path / "tp1-of-2"


def test_nested_kvtier_settings_and_policy(tmp_path) -> None:
    s = ConnectorSettings.build(
        {"kvtier": {"tiers": {"dram": {"capacity_blocks": 5}}}, "policy": "lfu", "ssd_path": str(tmp_path)},
        FACTS, env={})
    assert s.config.dram.capacity_blocks == 5
    assert s.config.dram.policy == s.config.ssd.policy == "lfu"


def test_engine_facts_override_layout_and_namespace() -> None:
    s = ConnectorSettings.build({"tenant": "t1"}, FACTS, env={})
    layout = s.config.layout.to_layout()
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.block_size) == (2, 2, 32, 32)
    ns = s.config.namespace.to_namespace(layout)
    assert ns.tenant == "t1" and "sha256" in ns.model
    other = ConnectorSettings.build({"tenant": "t2"}, FACTS, env={}).config
    assert other.namespace.to_namespace(layout).digest != ns.digest


def test_unknown_key_names_the_valid_ones() -> None:
    with pytest.raises(ConfigError, match="kv_connector_extra_config.ssd_dir.*valid keys: .*ssd_path"):
        ConnectorSettings.build({"ssd_dir": "/x"}, FACTS, env={})


def test_no_host_tier_is_an_error() -> None:
    with pytest.raises(ConfigError, match="enable the DRAM tier or set ssd_path"):
        ConnectorSettings.build({"dram_capacity_blocks": 0}, FACTS, env={})


def test_placement_defaults_to_kvtier_and_takes_the_replay_names() -> None:
    s = ConnectorSettings.build({}, FACTS, env={})
    assert (s.placement, s.hbm_hold, s.hbm_hold_budget_fraction) == ("kvtier", True, 0.5)
    for name in ("lru-dram", "ttl", "kvflow", "tokencake", "kvtier-space-only", "lmcache-lazy"):
        assert ConnectorSettings.build({"placement": name}, FACTS, env={}).placement == name


def test_exclusive_dram_is_on_by_default_wherever_it_is_built(tmp_path) -> None:
    """Unset, exclusive DRAM is the recommended setup where it is built; elsewhere write-through, with no error."""
    hybrid = EngineFacts("gemma", "bfloat16", 32, 1, 2, 32, "fused", "sha256", window_blocks=(2, 2, 0))
    rope = EngineFacts("tiny", "bfloat16", 32, 2, 2, 32, "fused", "sha256", rope=(10000.0, 32))
    cases = [({}, FACTS, True), ({"placement": "lmcache-lazy"}, FACTS, True),
             ({"exclusive_dram": False}, FACTS, False), ({"placement": "lru-dram"}, FACTS, False),
             ({"placement": "tokencake"}, FACTS, False), ({}, hybrid, False),
             ({"dram_capacity_blocks": 0, "ssd_path": str(tmp_path)}, FACTS, False),
             ({"approximate_shifted_segments": True}, rope, False)]
    for extra, facts, exclusive in cases:
        assert ConnectorSettings.build(extra, facts, env={}).exclusive_dram is exclusive, extra
    for extra, facts, match in [({"exclusive_dram": True, "placement": "lru-dram"}, FACTS, "placement .lru-dram. writes DRAM through"),
                                ({"exclusive_dram": True}, hybrid, "not built for models with 3 KV cache groups"),
                                ({"exclusive_dram": True, "dram_capacity_blocks": 0, "ssd_path": str(tmp_path)},
                                 FACTS, "needs the DRAM tier")]:
        with pytest.raises(ConfigError, match="exclusive_dram=True: " + match):
            ConnectorSettings.build(extra, facts, env={})


@pytest.mark.parametrize("extra,match", [
    ({"placement": "lru-2q"}, "placement='lru-2q': unknown placement policy; valid: "),
    ({"placement": "belady-hbm"}, "placement='belady-hbm': needs the future"),
    ({"placement": "sae"}, "placement='sae': replay only"),
    ({"placement": "vllm-tiering"}, "placement='vllm-tiering': replay only"),
    ({"placement": "lru"}, "placement='lru': uses no host tier"),
    ({"hbm_hold": "no"}, "hbm_hold='no': must be true or false"),
    ({"hbm_hold_budget_fraction": 1.5}, "hbm_hold_budget_fraction=1.5: must be a number in"),
    ({"hbm_hold_tenant_fraction": 0}, r"hbm_hold_tenant_fraction=0: must be a number in \(0, 1\]"),
    ({"hbm_hold_tenant_fraction": float("nan")}, "hbm_hold_tenant_fraction=nan: must be a number in"),
    ({"max_tracked_agents_per_tenant": 0}, "max_tracked_agents_per_tenant=0: must be an integer in 1..4096"),
    ({"max_tracked_agents_per_tenant": 1e9}, "max_tracked_agents_per_tenant=1000000000.0: must be an integer"),
    ({"hint_watch": "127.0.0.1:1", "hint_server": "127.0.0.1:0"}, "hint_watch='127.0.0.1:1': give hint_server"),
    ({"hint_watch": 5}, "hint_watch=5: must be host:port"),
    ({"hint_server_token_file": "/tmp/t"}, "hint_server_token_file='/tmp/t': needs hint_server"),
    ({"hint_server": "0.0.0.0:0", "hint_server_token_file": "/nonexistent/tokens"},
     "hint_server_token_file='/nonexistent/tokens': cannot be read: "),
    ({"hint_server": "0.0.0.0:0", "hint_server_token_file": 7}, "hint_server_token_file=7: must be the path"),
    ({"copy_threads": 0}, "copy_threads=0: must be an integer in 1..64"),
    ({"device_staging_mib": 0}, "device_staging_mib=0: must be a number > 0"),
    ({"side_stream": "yes"}, "side_stream='yes': must be true or false"),
    ({"lockstep_transfers": 1}, "lockstep_transfers=1: must be true or false"),
    ({"record_path": 3}, "record_path=3: must be a directory path"),
    ({"record_max_mib": -1}, "record_max_mib=-1: must be a number > 0"),
    ({"copy_threads": 2.5}, "copy_threads=2.5: must be an integer in 1..64"),
    ({"remote_master": "nohost"}, "remote_master='nohost': must be host:port"),
    ({"remote_segment_mib": 64}, "remote_segment_mib=64: needs remote_master"),
    ({"remote_master": "h:1", "remote_metadata_server": "h:2"}, "remote_metadata_server='h:2': must be an http"),
    ({"remote_master": "h:1", "remote_codec": "lz4"}, "remote_codec='lz4': valid: "),
    ({"remote_master": "h:1", "remote_zstd_level": 30}, "remote_zstd_level=30: must be in 1..22"),
    ({"remote_master": "h:1", "remote_zstd_level": "9"}, "remote_zstd_level='9': "),
    ({"remote_master": "h:1", "remote_buffer_mib": 0.5}, "remote_buffer_mib=0.5: must be at least 1 MiB"),
    ({"remote_master": "h:1", "remote_segment_mib": 0}, "remote_segment_mib=0: must be a number > 0"),
    ({"remote_master": "h:1", "remote_lookup_wait_ms": -1}, "remote_lookup_wait_ms=-1: must be a number"),
    ({"remote_master": "h:1", "remote_write_queue_mib": 0}, "remote_write_queue_mib=0: must be a number > 0"),
    ({"remote_master": "h:1", "remote_pin_ttl_s": -5}, "remote_pin_ttl_s=-5: must be seconds"),
])
def test_bad_placement_settings_name_the_key(extra: dict, match: str) -> None:
    with pytest.raises(ConfigError, match="kv_connector_extra_config." + match):
        ConnectorSettings.build(extra, FACTS, env={})


@pytest.mark.parametrize("version", ["0.32.0", "0.32.5+cpu", "0.33.0", "0.34.0"])
def test_tested_versions_pass(version: str) -> None:
    assert check_vllm_version(version) == version


@pytest.mark.parametrize("version", ["0.31.2", "0.35.0", "1.0.0", "garbage"])
def test_untested_versions_fail_with_the_range(version: str) -> None:
    with pytest.raises(RuntimeError, match=r"tested with vllm>=0.32,<0.35.*allow_untested_vllm"):
        check_vllm_version(version)
    assert check_vllm_version(version, allow_untested=True) == version


def test_a_config_files_placement_section_is_run_with_its_constants(tmp_path) -> None:
    """The file ``kvtier tune`` writes: its policy and constants are what the connector
    runs, unless ``placement`` names another policy (then the constants are not applied)."""
    cfg = tmp_path / "tuned.yaml"
    cfg.write_text("placement:\n  policy: kvflow\n  rho_max: 0.4\n  prefetch_lead_factor: 3\n")
    s = ConnectorSettings.build({"config_file": str(cfg)}, FACTS, env={})
    assert s.placement == "kvflow" and s.placement_params == {"rho_max": 0.4, "prefetch_lead_factor": 3.0}
    other = ConnectorSettings.build({"config_file": str(cfg), "placement": "kvtier"}, FACTS, env={})
    assert other.placement == "kvtier" and other.placement_params == {}
    cfg.write_text("placement:\n  policy: kvtier\n  rho_max: 2\n")
    with pytest.raises(ConfigError, match="placement.rho_max=2.0: must be in"):
        ConnectorSettings.build({"config_file": str(cfg)}, FACTS, env={})



def test_remote_settings_and_their_defaults() -> None:
    assert ConnectorSettings.build({}, FACTS, env={}).remote is None
    r = ConnectorSettings.build({"remote_master": "10.0.0.5:50051", "remote_segment_mib": 64}, FACTS, env={}).remote
    assert r is not None and r.metadata_server == "http://10.0.0.5:8080/metadata"
    assert (r.segment_bytes, r.write_queue_bytes, r.codec, r.lookup_wait_s, r.pin_ttl_s) == (
        64 << 20, 256 << 20, "raw", 0.005, 60.0)
    # the store client's own settings are tiers.remote's, validated by the same class
    assert (r.tier.buffer_bytes, r.tier.zstd_level) == (64 << 20, 1)
    r = ConnectorSettings.build({"remote_master": "h:1", "remote_zstd_level": 9, "remote_buffer_mib": 32,
                                 "remote_codec": "zstd"}, FACTS, env={}).remote
    assert r is not None
    assert (r.tier.buffer_bytes, r.tier.zstd_level, r.codec, r.segment_bytes) == (32 << 20, 9, "zstd", 512 << 20)
    assert r.tier == RemoteTierConfig(enabled=True, master="h:1", buffer_bytes=32 << 20, codec="zstd", zstd_level=9)


def test_remote_tier_refuses_per_process_block_hashes() -> None:
    """With a non-cryptographic hash and no PYTHONHASHSEED, vLLM seeds block hashes per
    process: engines would never find each other's blocks, so the setting is refused."""
    xx = EngineFacts("tiny", "bfloat16", 32, 2, 2, 32, "fused", "xxhash")
    with pytest.raises(ConfigError, match="remote_master.*PYTHONHASHSEED"):
        ConnectorSettings.build({"remote_master": "h:1"}, xx, env={})
    assert ConnectorSettings.build({"remote_master": "h:1"}, xx, env={"PYTHONHASHSEED": "0"}).remote is not None


def test_approximate_reuse_is_off_by_default_and_needs_plain_rope() -> None:
    from dataclasses import replace

    assert ConnectorSettings.build({}, FACTS, env={}).approximate_rope is None
    with_rope = replace(FACTS, rope=(10000.0, 32))
    s = ConnectorSettings.build({"approximate_shifted_segments": True}, with_rope, env={})
    assert s.approximate_rope == (10000.0, 32)
    with pytest.raises(ConfigError, match=r"approximate_shifted_segments.*must be true or false"):
        ConnectorSettings.build({"approximate_shifted_segments": "yes"}, with_rope, env={})
    no_rope = replace(FACTS, rope=None, rope_problem="rope_type 'yarn' (scaled RoPE) is not supported")
    with pytest.raises(ConfigError, match=r"approximate_shifted_segments.*cannot re-rotate.*'yarn'"):
        ConnectorSettings.build({"approximate_shifted_segments": True}, no_rope, env={})


def test_a_hybrid_model_refuses_the_settings_not_built_for_it() -> None:
    hybrid = EngineFacts("gemma", "bfloat16", 32, 1, 2, 32, "fused", "sha256", window_blocks=(2, 2, 0))
    assert hybrid.hybrid and not FACTS.hybrid
    with pytest.raises(ConfigError, match="remote_master.*3 KV cache groups"):
        ConnectorSettings.build({"remote_master": "127.0.0.1:50051"}, hybrid, env={})
    with pytest.raises(ConfigError, match="approximate_shifted_segments.*several KV cache groups"):
        ConnectorSettings.build({"approximate_shifted_segments": True}, hybrid, env={})
    assert ConnectorSettings.build({}, hybrid, env={}).config.dram.enabled


def test_mla_is_keyed_without_the_tp_rank_and_rank_0_writes_the_shared_tiers(tmp_path) -> None:
    for rank in (0, 1):
        facts = EngineFacts("ds", "bfloat16", 16, 61, 1, 576, "mla", "sha256", tp_rank=rank, tp_size=8)
        s = ConnectorSettings.build({"ssd_path": str(tmp_path)}, facts, env={})
        layout = s.config.layout.to_layout()
        ns = s.config.namespace.to_namespace(layout)
        assert (ns.tp_rank, ns.tp_size) == (0, 1) and facts.replicated
        assert facts.writes_shared_tiers == (rank == 0)
        assert s.rank_ssd_path(ns.tp_rank, ns.tp_size) == tmp_path / "tp0-of-1"
        assert layout.bytes_per_token == 61 * 576 * 2  # DeepSeek-V3/R1: 70,272 bytes, the engine's latent page
    gqa = EngineFacts("m", "bfloat16", 32, 2, 2, 32, "fused", "sha256", tp_rank=1, tp_size=2)
    assert not gqa.replicated and gqa.writes_shared_tiers


def test_the_hosted_hint_server_beyond_loopback_requires_a_token_from_the_token_file(tmp_path) -> None:
    """``hint_server`` on all interfaces: without ``hint_server_token_file`` it refuses to start,
    naming the setting; with it, a client without a token is refused and one with a token applied."""
    from collections import Counter
    from types import SimpleNamespace

    from kvtier_vllm.hint_intake import HintIntake

    from kvtier.sdk import HintClient

    def intake(extra: dict) -> HintIntake:
        s = ConnectorSettings.build(extra, FACTS, env={})
        return HintIntake(s, SimpleNamespace(), None, Counter(), 32, {}, None, None, None, None)

    with pytest.raises(ConfigError, match="hint_server='0.0.0.0:0': listens beyond loopback: give hint_server_token"):
        intake({"hint_server": "0.0.0.0:0"})
    empty = tmp_path / "none"
    empty.write_text("# no token yet\n")
    with pytest.raises(ConfigError, match="hint_server_token_file=.*has no token"):
        ConnectorSettings.build({"hint_server": "0.0.0.0:0", "hint_server_token_file": str(empty)}, FACTS, env={})
    tokens = tmp_path / "tokens"
    tokens.write_text("team-a s3cret-a\n")
    hosted = intake({"hint_server": "0.0.0.0:0", "hint_server_token_file": str(tokens)})
    try:
        port = hosted.address.rsplit(":", 1)[1]
        for token, sid in ((None, "anon"), ("wrong", "guess"), ("s3cret-a", "mine")):
            client = HintClient(f"127.0.0.1:{port}", token=token, max_batch_attempts=1)
            client.emit("session_start", session_id=sid)
            client.flush(timeout_s=5, give_up_when_down=True)
            client.close(timeout_s=1)
        sessions = {s.session_id for s in hosted.hosted.server.graph.sessions()}
        assert sessions == {"mine"}, sessions
    finally:
        hosted.close()
