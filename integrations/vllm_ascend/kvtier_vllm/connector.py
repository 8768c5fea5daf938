"""``KVTierConnector``: kvtier as a vLLM / vLLM-Ascend ``KVConnectorBase_V1``.

Owns: translating vLLM's connector calls into the two halves —
:class:`~.scheduler.KVTierScheduler` in the scheduler process and
:class:`~.worker.KVTierWorker` in each worker — and reading the engine facts
(layers, heads, dtype, block size, TP rank) that fix kvtier's layout and
namespace. Must not hold logic of its own beyond that glue.

What vLLM 0.32 lets a connector do (and what this one does):

* ``get_num_new_matched_tokens`` / ``update_state_after_alloc`` /
  ``build_connector_meta``: external prefix hits, loaded asynchronously
  (the request waits in ``WAITING_FOR_REMOTE_KVS``; no forward step waits).
* ``get_block_ids_with_load_errors``: blocks that did not load or verify are
  recomputed by the engine.
* ``request_finished`` returning True keeps a finished request's blocks
  until ``get_finished`` reports it: only while a store still reads them.
* ``bind_kv_cache_manager`` / ``bind_gpu_block_pool`` / ``on_new_request``:
  used to read a request's block ids, record a request's session, agent and
  hints, and let the placement policy hold a waiting agent's HBM blocks
  through the block pool's public ``touch`` / ``free_blocks`` (see
  :mod:`.placement`; vLLM's free queue itself is never reordered).
* ``take_events``: with vLLM's KV events enabled, blocks stored into and
  removed from kvtier's DRAM (medium ``CPU``) and SSD (``STORAGE``), and
  blocks written to the remote store (``STORAGE``, locality ``REMOTE``), so a
  KV-aware router that subscribes to vLLM's events sees kvtier's tiers.
"""

from __future__ import annotations

import functools
import logging
import sys
import time
from dataclasses import dataclass, field
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from vllm.config import VllmConfig
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.outputs import KVConnectorOutput

from kvtier.kvevents.wire import TIER_TO_MEDIUM
from kvtier.layout import KVLayout

from .metadata import KVTierConnectorMetadata, KVTierWorkerMetadata
from .scheduler import KVTierScheduler
from .settings import ConnectorSettings, EngineFacts
from .version import ALLOW_KEY, check_vllm_version
from .worker import KVTierWorker

if TYPE_CHECKING:
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

# vLLM names no source for a store shared by engines; its fallback covers "uninstrumented connector or remote store"
_TIER_SOURCE = {"dram": CacheHitSource.HOST, "ssd": CacheHitSource.DISK, "remote": CacheHitSource.EXTERNAL_UNSPECIFIED}


@dataclass
class KVTierConnectorStats(KVConnectorStats):
    """Counter increments (tokens, blocks) since the last report; sums on aggregate."""

    data: dict[str, Any] = field(default_factory=dict)

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVTierConnectorStats:
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


def _timed(method):
    """Count the engine-thread CPU time spent in a connector hook (``hook_cpu_us`` in the
    scheduler's counters, or in the worker's transfer CPU time): the connector's own cost."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        start = time.thread_time()
        try:
            return method(self, *args, **kwargs)
        finally:
            used_us = int((time.thread_time() - start) * 1e6)
            if self._sched is not None:
                self._sched.counters["hook_cpu_us"] += used_us
            elif self._worker is not None:
                self._worker.add_hook_cpu_us(used_us)

    return wrapper


def engine_facts(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, tp_rank: int) -> EngineFacts:
    """Layout facts of one rank's KV cache. Raises ``ValueError``, naming the
    layer type and what to do instead, for KV caches the connector does not
    handle (see :func:`spec_problem`).

    MLA (DeepSeek-V2/V3/R1, Kimi K2): one latent per token and layer
    (``kv_lora_rank + qk_rope_head_dim`` wide, no heads), stored as the engine
    lays it out (arrangement ``mla``). Every TP rank holds the same latent, so
    the namespace carries no TP rank: all ranks key the same blocks, one SSD
    directory and one remote copy serve them all, and only rank 0 writes those
    shared tiers (see :attr:`EngineFacts.replicated`)."""
    groups = kv_cache_config.kv_cache_groups
    for group in groups:
        problem = spec_problem(group.kv_cache_spec, vllm_config)
        if problem:
            raise ValueError(f"kvtier: {problem}")
    specs = [g.kv_cache_spec for g in groups]
    full = [s for s in specs if type(s).__name__ != "SlidingWindowSpec"]
    if not full:
        raise ValueError("kvtier: the model has sliding-window KV cache groups only; kvtier keys its blocks by the "
                         "full-attention prefix, so serve it without the kvtier connector")
    spec = full[0]
    shapes = {(s.block_size, s.num_kv_heads, s.head_size, s.dtype, s.page_size_bytes) for s in specs}
    if len(shapes) != 1:
        raise ValueError(f"kvtier: the model's {len(groups)} KV cache groups differ in block size, heads, head size or "
                         f"dtype ({sorted(map(str, shapes))}); kvtier stores one block shape")
    window = tuple(0 if type(s).__name__ != "SlidingWindowSpec" else -(-(s.sliding_window - 1) // s.block_size)
                   for s in specs)
    from vllm.platforms import current_platform

    from .rerotate import rope_of

    mla = type(spec).__name__ == "MLAAttentionSpec"
    extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
    if mla:
        rope: Any = "MLA latents hold the rotated part of the key beside the compressed one; re-rotating them is " \
                    "not built"
    elif extra.get("approximate_shifted_segments") is True:
        rope = rope_of(vllm_config.model_config.hf_config, spec.head_size)
    else:
        rope = "approximate_shifted_segments is off"
    return EngineFacts(
        model=str(vllm_config.model_config.model),
        dtype=str(spec.dtype).removeprefix("torch."),
        block_size=spec.block_size,
        # hybrid groups alias one set of tensors (a block id belongs to one group at a time): a block's
        # bytes are the largest group's layers, whichever group holds it
        num_layers=max(len(g.layer_names) for g in groups),
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_size,
        arrangement="mla" if mla else "split" if current_platform.device_type == "npu" else "fused",
        hash_algo=str(vllm_config.cache_config.prefix_caching_hash_algo),
        tp_rank=tp_rank,
        tp_size=vllm_config.parallel_config.tensor_parallel_size,
        rope=None if isinstance(rope, str) else (rope.theta, rope.rotary_dim),
        rope_problem=rope if isinstance(rope, str) else "",
        page_bytes=spec.page_size_bytes,
        window_blocks=window,
        device_type=str(current_platform.device_type),
    )


def _lower_switch_interval(us: int) -> None:
    """``gil_switch_interval_us`` (see its help): lower this process's thread switch interval to ``us``,
    never raise it (another part of the process may have set it lower); 0 leaves it."""
    if us and sys.getswitchinterval() > us / 1e6:
        log.info("kvtier: Python thread switch interval %.1f ms -> %d us (gil_switch_interval_us)",
                 sys.getswitchinterval() * 1e3, us)
        sys.setswitchinterval(us / 1e6)


def spec_problem(spec: Any, vllm_config: VllmConfig) -> str:
    """Why the connector cannot store a KV cache group of ``spec`` ('' when it can):
    a sentence naming the layer type and what to do instead."""
    kind = type(spec).__name__
    if "Mamba" in kind:
        mamba_type = getattr(getattr(spec, "mamba_type", None), "name", "unknown")
        return (f"layers of type {kind} (mamba_type {mamba_type}: the Mamba, linear-attention or short-conv layers "
                "of Granite-4.0-H, NemotronH, Falcon-H1, Jamba, Qwen3-Next, LFM2) keep one recurrent state per "
                "request, not KV per token block, and kvtier does not store that state (vLLM 0.32 shows it to a "
                "connector only with prefix caching on, mamba_cache_mode 'align'; this group's is "
                f"{getattr(spec, 'mamba_cache_mode', 'none')!r}); serve this model without the kvtier connector "
                "(on a GPU, vLLM's own OffloadingConnector, --kv-offloading-size, offloads the state)")
    if kind == "MLAAttentionSpec":
        if getattr(spec, "page_size_padded", None) is not None or getattr(spec, "model_version", None):
            return (f"MLA layers with padded pages or a versioned sparse cache ({kind}, model_version="
                    f"{getattr(spec, 'model_version', None)!r}, e.g. DeepSeek-V4) are not supported; only the plain "
                    "DeepSeek-V2/V3/R1 latent is: serve this model without the kvtier connector")
        if getattr(spec, "tokens_per_state", 1) != 1:
            return f"MLA layers that compress several tokens into one state ({kind}) are not supported"
        if spec.dcp_sharded and vllm_config.parallel_config.decode_context_parallel_size > 1:
            return ("MLA with decode context parallelism (decode_context_parallel_size="
                    f"{vllm_config.parallel_config.decode_context_parallel_size}) splits each block's tokens across "
                    "ranks; kvtier stores whole blocks: run with decode_context_parallel_size 1")
        return ""
    if kind == "SlidingWindowSpec":
        if getattr(spec, "extra_retained_tokens", 0):
            return f"{kind} with extra retained tokens (multi-module speculative decoding) is not supported"
        return ""
    if kind == "CrossAttentionSpec":
        return (f"cross-attention layers ({kind}: encoder-decoder models such as Whisper) cache the encoder's "
                "output, which depends on the audio or image input and not on the token prefix kvtier keys "
                "blocks by; serve this model without the kvtier connector")
    if kind != "FullAttentionSpec":
        return (f"KV cache spec {kind} is not supported: kvtier stores full-attention, MLA and sliding-window KV "
                "keyed by the token prefix; serve this model without the kvtier connector")
    if getattr(spec, "head_size_v", spec.head_size) != spec.head_size:
        return f"{kind} with K and V of different widths ({spec.head_size} and {spec.head_size_v}) is not supported"
    return ""


class KVTierConnector(KVConnectorBase_V1, SupportsHMA):
    """kvtier's DRAM + SSD tiers behind vLLM's prefix cache (the HBM tier).

    Hybrid models (``SupportsHMA``: vLLM keeps its hybrid KV cache manager on,
    so sliding-window layers hold only their window in HBM): each KV cache
    group is stored and loaded under keys of its own; a sliding-window group
    only the blocks its window reads before each point a step's computation
    reached (``store_window_skipped_blocks``, ``load_window_skipped_blocks``
    count what that saves). A hit needs every full-attention group's prefix
    and every window before the hit point. vLLM cannot map a failed block of
    a multi-group load back to a position, so a failed load fails its request
    (``failed_recving``), which vLLM recomputes in full.

    ``kv_connector_extra_config`` keys: see :data:`kvtier_vllm.settings.EXTRA_KEYS`.
    """

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped store is a later miss

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        check_vllm_version(allow_untested=extra.pop(ALLOW_KEY, False) is True)
        tp_rank = 0
        if role == KVConnectorRole.WORKER:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            tp_rank = get_tensor_model_parallel_rank()
        facts = engine_facts(vllm_config, kv_cache_config, tp_rank)
        settings = ConnectorSettings.build(extra, facts)
        _lower_switch_interval(settings.gil_switch_interval_us)
        namespace = settings.config.namespace.to_namespace(settings.config.layout.to_layout())
        self._sched: KVTierScheduler | None = None
        self._worker: KVTierWorker | None = None
        self._last_counters: dict[str, int] = {}
        if role == KVConnectorRole.SCHEDULER:
            if self._kv_transfer_config.kv_load_failure_policy != "recompute":
                # kvtier is a cache: a block that fails to load or verify is a miss, never a failed request.
                # The scheduler reads this setting after creating its connector.
                log.info("kvtier: setting kv_load_failure_policy=recompute (failed loads are recomputed)")
                self._kv_transfer_config.kv_load_failure_policy = "recompute"
            world = vllm_config.parallel_config.world_size
            events_cfg = getattr(vllm_config, "kv_events_config", None)
            kv_events = bool(events_cfg is not None and getattr(events_cfg, "enable_kv_cache_events", False))
            self._sched = KVTierScheduler(settings, namespace, facts.block_size, world, kv_events=kv_events,
                                          window_blocks=facts.window_blocks)
            self._sched.write_stats()
            if settings.record_path and not getattr(vllm_config, "shutdown_timeout", 1):
                # vLLM's default --shutdown-timeout 0 kills the engine core at once on stop: the connector's
                # shutdown never runs, and the recording's last flush interval and the final stats are lost
                log.warning("kvtier: record_path is set but vLLM's --shutdown-timeout is 0: a stopped engine is "
                            "killed before kvtier writes the recording's last 10 s out; serve with "
                            "--shutdown-timeout 10 (or more)")
        else:
            layout: KVLayout = settings.config.layout.to_layout()
            self._worker = KVTierWorker(settings, namespace, layout, kv_cache_config.num_blocks,
                                        writes_shared=facts.writes_shared_tiers, hybrid=facts.hybrid)
        log.info("kvtier connector (%s): tiers %s, layout %s", role.name, settings.config.enabled_tiers,
                 settings.config.layout.to_layout().describe())

    # ------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Worker, once: the engine's per-layer caches (tensor, or (K, V) tuple on Ascend)."""
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    @_timed
    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if self._worker is not None and isinstance(kv_connector_metadata, KVTierConnectorMetadata):
            self._worker.handle_preemptions(kv_connector_metadata)

    @_timed
    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Worker, every step: start the step's asynchronous loads (never waits)."""
        assert self._worker is not None
        self._worker.start_load_kv(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are asynchronous and finish before their request runs: nothing to wait for."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        """Stores are queued whole-block in ``wait_for_save``, after the forward."""

    @_timed
    def wait_for_save(self) -> None:
        """Worker, every step after the forward: queue the step's stores (does not wait for them)."""
        assert self._worker is not None
        self._worker.wait_for_save(self._meta())

    @_timed
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Worker, every step: (requests whose kept blocks can be freed, requests whose load finished)."""
        assert self._worker is not None
        sending, recving = self._worker.get_finished(finished_req_ids)
        return sending or None, recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Worker, every step: :meth:`get_finished`, and (hybrid models) requests whose load failed."""
        sending, recving = self.get_finished(finished_req_ids)
        failed = self._worker.take_failed_loads() if self._worker is not None else set()
        return KVConnectorTransferResults(finished_sending=set(sending or ()),
                                          finished_recving=set(recving or ()) | failed, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Worker, every step: engine blocks whose load failed or did not verify (vLLM recomputes them)."""
        return self._worker.take_load_errors() if self._worker is not None else set()

    def build_connector_worker_meta(self) -> KVTierWorkerMetadata | None:
        return self._worker.take_worker_meta() if self._worker is not None else None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._sched is not None:
            self._sched.write_stats()
            self._sched.shutdown()

    # ------------------------------------------------------------ scheduler side

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self._sched is not None:
            self._sched.bind_kv_cache_manager(kv_cache_manager)

    def bind_gpu_block_pool(self, gpu_block_pool: BlockPool) -> None:
        if self._sched is not None:
            self._sched.bind_gpu_block_pool(gpu_block_pool)

    def on_new_request(self, request: Request) -> None:
        if self._sched is not None:
            self._sched.on_new_request(request)

    @_timed
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Scheduler: tokens kvtier can load past the local hit (in-memory index only)."""
        assert self._sched is not None
        return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)

    @_timed
    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self._sched is not None
        groups = blocks.get_block_ids()
        self._sched.update_state_after_alloc(request, groups[0], num_external_tokens, groups)

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        if num_external_tokens == 0 or self._sched is None:
            return {}
        by_tier = self._sched.hit_sources(request)
        out = {_TIER_SOURCE[t]: n for t, n in by_tier.items() if n}
        if sum(out.values()) != num_external_tokens:
            return {CacheHitSource.EXTERNAL_UNSPECIFIED: num_external_tokens}
        return out

    @_timed
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._sched is not None
        return self._sched.build_connector_meta(scheduler_output)

    @_timed
    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self._sched is not None
        meta = connector_output.kv_connector_worker_meta
        self._sched.update_connector_output(meta if isinstance(meta, KVTierWorkerMetadata) else None)
        self._sched.load_finished(connector_output.finished_recving or ())

    @_timed
    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Scheduler, once per request: keep its blocks only while a store still reads them."""
        assert self._sched is not None
        return self._sched.request_finished(request), None

    @_timed
    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """Scheduler, once per request of a hybrid model: as :meth:`request_finished`."""
        assert self._sched is not None
        return self._sched.request_finished(request), None

    def has_pending_push_work(self) -> bool:
        return self._sched is not None and self._sched.has_pending_work()

    def take_events(self) -> Iterable[KVCacheEvent]:
        """Scheduler, each step: KV cache events of kvtier's tiers for vLLM's publisher
        (only with ``--kv-events-config`` enabled): ``BlockStored`` / ``BlockRemoved``
        with medium ``CPU`` (DRAM) or ``STORAGE`` (SSD), locality ``LOCAL``; blocks
        written to the remote store shared by engines are ``STORAGE`` with locality
        ``REMOTE`` (stores only: the store evicts on its own and tells no engine).
        In vLLM's own block hashes; for a hybrid model those of its first full-attention
        KV cache group (``group_idx``), the prefix a router matches."""
        if self._sched is None or not self._sched.kv_events:
            return ()
        out: list[KVCacheEvent] = []
        for kind, tier, block_hash, *rest in self._sched.take_kv_events():
            medium = TIER_TO_MEDIUM[tier]  # vLLM's medium names, as kvtier's own KV-event publisher uses
            locality = "REMOTE" if tier == "remote" else "LOCAL"
            if kind == "removed":
                out.append(BlockRemoved(block_hashes=[maybe_convert_block_hash(block_hash)], medium=medium,
                                        group_idx=self._sched.primary, locality=locality, ownership="kvtier"))
                continue
            parent, token_ids = rest
            out.append(BlockStored(block_hashes=[maybe_convert_block_hash(block_hash)],
                                   parent_block_hash=None if parent is None else maybe_convert_block_hash(parent),
                                   token_ids=token_ids, block_size=len(token_ids), lora_id=None, medium=medium,
                                   lora_name=None, group_idx=self._sched.primary, locality=locality, ownership="kvtier"))
        return out

    def reset_cache(self) -> bool | None:
        return self._sched.reset() if self._sched is not None else None

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """Scheduler: counter increments since the last call (None when nothing changed)."""
        if self._sched is None:
            return None
        now = dict(self._sched.counters)
        delta = {k: v - self._last_counters.get(k, 0) for k, v in now.items() if v != self._last_counters.get(k, 0)}
        self._last_counters = now
        return KVTierConnectorStats(data=delta) if delta else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KVTierConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> Any:
        """kvtier's counters on the engine's ``/metrics`` (see :mod:`.prom`)."""
        from .prom import KVTierPromMetrics

        return KVTierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def stats(self) -> dict[str, Any]:
        """Scheduler: cumulative counters and tier use (also written to ``stats_path``)."""
        return self._sched.stats() if self._sched is not None else {}

    def _meta(self) -> KVTierConnectorMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVTierConnectorMetadata)
        return meta
