"""Remote tier: KV blocks in a distributed store that several engines share.

Owns: :class:`RemoteTier`, the interface a shared store implements for
kvtier (the shape of :class:`~kvtier.tiers.ssd.SSDTier`: ``put_many``,
``get_many_into``, ``contains_many``, ``delete_many``, ``close``, so a store
or connector can put it after DRAM and SSD), and :class:`MooncakeTier`, its
implementation on Mooncake Store (``mooncake.store.MooncakeDistributedStore``,
the store vLLM-Ascend and SGLang HiCache deployments run; PyPI
``mooncake-transfer-engine-non-cuda`` on a machine without CUDA).

Guarantees, the SSD tier's:

* Each block is stored as the SSD tier's value (:mod:`kvtier.tiers.codec`): a
  checksummed header bound to the block key, namespace and layout, then the
  payload. A missing, truncated, bit-flipped, foreign or misplaced value is a
  miss, counted by outcome in :attr:`MooncakeTier.counters`, never bytes.
* A block is visible only once complete: Mooncake makes an object readable
  when its put has finished, and a half-written value would fail its
  checksum anyway.
* Namespaces never collide: the object name carries the namespace digest
  (model, dtype, layout, block size, TP/PP rank, tenant), and the header is
  checked against it on every read.
* A store that is down or unreachable makes reads misses and writes failures
  (counted in ``remote_errors``); nothing raises into an engine's step. While
  the master is unreachable each call of Mooncake's client waits seconds for it
  (4-9 s measured), so after one call that failed slowly (or with ``RPC_FAIL``)
  the tier counts the store as down (``client_down``): every call fails at once
  (``client_down_skips``) while a thread of its own probes the store every
  ``DOWN_PROBE_EVERY_S``, and the first probe answered brings it back
  (``client_up_again``). A put that finds the store full fails for those
  values and is counted apart (``put_no_space_blocks``): Mooncake frees space
  a fraction of a segment at a time, so writes faster than its eviction lose
  some puts; the blocks stay in the tiers below.
* A put may soft-pin its values for a TTL (``pin_ttl_s``; Mooncake evicts
  soft-pinned objects last): an agent's context kept through a tool call.

Byte path: a caller that gives the tier its host buffers
(:meth:`MooncakeTier.register_region`; the vLLM connector gives its staging
ring and its remote write queue) has raw blocks sent from and read into them
with no copy: header and payload go as two parts of one object
(``batch_put_from_multi_buffers`` / ``batch_get_into_multi_buffers``), and a
read is checked where it landed. Other buffers, and values of other codecs,
are copied through registered staging buffers (``batch_upsert_from`` /
``batch_get_into``).

Must not decide what to store, load or evict (the manager and placement do),
and must not import torch or an engine. The ``mooncake`` package is imported
only when a :class:`MooncakeTier` is made.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
import urllib.parse
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

import numpy as np

from ..errors import ConfigError, KVTierError
from ..keys import BlockKey, Namespace, key_to_bytes
from ..layout import KVLayout
from .codec import (
    FORMAT_VERSION,
    HEADER_BYTES,
    MAGIC,
    DecodeOutcome,
    ValueContext,
    check_codec_layout,
    decode_outcome,
    decode_raw_batch,
    encode_parts,
    encode_raw_many_into,
    native_raw_read,
    raw_headers_into,
    value_bound,
)

if TYPE_CHECKING:
    from ..config import RemoteTierConfig

OBJECT_PREFIX = "kvtier"
GET_SLOTS = 16  # value-sized slots of each registered staging buffer (one for puts, one for gets)
# A batch moves in parts of about PART_BYTES (a power of two of values, at most half the
# slots): the store moves one part on the tier's I/O thread while the caller's thread
# encodes or checks the next. Measured on 2 cores (get of one 16-value batch, GB/s, whole
# vs parts): 256 KiB 3.00 vs 3.14 (8 a part); 1 MiB 3.59 vs 4.59 (4); 4 MiB 3.38 vs 5.69 (2).
PART_BYTES = 4 << 20
OBJECT_NOT_FOUND = -704  # Mooncake's error code for an absent object
NO_AVAILABLE_HANDLE = -200  # Mooncake's error code for a put that found no free space in any segment
RPC_FAIL = -900  # Mooncake's error code for a call the master did not answer
DOWN_AFTER_S = 1.0  # a store call that failed and took this long (or any RPC_FAIL): the store counts as down
DOWN_PROBE_EVERY_S = 0.5  # while it is down, the probe thread asks the store this often
CONNECT_TIMEOUT_S = 3.0

log = logging.getLogger(__name__)


class RemoteTier(Protocol):
    """What kvtier needs from a store shared by engines (all calls batched, none raise for I/O)."""

    def put_many(self, items: Sequence[tuple[BlockKey, object, BlockKey | None]], *,
                 pin_ttl_s: float | None = None, codec: str | None = None) -> int:
        """Store ``(key, raw block bytes, parent or None)``; how many leading items were stored.
        ``pin_ttl_s``: ask the store to keep them over unpinned values for that long (a soft pin).
        ``codec``: encode with it instead of the tier's own (a lossy codec for cold blocks)."""

    def get_many_into(self, keys: Sequence[BlockKey], outs: Sequence[Any]) -> list[bool]:
        """Read and verify each key into its buffer; one ok per key (a miss leaves the buffer unspecified)."""

    def contains_many(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Whether each key has a value (not verified: a read may still miss)."""

    def delete_many(self, keys: Sequence[BlockKey]) -> int:
        """Remove the keys' values; how many were removed."""

    def close(self) -> None:
        """Release the connection (idempotent)."""

    def register_region(self, buffer: Any) -> bool:
        """Offer host memory that blocks are put from and read into, for transfers with no
        copy; False where the store takes none (callers then simply pass any buffer)."""

    def unregister_region(self, buffer: Any) -> None:
        """Withdraw a region of :meth:`register_region`."""


class RemoteTierError(KVTierError):
    """The remote store cannot be reached or set up; the message names the setting."""


class MooncakeTier:
    """Blocks of one namespace in a Mooncake Store.

    ``master`` is the master's ``host:port`` (``mooncake_master --rpc_port``);
    ``metadata_server`` its HTTP metadata URL
    (``http://host:port/metadata``, ``--enable_http_metadata_server=1``).
    This client contributes ``segment_bytes`` of its memory to the store and
    uses a local transfer buffer of ``buffer_bytes``; ``protocol`` is
    ``tcp`` (or ``rdma`` with ``devices``). ``codec`` is the SSD tier's
    (``raw``, ``zstd``, ``bplane-zstd``, ``auto``).
    """

    @classmethod
    def from_config(cls, namespace: Namespace, layout: KVLayout, cfg: RemoteTierConfig) -> MooncakeTier:
        """The client ``tiers.remote`` describes: how :class:`~kvtier.store.TieredStore`
        and the vLLM connector both open the store."""
        return cls(namespace, layout, master=cfg.master, metadata_server=cfg.resolved_metadata_server(),
                   segment_bytes=cfg.segment_bytes, buffer_bytes=cfg.buffer_bytes, codec=cfg.codec,
                   zstd_level=cfg.zstd_level)

    def __init__(
        self,
        namespace: Namespace,
        layout: KVLayout,
        *,
        master: str,
        metadata_server: str,
        local_hostname: str = "127.0.0.1",
        segment_bytes: int = 512 << 20,
        buffer_bytes: int = 128 << 20,
        protocol: str = "tcp",
        devices: str = "",
        codec: str = "raw",
        zstd_level: int = 1,
    ) -> None:
        self.namespace = namespace
        self.layout = layout
        self.codec = check_codec_layout(codec, layout, "tiers.remote.codec")
        self.zstd_level = zstd_level
        self._ctx = ValueContext.of(namespace, layout)
        self._slot_bytes = value_bound(layout.bytes_per_block)
        self._get_staging: np.ndarray | None = None  # registered with the store on first use
        self._put_staging: np.ndarray | None = None
        self._prefix = f"{OBJECT_PREFIX}/{namespace.digest.hex()}/"
        self._pin_configs: dict[int, Any] = {}  # soft-pin TTL (ms) -> ReplicateConfig
        self._put_lock = threading.Lock()  # TieredStore's mover puts from two threads
        self._put_failure: int | None = None
        self._down_lock = threading.Lock()
        self._down_since: float | None = None  # while the store counts as down (monotonic), else None
        self._probe_lock = threading.Lock()  # held by the probe thread while it asks the store
        self._get_lock = threading.Lock()
        self._put_headers: np.ndarray | None = None  # headers of blocks sent from a registered region
        self._get_headers: np.ndarray | None = None
        self._regions: list[tuple[int, int]] = []  # registered host memory (register_region): [start, end)
        self._part = _part_values(layout.bytes_per_block)
        self._get_io = ThreadPoolExecutor(1, thread_name_prefix="kvtier-remote-get")  # a staged get's next part
        self.counters: Counter[str] = Counter()
        for name, value in (("tiers.remote.segment_bytes", segment_bytes), ("tiers.remote.buffer_bytes",
                                                                              buffer_bytes)):
            if type(value) is not int or value <= 0:
                raise ConfigError(name, value, "must be a positive number of bytes")
        check_store(master, metadata_server)
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:  # the optional dependency
            raise RemoteTierError(
                f"tiers.remote: the Mooncake client is not installed ({e}); "
                "pip install 'mooncake-transfer-engine-non-cuda' (CPU) or 'mooncake-transfer-engine'") from None
        self._store: Any = MooncakeDistributedStore()
        rc = self._store.setup(local_hostname, metadata_server, segment_bytes, buffer_bytes, protocol, devices,
                               master)
        if rc != 0:
            self._store = None
            raise RemoteTierError(f"tiers.remote: could not join the Mooncake store at master {master!r} "
                                  f"(metadata {metadata_server!r}): setup returned {rc}")

    # ------------------------------------------------------------------ names

    def object_name(self, key: BlockKey) -> str:
        """The store's name of ``key``'s value: ``kvtier/<namespace digest>/<key hex>``."""
        return f"{self._prefix}{int(key):032x}"

    # ------------------------------------------------------------------ RemoteTier

    def put_many(self, items: Sequence[tuple[BlockKey, object, BlockKey | None]], *,
                 pin_ttl_s: float | None = None, codec: str | None = None) -> int:
        """Store ``GET_SLOTS`` values a batch; returns the leading run written (a failed batch
        ends the put). Unpinned ``raw`` blocks that lie in a registered region
        (:meth:`register_region`) are sent from where they are, behind a header from a small
        registered buffer (put, not upsert: a value already there stays, ``put_bytes`` counts
        it all the same, and :meth:`get_many_into` removes one that fails its check); any
        other block is encoded into a registered staging buffer and upserted from there.
        ``pin_ttl_s`` soft-pins them (Mooncake evicts soft-pinned objects last, until the
        TTL): an agent's context kept through its tool call; a pinned batch with a value
        already there is upserted, so that value gets the pin too. Callers may be on
        several threads: one put at a time uses the staging buffers. ``codec``: instead of
        the tier's (cold blocks)."""
        config = self._pin_config(pin_ttl_s) if pin_ttl_s else None
        codec = self.codec if codec is None else check_codec_layout(codec, self.layout, "codec")
        done = 0
        with self._put_lock:
            self._put_failure = None  # the store's code for the first value not written (under the put lock)
            for start in range(0, len(items), GET_SLOTS):
                chunk = items[start:start + GET_SLOTS]
                direct = codec == "raw" and native_raw_read() and self._all_in_regions([r for _, r, _ in chunk])
                if direct and config is not None:  # a put leaves a value already there, and its pin unset
                    direct = not any(self.contains_many([k for k, _, _ in chunk]))
                written = self._put_direct(chunk, config) if direct else self._put_staged(chunk, config, codec)
                self.counters["put_direct_blocks" if direct else "put_staged_blocks"] += written
                done += written
                if written < len(chunk):
                    break
            if done < len(items) and self._put_failure == NO_AVAILABLE_HANDLE:
                # the store is full: Mooncake frees eviction_ratio of a segment at a time, and a put that finds
                # less free space than it needs fails (docs/operations.md, "Remote puts that fail for space")
                self.counters["put_no_space_blocks"] += len(items) - done
        self.counters["put_blocks"] += done
        self.counters["put_failed_blocks"] += len(items) - done
        if config is not None:
            self.counters["put_pinned_blocks"] += done
        return done

    def _pin_config(self, ttl_s: float) -> Any:
        """Mooncake's ``ReplicateConfig`` for a soft pin of ``ttl_s`` seconds (made once per TTL)."""
        ttl_ms = max(1, int(ttl_s * 1000))
        config = self._pin_configs.get(ttl_ms)
        if config is None:
            from mooncake.store import ReplicateConfig, SoftPinAction

            config = ReplicateConfig()
            config.soft_pin_action = SoftPinAction.ENABLE
            config.soft_pin_ttl_ms = ttl_ms
            self._pin_configs[ttl_ms] = config
        return config

    def _put_staged(self, items: Sequence[tuple[BlockKey, object, BlockKey | None]], config: Any, codec: str) -> int:
        """Encode ``items`` into the put staging buffer and upsert them from there."""
        staging = self._registered("_put_staging", GET_SLOTS * self._slot_bytes)
        if staging is None:
            return 0
        slot = self._slot_bytes
        # raw: every payload copied and checksummed in one C call (None without the C module)
        sizes = encode_raw_many_into(list(items), self._ctx, staging, slot) if codec == "raw" else None
        if sizes is None:
            sizes = []
            for i, (key, raw, parent) in enumerate(items):
                offset = i * slot
                for part in encode_parts(raw, self._ctx, codec, parent, self.zstd_level, key=key):
                    n = len(part)
                    staging[offset:offset + n] = np.frombuffer(part, dtype=np.uint8)
                    offset += n
                sizes.append(offset - i * slot)
        base = staging.ctypes.data
        names = [self.object_name(k) for k, _, _ in items]
        args = (names, [base + i * slot for i in range(len(items))], sizes)
        return self._written(lambda: self._store.batch_upsert_from(*args, *([config] if config else [])), sizes)

    def _put_direct(self, items: Sequence[tuple[BlockKey, object, BlockKey | None]], config: Any) -> int:
        """Send each raw block from where it is (a registered region), its header from the
        registered header buffer: no copy of the payload."""
        headers = self._registered("_put_headers", GET_SLOTS * HEADER_BYTES)
        if headers is None or not raw_headers_into(list(items), self._ctx, headers):
            return 0
        hbase = headers.ctypes.data
        names = [self.object_name(k) for k, _, _ in items]
        ptrs = [[hbase + i * HEADER_BYTES, _address(raw)[0]] for i, (_, raw, _) in enumerate(items)]
        parts = [[HEADER_BYTES, _address(raw)[1]] for _, raw, _ in items]
        return self._written(lambda: self._store.batch_put_from_multi_buffers(names, ptrs, parts,
                                                                              *([config] if config else [])),
                             [HEADER_BYTES + n for _, n in parts])

    def _written(self, call: Callable[[], Sequence[int]], sizes: Sequence[int]) -> int:
        """Run a batch put ``call``; the leading run of values it wrote (of ``sizes`` bytes)."""
        if self._store is None or not self._may_call():
            return 0
        started = time.monotonic()
        try:
            codes = call()
        except (RuntimeError, ValueError, TypeError) as e:
            self._answered(started, failed=True, what=f"put raised {e}")
            return self._error("put", e)
        written = next((i for i, c in enumerate(codes) if c != 0), len(codes))
        no_space = written < len(codes) and codes[written] == NO_AVAILABLE_HANDLE  # an answer: the store is full
        self._answered(started, failed=written == 0 and bool(sizes) and not no_space, rpc_failed=RPC_FAIL in codes,
                       what="put")
        if written < len(sizes):
            self.counters["remote_errors"] += 1
            self._put_failure = codes[written] if written < len(codes) else None
        self.counters["put_bytes"] += sum(sizes[:written])
        return written

    def get_many_into(self, keys: Sequence[BlockKey], outs: Sequence[Any]) -> list[bool]:
        """Read and verify each value into its buffer. Buffers in a registered region
        (:meth:`register_region`) get the block straight from the store, checked where it
        lands; the rest (and any value that did not land whole there: another codec, a
        failed check) are read a part at a time into a registered staging buffer and
        decoded from there, the store reading the next part meanwhile. A present value that
        fails its check (save one of another kvtier format version) is removed from the store
        (a later put writes it afresh)."""
        oks = [False] * len(keys)
        with self._get_lock:  # one get at a time uses the staging buffers
            todo = list(range(len(keys)))
            if self.codec == "raw" and native_raw_read() and self._all_in_regions(outs, writable=True):
                for start in range(0, len(keys), GET_SLOTS):
                    for i, ok in enumerate(self._get_direct(keys[start:start + GET_SLOTS],
                                                            outs[start:start + GET_SLOTS]), start):
                        oks[i] = ok is True
                        self.counters["get_direct_blocks"] += ok is True
                        if ok is not None:
                            todo.remove(i)
            if todo:
                for i, ok in zip(todo, self._get_staged([keys[i] for i in todo], [outs[i] for i in todo])):
                    oks[i] = ok
        self.counters["get_hit_blocks"] += sum(oks)
        return oks

    def _get_direct(self, keys: Sequence[BlockKey], outs: Sequence[Any]) -> list[bool | None]:
        """Each block read straight into its buffer and checked there: True (verified), False
        (absent: a miss), None (read it again through the staging buffer, which says why)."""
        headers = self._registered("_get_headers", GET_SLOTS * HEADER_BYTES)
        if headers is None or self._store is None:
            return [None] * len(keys)
        if not self._may_call():
            return [False] * len(keys)  # a miss at once (the staging read would be skipped too)
        hbase = headers.ctypes.data
        spans = [_address(o) for o in outs]
        started = time.monotonic()
        try:
            got = list(self._store.batch_get_into_multi_buffers(
                [self.object_name(k) for k in keys], [[hbase + i * HEADER_BYTES, a] for i, (a, _) in enumerate(spans)],
                [[HEADER_BYTES, n] for _, n in spans]))
        except (RuntimeError, ValueError, TypeError) as e:
            self._answered(started, failed=True, what=f"get raised {e}")
            self._error("get", e)
            return [None] * len(keys)
        self._answered(started, failed=not any(n > 0 for n in got), rpc_failed=RPC_FAIL in got, what="get")
        whole = [i < len(got) and got[i] == HEADER_BYTES + spans[i][1] for i in range(len(keys))]
        checked = decode_raw_batch([headers[i * HEADER_BYTES:(i + 1) * HEADER_BYTES] if w else None
                                    for i, w in enumerate(whole)], [key_to_bytes(k) for k in keys], list(outs),
                                   self._ctx, in_place=True)
        res: list[bool | None] = []
        for i, ok in enumerate(checked):
            if ok:
                res.append(True)
            elif i < len(got) and got[i] == OBJECT_NOT_FOUND:
                self.counters["missing"] += 1
                res.append(False)
            else:
                res.append(None)
        return res

    def _get_staged(self, keys: Sequence[BlockKey], outs: Sequence[Any]) -> list[bool]:
        staging = self._registered("_get_staging", GET_SLOTS * self._slot_bytes)
        if staging is None:
            return [False] * len(keys)
        oks: list[bool] = []
        step = self._part
        reading: Future[list[int]] | None = None  # the next part, read on the I/O thread
        try:
            for first in range(0, len(keys), step):
                part = keys[first:first + step]
                slot0 = first % GET_SLOTS
                if len(part) == len(keys):  # one part: no hand-off
                    got = self._read_part(part, slot0)
                else:
                    got, reading = (reading or self._get_io.submit(self._read_part, part, slot0)).result(), None
                    if first + step < len(keys):  # the next part lands in other slots while this one is checked
                        reading = self._get_io.submit(self._read_part, keys[first + step:first + 2 * step],
                                                      (first + step) % GET_SLOTS)
                oks += self._check_part(part, outs[first:first + step], staging, slot0, got)
        finally:
            if reading is not None:  # this thread raised: the staging is not reused under a read in flight
                reading.result()
        return oks

    def _read_part(self, keys: Sequence[BlockKey], slot0: int) -> list[int]:
        """Read ``keys`` into the staging slots from ``slot0``: each value's length, else
        Mooncake's error code (``OBJECT_NOT_FOUND``: absent)."""
        store, staging = self._store, self._get_staging
        if store is None or staging is None:
            return [-1] * len(keys)
        if not self._may_call():
            return [-1] * len(keys)  # a miss at once (counted with the store's errors)
        base, slot = staging.ctypes.data, self._slot_bytes
        started = time.monotonic()
        try:
            got = store.batch_get_into([self.object_name(k) for k in keys],
                                       [base + (slot0 + i) * slot for i in range(len(keys))], [slot] * len(keys))
        except (RuntimeError, ValueError, TypeError) as e:
            self._answered(started, failed=True, what=f"get raised {e}")
            self._error("get", e)
            return [-1] * len(keys)
        got = list(got)[:len(keys)]
        self._answered(started, failed=not any(n > 0 for n in got), rpc_failed=RPC_FAIL in got, what="get")
        return got + [-1] * (len(keys) - len(got))

    def _check_part(self, keys: Sequence[BlockKey], outs: Sequence[Any], staging: np.ndarray, slot0: int,
                    got: list[int]) -> list[bool]:
        """Verify and decode the values read into the slots from ``slot0`` into ``outs``."""
        slot = self._slot_bytes
        values = [staging[(slot0 + i) * slot:(slot0 + i) * slot + n] if n > 0 else None for i, n in enumerate(got)]
        # raw values checked and copied in one C call; anything it does not show OK goes to the general decoder
        fast = decode_raw_batch(values, [key_to_bytes(k) for k in keys], list(outs), self._ctx)
        oks, bad = [], []
        for key, n, out, value, ok in zip(keys, got, outs, values, fast):
            if value is None:  # absent (Mooncake's OBJECT_NOT_FOUND), else a store error (e.g. -900: RPC failed)
                self.counters["missing" if n == OBJECT_NOT_FOUND else "remote_errors"] += 1
                oks.append(False)
                continue
            outcome = DecodeOutcome.OK if ok else decode_outcome(value, out, self._ctx, key=key)
            if outcome is not DecodeOutcome.OK:
                self.counters[outcome.value] += 1
                if outcome is not DecodeOutcome.MISMATCH and not _other_format_version(value):
                    bad.append(key)  # corrupt: removed, so that the next put writes it afresh
            oks.append(outcome is DecodeOutcome.OK)
        if bad:
            self.counters["removed_corrupt"] += self.delete_many(bad)
        return oks

    def _registered(self, name: str, nbytes: int) -> np.ndarray | None:
        """The staging buffer ``name`` (``nbytes``), registered with the store for zero-copy
        transfers on first use."""
        staging = getattr(self, name)
        if staging is None and self._store is not None:
            if not self._may_call():  # registering asks the master too
                return None
            staging = np.empty(nbytes, dtype=np.uint8)
            if self._store.register_buffer(staging.ctypes.data, staging.nbytes) != 0:
                self.counters["remote_errors"] += 1
                return None
            setattr(self, name, staging)
        return staging

    def register_region(self, buffer: Any) -> bool:
        """Register host memory that callers put blocks from and get blocks into (an
        engine's staging ring) with the store: raw blocks that lie in it then move between
        it and the store with no copy. The caller keeps ``buffer`` alive until
        :meth:`unregister_region` or :meth:`close`. False (nothing registered) where the
        store refuses it or is closed, or ``buffer`` is not one contiguous writable run."""
        span = _address(buffer, writable=True)
        if span is None or self._store is None:
            return False
        with self._put_lock, self._get_lock:
            if self._store.register_buffer(span[0], span[1]) != 0:
                self.counters["remote_errors"] += 1
                return False
            self._regions.append((span[0], span[0] + span[1]))
        return True

    def unregister_region(self, buffer: Any) -> None:
        """Forget a region of :meth:`register_region` (no transfer of it is in flight after this)."""
        span = _address(buffer, writable=True)
        with self._put_lock, self._get_lock:
            if span is not None and (span[0], span[0] + span[1]) in self._regions:
                self._regions.remove((span[0], span[0] + span[1]))
                if self._store is not None:
                    self._store.unregister_buffer(span[0])

    def _all_in_regions(self, buffers: Sequence[Any], writable: bool = False) -> bool:
        """Whether every buffer is one contiguous run inside a registered region."""
        if not self._regions:
            return False
        for b in buffers:
            span = _address(b, writable)
            if span is None or not any(lo <= span[0] and span[0] + span[1] <= hi for lo, hi in self._regions):
                return False
        return True

    def contains_many(self, keys: Sequence[BlockKey]) -> list[bool]:
        if not keys or self._store is None or not self._may_call():
            return [False] * len(keys)
        started = time.monotonic()
        try:
            found = self._store.batch_is_exist([self.object_name(k) for k in keys])
        except (RuntimeError, ValueError, TypeError) as e:
            self._answered(started, failed=True, what=f"lookup raised {e}")
            self._error("exists", e)
            return [False] * len(keys)
        self._answered(started, failed=any(r not in (0, 1) for r in found), rpc_failed=RPC_FAIL in found,
                       what="lookup")
        return [r == 1 for r in found]

    def delete_many(self, keys: Sequence[BlockKey]) -> int:
        if not keys or self._store is None or not self._may_call():
            return 0
        started = time.monotonic()
        try:
            codes = self._store.batch_remove([self.object_name(k) for k in keys], True)
        except (RuntimeError, ValueError, TypeError) as e:
            self._answered(started, failed=True, what=f"remove raised {e}")
            return self._error("remove", e)
        self._answered(started, failed=not any(c == 0 for c in codes), rpc_failed=RPC_FAIL in codes, what="remove")
        return sum(1 for c in codes if c == 0)

    def healthy(self) -> bool:
        """True while the store answers (Mooncake's ``health_check`` is 0)."""
        return self._store is not None and self._store.health_check() == 0

    @property
    def down(self) -> bool:
        """Whether the store counts as down: every call fails at once while a probe asks it again."""
        return self._down_since is not None

    def _may_call(self) -> bool:
        """Whether a call may go to the store: not while it counts as down (counted)."""
        if self._down_since is None:
            return True
        self.counters["client_down_skips"] += 1
        return False

    def _answered(self, started: float, *, failed: bool, rpc_failed: bool = False, what: str) -> None:
        """A call that began at ``started`` came back: the store goes down after a call that failed
        slowly (``DOWN_AFTER_S``: the client waited on a master that did not answer) or with
        ``RPC_FAIL``; from then on a thread of its own probes it every ``DOWN_PROBE_EVERY_S`` (a
        probe to a dead master waits as long, and no caller should), until one is answered."""
        took = time.monotonic() - started
        if not (rpc_failed or (failed and took >= DOWN_AFTER_S)) or self._down_since is not None:
            return
        with self._down_lock:
            if self._down_since is not None or self._store is None:
                return
            try:
                threading.Thread(target=self._probe_until_up, name="kvtier-remote-probe", daemon=True).start()
            except RuntimeError:  # no thread to probe with: the store stays up (its calls wait, as before)
                return
            self._down_since = time.monotonic()
            self.counters["client_down"] += 1
            log.warning("kvtier: the Mooncake store did not answer (%s, %.1f s): its calls fail at once until a "
                        "probe every %.1f s is answered", what, took, DOWN_PROBE_EVERY_S)

    def _probe_until_up(self) -> None:
        """While the store counts as down: ask it whether a name exists, every ``DOWN_PROBE_EVERY_S``;
        the first answer in time (without ``RPC_FAIL``) brings it back."""
        while True:
            time.sleep(DOWN_PROBE_EVERY_S)
            with self._probe_lock:  # close() waits for a probe in flight
                store = self._store
                if store is None:
                    return
                started = time.monotonic()
                try:
                    answered = all(r in (0, 1) for r in store.batch_is_exist([f"{self._prefix}probe"]))
                except (RuntimeError, ValueError, TypeError):
                    answered = False
            if answered and time.monotonic() - started < DOWN_AFTER_S:
                with self._down_lock:
                    log.warning("kvtier: the Mooncake store answers again after %.1f s",
                                time.monotonic() - (self._down_since or started))
                    self._down_since = None
                    self.counters["client_up_again"] += 1
                return

    @property
    def client(self) -> Any:
        """The Mooncake store client this tier holds (``None`` once closed): for a benchmark that
        times Mooncake's own batch calls on the same connection as the tier's."""
        return self._store

    def close(self) -> None:
        with self._put_lock, self._get_lock, self._probe_lock:  # no transfer or probe in flight
            store, self._store = self._store, None
            names = ("_get_staging", "_put_staging", "_get_headers", "_put_headers")
            stagings = [getattr(self, n) for n in names]
            for n in names:
                setattr(self, n, None)
            regions, self._regions = self._regions, []
        self._get_io.shutdown()
        if store is not None:
            for addr in [s.ctypes.data for s in stagings if s is not None] + [lo for lo, _ in regions]:
                store.unregister_buffer(addr)
            store.close()

    def _error(self, op: str, exc: BaseException) -> int:
        self.counters["remote_errors"] += 1
        self.counters[f"{op}_exceptions"] += 1
        return 0


def _address(buffer: Any, writable: bool = False) -> tuple[int, int] | None:
    """``(address, length)`` of a C-contiguous (and, if asked, writable) buffer, else None."""
    try:
        mv = memoryview(buffer)
    except TypeError:
        return None
    if not mv.c_contiguous or (writable and mv.readonly):
        return None
    arr = np.frombuffer(mv.cast("B") if mv.ndim != 1 or mv.format != "B" else mv, dtype=np.uint8)
    return arr.ctypes.data, arr.nbytes


def _other_format_version(value: Any) -> bool:
    """Whether ``value`` is kvtier's, of another format version (a newer kvtier's, in a fleet
    being upgraded): not corrupt, so not removed."""
    head = bytes(memoryview(value)[:5])
    return len(head) == 5 and head[:4] == MAGIC and head[4] != FORMAT_VERSION


def _part_values(block_bytes: int) -> int:
    """Values a part moves: the largest power of two (so parts tile the staging slots) up to
    ``GET_SLOTS // 2`` (so two parts never share slots) whose blocks fit ``PART_BYTES``."""
    n = 1
    while n * 2 <= GET_SLOTS // 2 and n * 2 * block_bytes <= PART_BYTES:
        n *= 2
    return n


def check_store(master: str, metadata_server: str) -> None:
    """Raise a :class:`RemoteTierError` (or ``ConfigError`` for a malformed value) naming the
    setting unless the master and its metadata server accept TCP connections. Mooncake's own
    setup retries an absent master for about 90 s; this fails in seconds."""
    _check_reachable("tiers.remote.master", master, master)
    netloc = urllib.parse.urlsplit(metadata_server).netloc if "://" in metadata_server else ""
    _check_reachable("tiers.remote.metadata_server", metadata_server, netloc)


def _check_reachable(setting: str, value: str, host_port: str) -> None:
    """Raise :class:`RemoteTierError` naming ``setting`` unless ``host:port`` accepts a TCP connection."""
    host, sep, port = host_port.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(setting, value, "expected host:port" + (" in an http:// URL" if "metadata" in setting else ""))
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as e:
        raise RemoteTierError(f"{setting}={value!r}: nothing answers at {host_port} ({e})") from None
