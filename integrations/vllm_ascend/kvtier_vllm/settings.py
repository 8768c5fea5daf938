"""The connector's settings: ``kv_connector_extra_config`` plus what the engine
says about its KV cache, turned into one validated :class:`KVTierConfig`.

Owns: the extra-config keys (:data:`EXTRA_KEYS`), their mapping onto kvtier
settings, and the namespace that keeps blocks of different models, dtypes,
layouts, block sizes, TP ranks and hash algorithms apart. Must not import
vLLM (the connector passes plain :class:`EngineFacts`) or open any tier.

>>> facts = EngineFacts("m", "bfloat16", 32, 2, 2, 64, "fused", "sha256")
>>> s = ConnectorSettings.build({"dram_capacity_blocks": 8}, facts, env={})
>>> s.config.dram.capacity_blocks, s.config.ssd.enabled, s.config.hbm.enabled
(8, False, False)
>>> s.config.layout.to_layout().bytes_per_block == 32 * 2 * 2 * 2 * 64 * 2
True
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.config import KVTierConfig, RemoteTierConfig, load_config
from kvtier.errors import ConfigError
from kvtier.placement.agent import MAX_AGENTS
from kvtier.placement.cold import ColdCodecRule

MAX_TRACKED_AGENTS = MAX_AGENTS
"""Waiting agents whose contexts the scheduler remembers at once, all tenants together (and the agents
the hint reader remembers a finished context of): the longest waiting are forgotten first. The placement
policies' own bound (:data:`kvtier.placement.agent.MAX_AGENTS`)."""

EXTRA_KEYS: dict[str, str] = {
    "config_file": "path of a kvtier YAML/TOML file (tiers, policies, pins); engine facts override its layout",
    "kvtier": "nested kvtier settings in the config file's layout, e.g. {'tiers': {'dram': {'policy': 'lfu'}}}",
    "dram_capacity_blocks": "host-DRAM tier size in blocks (0 disables the tier)",
    "ssd_path": "directory of the SSD tier (LMDB); setting it enables the tier",
    "ssd_capacity_blocks": "SSD tier size in blocks",
    "ssd_write_queue_mib": "host copies waiting for the SSD writer, at most (MiB, default 256): when the SSD falls "
                           "behind, further SSD stores are skipped and counted (store_skipped_backpressure)",
    "staging_mib": "host staging for blocks in flight between the engine's KV cache and the tiers (MiB, default "
                   "1024; pinned when an accelerator is present): stores and loads that find it full are skipped "
                   "and counted (store_skipped_staging, load_skipped_staging), never waited for",
    "device_staging_mib": "accelerator buffer between the KV cache and host staging (MiB, default 64; not used on "
                          "the CPU): blocks cross the link through it in chunks, one contiguous copy each. It is "
                          "allocated at start, outside vLLM's profiled memory",
    "load_deadline_s": "a load not finished this many seconds after it started is reported failed and the engine "
                       "recomputes its blocks, instead of the request waiting on a stalled tier (default 30; 0: no "
                       "deadline). A copy already under way finishes first; counted (load_expired_blocks). lockstep_transfers "
                       "waits for every transfer, so it has none",
    "keep_tiers_on_reset": "true: keep kvtier's tiers when vLLM resets the connector's cache (vLLM's sleep at "
                           "level 1 or 2, pause with clear_cache, reset_prefix_cache with reset_connector), for an "
                           "engine that sleeps to lend its accelerator and wakes with the same weights; DRAM is "
                           "then written through (exclusive_dram off; refused if set). Default false: vLLM resets "
                           "it after a weight update too, and KV of other weights would be served as if right",
    "gil_switch_interval_us": "the Python thread switch interval kvtier sets in the engine's processes (microseconds, "
                              "default 500; 0 leaves Python's 5 ms; only ever lowered). While requests wait on "
                              "loads, vLLM's engine thread runs its loop without a pause, holding the GIL, and each "
                              "time a kvtier copy thread gave the GIL up (an LMDB read, a C copy) it waited a whole "
                              "interval to get it back: an SSD load of 16 MiB took about 4x longer",
    "side_stream": "false: queue the accelerator copies on the engine's stream instead of a stream of kvtier's own",
    "record_path": "directory to record the served requests in, as AgentX traces that kvtier replay reads "
                   "(no prompt text: lengths and anonymous block ids); off by default",
    "record_max_mib": "recording stops (counted: record_skipped_full) once record_path holds this many MiB of "
                      "traces (default 1024)",
    "copy_threads": "threads that share one DRAM copy of 2 MiB or more, the worker's own included (default 2: "
                    "a second thread of kvtier's C module, awake for 0.5 ms after each copy; 1 keeps every copy "
                    "on one thread, leaving the other cores to a CPU engine's forward)",
    "lockstep_transfers": "true: every transfer a step starts (loads, stores, write-backs) has finished when the "
                          "step reports what finished (get_finished waits for it), so the schedule depends on the "
                          "requests alone, not on thread timing: reproducible runs, the step the replay models. "
                          "Costs the overlap of copies with the forward. Default false",
    "sync_dram_loads": "true (CPU engines): a hit wholly in DRAM loads synchronously, in the step that runs its "
                       "request, before the forward: the request does not wait a scheduler step for its load. "
                       "Other hits load asynchronously as before. Default false",
    "recompute_when_cheaper": "true: per request, recompute a hit instead of loading it when that is faster: a load "
                              "costs its transfer plus one engine step like the running one (vLLM runs a request whose "
                              "KV loads a step later: its fixed cost even while the engine idles), recomputing costs "
                              "its tokens at the engine's prefill rate; both are fitted "
                              "from the engine's own steps as it runs (counted: load_skipped_cheaper). For a model "
                              "whose forward is cheap next to a step's fixed cost. Default false: always load",
    "policy": "eviction policy of the DRAM and SSD tiers (a registered kvtier policy name; default: the placement's)",
    "placement": "placement policy, the same object the replay runs (default: the config file's placement.policy, "
                 "kvtier; lru-dram for write-through LRU with no agent actions; ttl, kvflow, tokencake, ...): see "
                 "kvtier.placement. The file's placement constants apply when this names the file's policy",
    "hbm_hold": "false: never hold a waiting agent's HBM blocks (the placement decides everything else)",
    "hbm_hold_budget_fraction": "most of vLLM's HBM blocks held for waiting agents at once (default 0.5)",
    "hbm_hold_tenant_fraction": "most of that hold budget one tenant's agents may hold at once (default 1.0). A "
                                "request's tenant is kvtier_tenant in its kv_transfer_params (set it in a trusted "
                                "gateway, not by the client); requests without one are one tenant",
    "max_tracked_agents_per_tenant": "most waiting agents of one tenant whose contexts the scheduler remembers, "
                                     "and most of its agents' finished contexts kept for tool calls a hint server "
                                     "announces (default 4096, the total; a tenant over it forgets its own oldest)",
    "exclusive_dram": "true: DRAM holds what HBM does not, for a placement that asks for it (kvtier, "
                      "lmcache-lazy): a block is copied down when vLLM hands its HBM slot to another request "
                      "(BlockPool.unpin_blocks' on_reuse), before the forward that overwrites it, and a load out "
                      "of DRAM moves the block. "
                      "Default: on where it is built (DRAM on, one KV cache group, such a placement, no approximate "
                      "reuse), else off; false: every computed block is written through",
    "tenant": "cache salt: tenants never share blocks",
    "stats_path": "JSON file the scheduler side rewrites with its counters (for operators and tests): at most every "
                  "0.25 s while requests run, at once when none does",
    "hint_server": "host:port or unix:PATH: host kvtier's hint server (gRPC) in the scheduler process; "
                   "agents' tool calls announced there start their wait, and its DAG gives their criticality",
    "hint_watch": "host:port or unix:PATH of a separate hint server (kvtier serve): follow its agents' tool calls, "
                  "criticality and ends (HintService.Watch) when the server does not run in this process",
    "hint_watch_token": "bearer token for hint_watch (the server's auth; the view is of that token's tenant)",
    "hint_server_token_file": "file of 'TENANT TOKEN' lines (as kvtier serve --token-file): the hosted hint server "
                              "requires one of these bearer tokens (needed to listen beyond loopback); the "
                              "request-stream middleware sends the first",
    "remote_master": "host:port of a Mooncake Store master (mooncake_master --rpc_port): turns on the remote tier, "
                     "a store engines share, read and written after DRAM and SSD; off by default",
    "remote_metadata_server": "the store's HTTP metadata server (default http://<master host>:8080/metadata, "
                              "mooncake_master --enable_http_metadata_server=1)",
    "remote_segment_mib": "memory this engine contributes to the shared store (MiB, default 512)",
    "remote_write_queue_mib": "host copies waiting for the remote writer, at most (MiB, default 256): when the store "
                              "falls behind, further remote stores are skipped and counted "
                              "(store_skipped_backpressure_remote)",
    "remote_pin_ttl_s": "blocks of requests tagged with a session and agent are soft-pinned in the store for this "
                        "long (Mooncake evicts them last), so an agent's context outlives its tool call; 0 turns "
                        "it off (default 60)",
    "remote_codec": "value codec in the shared store: raw (default), zstd, bplane-zstd or auto",
    "remote_zstd_level": "zstd level of the zstd and bplane-zstd codecs in the shared store (1..22, default 1)",
    "remote_buffer_mib": "host buffer the store client reads and writes values through (MiB, at least 1; default "
                         "128, or remote_segment_mib when that is smaller)",
    "remote_lookup_wait_ms": "how long a scheduling step waits for the store's answer about a new request's blocks "
                             "(default 5; a step waits 4 times that at most in all, whatever the number of new "
                             "requests); a slower answer is taken up by a later step (the request waits, nothing "
                             "else does)",
    "cold_codec": "rq4 or rq3: blocks of requests whose announced tool wait (kvtier_tool_wait_s) is at least "
                  "cold_after_s go to the SSD and remote tiers with this lossy codec (about 3.8x / 5x smaller), "
                  "others with the tier's exact codec; DRAM stays exact. A block loaded from a lossy value is "
                  "never written to any tier again. Off by default",
    "cold_after_s": "the tool wait (seconds, default 30) from which cold_codec applies",
    "approximate_shifted_segments": "true: APPROXIMATE reuse. A request's declared shared segments "
                                    "(kvtier_approximate_segments, see kvtier.sdk.handles.approximate_segments) are "
                                    "served from a copy another approximate request computed, at another offset "
                                    "after another prefix, keys re-rotated, not recomputed: not the KV the prompt "
                                    "would produce. Only for requests whose cache_salt ends in the approximate "
                                    "marker; their blocks are keyed apart, so other requests never load them. "
                                    "Off by default",
    "allow_untested_vllm": "true: start on a vLLM outside the tested range (see kvtier_vllm.version)",
}
"""Every key the connector reads from ``kv_connector_extra_config``."""


@dataclass(frozen=True, slots=True)
class EngineFacts:
    """What the engine fixes about one rank's KV cache."""

    model: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    arrangement: str
    hash_algo: str
    tp_rank: int = 0
    tp_size: int = 1
    rope: tuple[float, int] | None = None  # (theta, rotary dim) of plain NeoX RoPE on every layer's keys
    rope_problem: str = "unknown"  # why ``rope`` is None
    page_bytes: int = 0  # the engine's bytes of one block of one layer (0: not given)
    # per KV cache group (vLLM's hybrid KV cache manager): 0 for full attention, else how many blocks
    # before a reuse point its sliding window reads (vLLM's own rule: ceil((window - 1) / block_size))
    window_blocks: tuple[int, ...] = (0,)
    device_type: str = "unknown"  # vLLM's platform device type: cpu, cuda, npu, ...

    @property
    def hybrid(self) -> bool:
        """Several KV cache groups (full attention beside sliding-window groups)."""
        return len(self.window_blocks) > 1

    @property
    def replicated(self) -> bool:
        """Every TP rank holds the same KV (MLA's latent has no heads to split):
        blocks are keyed without the rank, and one rank writes the shared tiers."""
        return self.arrangement == "mla"

    @property
    def writes_shared_tiers(self) -> bool:
        """This rank writes the tiers ranks share (SSD directory, remote store):
        every rank its own shard, or rank 0 alone for replicated KV."""
        return not self.replicated or self.tp_rank == 0


# connector key -> the field of tiers.remote it sets (MiB keys: bytes)
_REMOTE_TIER_KEYS = {"remote_master": "master", "remote_metadata_server": "metadata_server",
                     "remote_segment_mib": "segment_bytes", "remote_buffer_mib": "buffer_bytes",
                     "remote_codec": "codec", "remote_zstd_level": "zstd_level"}


@dataclass(frozen=True, slots=True)
class RemoteSettings:
    """Where the remote tier (a Mooncake Store shared by engines) is, and its bounds.

    ``tier`` is the store client's own settings, validated once, by
    :class:`~kvtier.config.RemoteTierConfig` (the same class ``tiers.remote``
    of a config file builds, so the connector and :class:`~kvtier.store.TieredStore`
    open the store alike); the rest is what only the connector has."""

    tier: RemoteTierConfig
    write_queue_bytes: int = 256 << 20
    lookup_wait_s: float = 0.005
    pin_ttl_s: float = 60.0

    @property
    def master(self) -> str:
        return self.tier.master

    @property
    def metadata_server(self) -> str:
        return self.tier.resolved_metadata_server()

    @property
    def segment_bytes(self) -> int:
        return self.tier.segment_bytes

    @property
    def codec(self) -> str:
        return self.tier.codec

    @classmethod
    def build(cls, extra: Mapping[str, Any]) -> RemoteSettings | None:
        """The ``remote_*`` keys of ``extra``; ``None`` without ``remote_master``."""
        master = extra.get("remote_master")
        others = sorted(k for k in extra if k.startswith("remote_") and k != "remote_master")
        if master is None:
            if others:
                raise ConfigError(f"kv_connector_extra_config.{others[0]}", extra[others[0]],
                                  "needs remote_master (the remote tier is off without it)")
            return None
        if not isinstance(master, str):
            raise ConfigError("kv_connector_extra_config.remote_master", master, "must be host:port")
        fields: dict[str, Any] = {"enabled": True}
        for key, name in _REMOTE_TIER_KEYS.items():
            if key in extra:
                fields[name] = _mib_bytes(extra, key, 0) if key.endswith("_mib") else extra[key]
        fields.setdefault("buffer_bytes", min(fields.get("segment_bytes", 512 << 20), 128 << 20))
        try:
            tier = RemoteTierConfig(**fields)
        except ConfigError as err:  # type, range and choice, checked once; named by the connector's key
            key = next(k for k, v in _REMOTE_TIER_KEYS.items() if err.setting == f"tiers.remote.{v}")
            problem = ("must be at least 1 MiB" if key.endswith("_mib") else
                       "must be host:port" if key == "remote_master" else err.problem)
            raise ConfigError(f"kv_connector_extra_config.{key}", extra.get(key), problem) from None
        wait_ms = extra.get("remote_lookup_wait_ms", 5)
        if isinstance(wait_ms, bool) or not isinstance(wait_ms, (int, float)) or not 0 <= wait_ms <= 1000:
            raise ConfigError("kv_connector_extra_config.remote_lookup_wait_ms", wait_ms,
                              "must be a number of milliseconds in [0, 1000]")
        pin = extra.get("remote_pin_ttl_s", 60.0)
        if isinstance(pin, bool) or not isinstance(pin, (int, float)) or not 0 <= pin <= 86400:
            raise ConfigError("kv_connector_extra_config.remote_pin_ttl_s", pin, "must be seconds in [0, 86400]")
        return cls(tier, _mib_bytes(extra, "remote_write_queue_mib", 256), wait_ms / 1000, float(pin))


@dataclass(frozen=True, slots=True)
class ConnectorSettings:
    """The validated configuration of one connector instance."""

    config: KVTierConfig
    stats_path: str | None
    hint_server: str | None
    ssd_root: Path | None
    placement: str = "kvtier"
    hbm_hold: bool = True
    hbm_hold_budget_fraction: float = 0.5
    exclusive_dram: bool = False
    eviction_set: bool = False  # the host tiers' eviction policy was set (else the placement's)
    hint_watch: str | None = None
    hint_watch_token: str | None = None
    ssd_write_queue_bytes: int = 256 << 20
    staging_bytes: int = 1024 << 20
    copy_threads: int = 2
    device_staging_bytes: int = 64 << 20
    side_stream: bool = True
    record_path: str | None = None
    record_max_bytes: int = 1 << 30
    placement_params: Mapping[str, float] = field(default_factory=dict)
    remote: RemoteSettings | None = None
    cold: ColdCodecRule | None = None
    approximate_rope: tuple[float, int] | None = None  # approximate_shifted_segments on: the RoPE to re-rotate by
    lockstep_transfers: bool = False
    hold_tenant_fraction: float = 1.0
    tracked_agents_per_tenant: int = MAX_TRACKED_AGENTS
    hint_server_tokens: Mapping[str, str] | None = None  # token -> tenant (hint_server_token_file)
    recompute_when_cheaper: bool = False
    sync_dram_loads: bool = False
    load_deadline_s: float = 30.0
    gil_switch_interval_us: int = 500
    keep_tiers_on_reset: bool = False

    @classmethod
    def build(
        cls, extra: Mapping[str, Any] | None, facts: EngineFacts, env: Mapping[str, str] | None = None
    ) -> ConnectorSettings:
        """Validate ``extra`` (unknown keys raise, naming the valid ones) and merge
        it over the config file and ``KVTIER_*`` variables of ``env``."""
        extra = dict(extra or {})
        unknown = sorted(set(extra) - set(EXTRA_KEYS))
        if unknown:
            raise ConfigError(
                f"kv_connector_extra_config.{unknown[0]}", extra[unknown[0]],
                f"unknown key; valid keys: {', '.join(sorted(EXTRA_KEYS))}",
            )
        env = os.environ if env is None else env
        overrides = _overrides(extra, facts)
        cfg = _host_tiers_config(extra, overrides, env)
        placement = extra.get("placement", cfg.placement.policy)
        # the config file's constants belong to its policy (kvtier tune writes both)
        placement_params = cfg.placement.params() if placement == cfg.placement.policy else {}
        policy = _check_placement(placement, placement_params)
        budget = extra.get("hbm_hold_budget_fraction", 0.5)
        if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0 <= budget <= 1:
            raise ConfigError("kv_connector_extra_config.hbm_hold_budget_fraction", budget, "must be a number in [0, 1]")
        tenant_share, tracked = _tenant_bounds(extra)
        eviction_set = "policy" in extra or any(
            "policy" in (overrides["tiers"].get(t) or {}) for t in ("dram", "ssd"))
        watch, tokens = _hint_settings(extra)
        copy_threads = extra.get("copy_threads", 2)
        if isinstance(copy_threads, bool) or not isinstance(copy_threads, int) or not 1 <= copy_threads <= 64:
            raise ConfigError("kv_connector_extra_config.copy_threads", copy_threads, "must be an integer in 1..64")
        record_path = extra.get("record_path")
        if record_path is not None and (not isinstance(record_path, str) or not record_path):
            raise ConfigError("kv_connector_extra_config.record_path", record_path, "must be a directory path")
        remote = RemoteSettings.build(extra)
        approximate = _flag(extra, "approximate_shifted_segments", False)
        keep = _flag(extra, "keep_tiers_on_reset", False)
        exclusive = _exclusive_dram(extra, cfg, facts, policy, approximate, keep)
        _refuse_unbuilt(facts, env, remote, approximate, exclusive, policy, placement)
        return cls(cfg, extra.get("stats_path"), extra.get("hint_server"),
                   cfg.ssd.resolved_path() if cfg.ssd.enabled else None, placement, _flag(extra, "hbm_hold", True),
                   float(budget), exclusive, eviction_set, watch, extra.get("hint_watch_token"),
                   _mib_bytes(extra, "ssd_write_queue_mib", 256), _mib_bytes(extra, "staging_mib", 1024),
                   copy_threads, _mib_bytes(extra, "device_staging_mib", 64), _flag(extra, "side_stream", True),
                   record_path, _mib_bytes(extra, "record_max_mib", 1024), placement_params, remote,
                   _cold_rule(extra, cfg), facts.rope if approximate else None,
                   _flag(extra, "lockstep_transfers", False), tenant_share, tracked, tokens,
                   _flag(extra, "recompute_when_cheaper", False), _sync_loads(extra, facts, cfg),
                   _load_deadline(extra), _switch_interval(extra), keep)

    def rank_ssd_path(self, tp_rank: int, tp_size: int) -> Path | None:
        """The LMDB directory of one TP rank (each rank stores its own shard)."""
        return None if self.ssd_root is None else self.ssd_root / f"tp{tp_rank}-of-{tp_size}"


def _load_deadline(extra: Mapping[str, Any]) -> float:
    value = extra.get("load_deadline_s", 30.0)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 3600:
        raise ConfigError("kv_connector_extra_config.load_deadline_s", value,
                          "must be seconds in [0, 3600] (0: no deadline)")
    return float(value)


def _switch_interval(extra: Mapping[str, Any]) -> int:
    value = extra.get("gil_switch_interval_us", 500)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 100_000:
        raise ConfigError("kv_connector_extra_config.gil_switch_interval_us", value,
                          "must be whole microseconds in [0, 100000] (0: leave Python's)")
    return value


def _overrides(extra: Mapping[str, Any], facts: EngineFacts) -> dict[str, Any]:
    """The kvtier settings the extra config and the engine's facts set: host tiers (the
    engine's own block pool is the HBM tier), the layout, and the namespace."""
    overrides: dict[str, Any] = _nested_copy(extra.get("kvtier") or {})
    tiers = overrides.setdefault("tiers", {})
    for name in ("hbm", "dram", "ssd"):
        tiers.setdefault(name, {})
    tiers["hbm"]["enabled"] = False
    if "dram_capacity_blocks" in extra:
        cap = extra["dram_capacity_blocks"]
        tiers["dram"].update(capacity_blocks=cap, enabled=bool(cap))
    if extra.get("ssd_path"):
        tiers["ssd"].update(enabled=True, path=str(extra["ssd_path"]))
    if "ssd_capacity_blocks" in extra:
        tiers["ssd"]["capacity_blocks"] = extra["ssd_capacity_blocks"]
    if "policy" in extra:
        tiers["dram"]["policy"] = tiers["ssd"]["policy"] = extra["policy"]
    overrides["layout"] = {
        "num_layers": facts.num_layers, "num_kv_heads": facts.num_kv_heads, "head_dim": facts.head_dim,
        "dtype": facts.dtype, "block_size": facts.block_size, "arrangement": facts.arrangement,
    }
    namespace = overrides.setdefault("namespace", {})
    namespace["model"] = f"{facts.model}|vllm-hash={facts.hash_algo}"
    if "tenant" in extra:
        namespace["tenant"] = str(extra["tenant"])
    # replicated KV (MLA): every rank keys the same blocks, in one SSD directory (tp0-of-1)
    namespace.update(tp_rank=0, tp_size=1) if facts.replicated else namespace.update(
        tp_rank=facts.tp_rank, tp_size=facts.tp_size)
    return overrides


def _host_tiers_config(extra: Mapping[str, Any], overrides: dict[str, Any], env: Mapping[str, str]) -> KVTierConfig:
    """The validated config over the config file and ``env``: stores go to the first host
    tier enabled, written through to the other."""
    tiers = overrides["tiers"]
    # first pass with the HBM tier on, only to learn which host tiers the file enables
    tiers["hbm"]["enabled"] = True
    first = load_config(extra.get("config_file"), env=env, overrides=overrides)
    tiers["hbm"]["enabled"] = False
    host_tiers = [t for t in first.enabled_tiers if t != "hbm"]
    if not host_tiers:
        raise ConfigError("kv_connector_extra_config", extra, "enable the DRAM tier or set ssd_path")
    overrides.update(put_tier=host_tiers[0], write_through=True)
    return load_config(extra.get("config_file"), env=env, overrides=overrides)


def _refuse_unbuilt(facts: EngineFacts, env: Mapping[str, str], remote: RemoteSettings | None, approximate: bool,
                    exclusive: bool, policy: Any, placement: str) -> None:
    """A ``ConfigError`` naming the setting for a combination with this engine that is not built."""
    setting = "kv_connector_extra_config."
    if remote is not None and facts.hash_algo.startswith("xxhash") and not env.get("PYTHONHASHSEED"):
        # vLLM then seeds its block hashes per process: no two engines name a block alike
        raise ConfigError(setting + "remote_master", remote.master,
                          f"engines share blocks only under equal block hashes; with prefix_caching_hash_algo="
                          f"{facts.hash_algo} set PYTHONHASHSEED to one value on every engine, or use sha256")
    if facts.hybrid and remote is not None:
        raise ConfigError(setting + "remote_master", remote.master,
                          f"the remote tier does not take a model with {len(facts.window_blocks)} KV cache groups "
                          "(sliding-window hybrid) yet; use the DRAM and SSD tiers")
    if approximate and facts.hybrid:
        raise ConfigError(setting + "approximate_shifted_segments", approximate,
                          "not built for models with several KV cache groups (sliding-window hybrids)")
    if approximate and facts.rope is None:
        raise ConfigError(setting + "approximate_shifted_segments", approximate,
                          f"cannot re-rotate this model's keys: {facts.rope_problem}")
    if exclusive and facts.hybrid:
        raise ConfigError(setting + "exclusive_dram", exclusive,
                          f"not built for models with {len(facts.window_blocks)} KV cache groups (sliding-window "
                          "hybrids) yet: leave it off (write-through)")
    if exclusive and policy.write_back_dram != "evict":
        raise ConfigError(setting + "exclusive_dram", exclusive,
                          f"placement {placement!r} writes DRAM through; exclusive DRAM is for a placement that "
                          "writes a block down as HBM evicts it (kvtier, lmcache-lazy)")


def _sync_loads(extra: Mapping[str, Any], facts: EngineFacts, cfg: KVTierConfig) -> bool:
    """``sync_dram_loads``, where it is built: a CPU engine (the worker's one-pass host copy
    runs on the engine's thread before the forward), one KV cache group, a DRAM tier."""
    sync = _flag(extra, "sync_dram_loads", False)
    problem = ("is built for CPU engines (the KV cache in host memory); on " + facts.device_type + " leave it off"
               if facts.device_type != "cpu" else
               "is not built for models with several KV cache groups (sliding-window hybrids)" if facts.hybrid else
               "needs the DRAM tier (dram_capacity_blocks > 0)" if not cfg.dram.enabled else "")
    if sync and problem:
        raise ConfigError("kv_connector_extra_config.sync_dram_loads", sync, problem)
    return sync


def _flag(extra: Mapping[str, Any], key: str, default: bool) -> bool:
    """A true / false setting, or a ``ConfigError`` naming the key."""
    value = extra.get(key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"kv_connector_extra_config.{key}", value, "must be true or false")
    return value


def _exclusive_dram(extra: Mapping[str, Any], cfg: KVTierConfig, facts: EngineFacts, policy: Any,
                    approximate: bool, keep: bool) -> bool:
    """``exclusive_dram`` as set; left unset, on wherever it is built (the recommended setup, what ``kvtier replay
    --surface vllm`` models): the DRAM tier on, one KV cache group, a placement that writes DRAM as HBM evicts,
    no approximate reuse, and the tiers not kept across a reset (``keep``: a sleep discards the blocks that live
    only in HBM, and vLLM's reset hands their slots out first, whose write-backs would evict DRAM blocks and then
    fail). Set to true where it is not built, it is refused by name (``_refuse_unbuilt``)."""
    if "exclusive_dram" not in extra:
        return cfg.dram.enabled and not facts.hybrid and policy.write_back_dram == "evict" and not approximate \
            and not keep
    exclusive = _flag(extra, "exclusive_dram", False)
    if exclusive and keep:
        raise ConfigError("kv_connector_extra_config.exclusive_dram", exclusive,
                          "cannot be on with keep_tiers_on_reset: blocks kept only in HBM are lost when the engine "
                          "sleeps; write-through (false) keeps every stored block in DRAM")
    if exclusive and not cfg.dram.enabled:
        raise ConfigError("kv_connector_extra_config.exclusive_dram", exclusive,
                          "needs the DRAM tier (dram_capacity_blocks > 0)")
    return exclusive


def _mib_bytes(extra: Mapping[str, Any], key: str, default: float) -> int:
    return int(_mib(extra, key, default) * (1 << 20))


def _cold_rule(extra: Mapping[str, Any], cfg: KVTierConfig) -> ColdCodecRule | None:
    """The ``cold_codec`` rule, refused (naming the key) for a layout it cannot store
    or without a slow tier to write it to."""
    codec = extra.get("cold_codec")
    if codec is None:
        if "cold_after_s" in extra:
            raise ConfigError("kv_connector_extra_config.cold_after_s", extra["cold_after_s"], "needs cold_codec")
        return None
    try:
        rule = ColdCodecRule(codec, extra.get("cold_after_s", 30.0))
    except ConfigError as e:
        raise ConfigError(f"kv_connector_extra_config.{e.setting}", e.value, e.problem) from None
    rule.check_layout(cfg.layout.to_layout(), "kv_connector_extra_config.cold_codec")
    if not cfg.ssd.enabled and extra.get("remote_master") is None:
        raise ConfigError("kv_connector_extra_config.cold_codec", codec, "needs a slow tier: set ssd_path or "
                          "remote_master (the DRAM tier always holds exact bytes)")
    return rule


def _mib(extra: Mapping[str, Any], key: str, default: float) -> float:
    """A size in MiB from ``extra``: a number > 0, or a ``ConfigError`` naming the key."""
    value = extra.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"kv_connector_extra_config.{key}", value, "must be a number > 0 (MiB)")
    return value


def _check_placement(name: Any, params: Mapping[str, float]) -> Any:
    """The placement, if the connector can run it live; a ``ConfigError`` naming the setting otherwise."""
    from kvtier.placement import make_placement

    setting = "kv_connector_extra_config.placement"
    if not isinstance(name, str):
        raise ConfigError(setting, name, "must be a placement policy name")
    policy = make_placement(name, setting, params)
    if policy.needs_oracle:
        raise ConfigError(setting, name, "needs the future (an offline bound): replay only")
    if policy.replay_only:
        raise ConfigError(setting, name, f"replay only ({policy.replay_only})")
    if not policy.lower_tiers:
        raise ConfigError(setting, name, "uses no host tier: run vLLM without the connector for HBM-only caching")
    return policy


def _nested_copy(data: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _nested_copy(v) if isinstance(v, Mapping) else v for k, v in data.items()}


def _hint_settings(extra: Mapping[str, Any]) -> tuple[str | None, dict[str, str] | None]:
    """``hint_watch`` and the hosted server's tokens (``hint_server_token_file``, read), checked."""
    watch = extra.get("hint_watch")
    if watch is not None and (not isinstance(watch, str) or not watch):
        raise ConfigError("kv_connector_extra_config.hint_watch", watch, "must be host:port or unix:PATH")
    if watch and extra.get("hint_server"):
        raise ConfigError("kv_connector_extra_config.hint_watch", watch,
                          "give hint_server (host it here) or hint_watch (follow one elsewhere), not both")
    hosted, path = extra.get("hint_server"), extra.get("hint_server_token_file")
    if path is None:
        if isinstance(hosted, str) and hosted:
            from kvtier.hints.server import is_local_address

            if not is_local_address(hosted):
                raise ConfigError("kv_connector_extra_config.hint_server", hosted,
                                  "listens beyond loopback: give hint_server_token_file (clients must present a "
                                  "token), or listen on 127.0.0.1 / a unix socket")
        return watch, None
    key = "kv_connector_extra_config.hint_server_token_file"
    if not hosted:
        raise ConfigError(key, path, "needs hint_server (the tokens are the hosted hint server's)")
    if not isinstance(path, str) or not path:
        raise ConfigError(key, path, "must be the path of a file of 'TENANT TOKEN' lines")
    from kvtier.hints.server import load_tokens

    try:
        tokens = load_tokens(path)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ConfigError(key, path, f"cannot be read: {exc}") from exc
    if not tokens:
        raise ConfigError(key, path, "has no token (lines 'TENANT TOKEN' or 'TOKEN')")
    return watch, tokens


def _tenant_bounds(extra: Mapping[str, Any]) -> tuple[float, int]:
    """``hbm_hold_tenant_fraction`` and ``max_tracked_agents_per_tenant``, checked."""
    share = extra.get("hbm_hold_tenant_fraction", 1.0)
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1:
        raise ConfigError("kv_connector_extra_config.hbm_hold_tenant_fraction", share, "must be a number in (0, 1]")
    tracked = extra.get("max_tracked_agents_per_tenant", MAX_TRACKED_AGENTS)
    if isinstance(tracked, bool) or not isinstance(tracked, int) or not 1 <= tracked <= MAX_TRACKED_AGENTS:
        raise ConfigError("kv_connector_extra_config.max_tracked_agents_per_tenant", tracked,
                          f"must be an integer in 1..{MAX_TRACKED_AGENTS}")
    return float(share), tracked
