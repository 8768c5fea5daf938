"""Messages between the connector's scheduler side and its workers.

Owns: the picklable plans the scheduler sends each step
(:class:`KVTierConnectorMetadata`) and the per-step results workers send back
(:class:`KVTierWorkerMetadata`, merged over TP ranks by vLLM with
``aggregate``). Plain values only: no tensors, no references to engine
objects. Must not decide anything.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata


@dataclass(frozen=True, slots=True)
class LoadJob:
    """Fill engine blocks ``block_ids`` of request ``req_id`` from kvtier.

    ``keys[i]`` is read from ``tiers[i]`` (``dram``, ``ssd`` or ``remote``;
    ``slots[i]`` for DRAM) into ``block_ids[i]``; remote blocks come last. ``block_ids`` beyond ``len(keys)`` had no readable block
    when planned and always fail. ``shifts[i]`` (approximate reuse only; empty
    otherwise): turn block ``i``'s keys by that many positions after reading it. ``sync``: vLLM
    runs the request in this step, so the blocks must be in place before its forward (and the
    request is not reported as received).
    """

    req_id: str
    plan_id: int
    keys: tuple[int, ...]
    tiers: tuple[str, ...]
    slots: tuple[int, ...]
    block_ids: tuple[int, ...]
    shifts: tuple[int, ...] = ()
    sync: bool = False  # synchronous (sync_dram_loads): in the engine blocks before this step's forward


@dataclass(frozen=True, slots=True)
class TierWrite:
    """Part of a store for one tier: ``rows`` index the job's keys. ``pin_ttl_s``
    (remote tier only): soft-pin the values in the store for that long. ``codec``
    (SSD and remote only): write with it instead of the tier's own (cold blocks)."""

    plan_id: int
    tier: str
    rows: tuple[int, ...]
    slots: tuple[int, ...]
    pin_ttl_s: float = 0.0
    codec: str = ""


@dataclass(frozen=True, slots=True)
class StoreJob:
    """Copy engine blocks ``block_ids`` (keys ``keys``, chain parents ``parents``)
    out of the KV cache once this step's forward is done, then write them to
    each tier in ``writes``. ``job_id`` is reported back when the engine
    blocks are no longer needed."""

    job_id: int
    req_id: str
    block_ids: tuple[int, ...]
    keys: tuple[int, ...]
    parents: tuple[int | None, ...]
    writes: tuple[TierWrite, ...]


@dataclass(frozen=True, slots=True)
class PromoteJob:
    """Copy ``keys`` from this rank's SSD tier into its DRAM slots ``slots``
    (a predictive prefetch); reported per block under ``plan_id``."""

    plan_id: int
    keys: tuple[int, ...]
    slots: tuple[int, ...]


@dataclass(slots=True)
class KVTierConnectorMetadata(KVConnectorMetadata):
    """One step's plans. ``release`` lists finished requests whose blocks the
    scheduler kept (``request_finished`` returned True); a worker reports each
    in ``finished_sending`` once it no longer reads their blocks.
    ``ssd_deletes`` are keys the scheduler evicted from the SSD tier.
    ``write_backs`` (exclusive DRAM): blocks whose engine slot vLLM handed to
    another request this step, copied out *before* this step's forward (which
    overwrites them) and written to DRAM; no request owns them."""

    loads: list[LoadJob] = field(default_factory=list)
    stores: list[StoreJob] = field(default_factory=list)
    release: list[str] = field(default_factory=list)
    ssd_deletes: list[int] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    promotions: list[PromoteJob] = field(default_factory=list)
    write_backs: list[StoreJob] = field(default_factory=list)


@dataclass(slots=True)
class KVTierWorkerMetadata(KVConnectorWorkerMetadata):
    """Results finished since the last step. ``plans`` maps a plan id to
    (ranks reporting, per-block ok) — ok only where every reporting rank
    succeeded; ``gathered`` maps a store job id to ranks that finished reading
    its engine blocks; ``busy_us`` is the CPU time of the workers' background threads."""

    plans: dict[int, tuple[int, list[bool]]] = field(default_factory=dict)
    gathered: dict[int, int] = field(default_factory=dict)
    busy_us: int = 0  # CPU time of the workers' connector hooks and background threads (summed over ranks)
    skipped_blocks: int = 0  # SSD stores skipped because the SSD writer fell behind (summed over ranks)
    staging_skipped_stores: int = 0  # blocks not stored: the staging ring was full (summed over ranks)
    staging_skipped_loads: int = 0  # blocks not loaded (recomputed): the staging ring was full
    remote_skipped_blocks: int = 0  # remote stores skipped because the remote writer fell behind
    remote_outcomes: dict[str, int] = field(default_factory=dict)  # the store clients' failed reads, errors, pins
    write_backs_missed: int = 0  # write-back blocks failed: the engine called no handle_preemptions before its forward
    expired_plans: list[int] = field(default_factory=list)  # loads past load_deadline_s, reported failed (recomputed)

    def reports_anything(self) -> bool:
        """Whether this step has a result or a counter to report (else no metadata is sent)."""
        return bool(self.plans or self.gathered or self.busy_us or self.skipped_blocks or self.remote_skipped_blocks
                    or self.remote_outcomes or self.staging_skipped_stores or self.staging_skipped_loads
                    or self.write_backs_missed or self.expired_plans)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVTierWorkerMetadata:
        assert isinstance(other, KVTierWorkerMetadata)
        plans = dict(self.plans)
        for plan_id, (n, oks) in other.plans.items():
            if plan_id in plans:
                m, mine = plans[plan_id]
                plans[plan_id] = (m + n, [a and b for a, b in zip(mine, oks)])
            else:
                plans[plan_id] = (n, list(oks))
        gathered = dict(self.gathered)
        for job_id, n in other.gathered.items():
            gathered[job_id] = gathered.get(job_id, 0) + n
        return KVTierWorkerMetadata(plans, gathered, self.busy_us + other.busy_us,
                                    self.skipped_blocks + other.skipped_blocks,
                                    self.staging_skipped_stores + other.staging_skipped_stores,
                                    self.staging_skipped_loads + other.staging_skipped_loads,
                                    self.remote_skipped_blocks + other.remote_skipped_blocks,
                                    dict(Counter(self.remote_outcomes) + Counter(other.remote_outcomes)),
                                    self.write_backs_missed + other.write_backs_missed,
                                    self.expired_plans + other.expired_plans)
