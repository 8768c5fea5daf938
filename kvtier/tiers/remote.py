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
  (counted in ``remote_errors``); nothing raises into an engine's step.
* A put may soft-pin its values for a TTL (``pin_ttl_s``; Mooncake evicts
  soft-pinned objects last): an agent's context kept through a tool call.

Must not decide what to store, load or evict (the manager and placement do),
and must not import torch or an engine. The ``mooncake`` package is imported
only when a :class:`MooncakeTier` is made.
"""

from __future__ import annotations

import socket
import threading
import urllib.parse
from collections import Counter
from typing import Any, Protocol, Sequence

import numpy as np

from ..errors import ConfigError, KVTierError
from ..keys import BlockKey, Namespace, key_to_bytes
from ..layout import KVLayout
from .codec import (
    ValueContext,
    check_codec_layout,
    decode_into,
    decode_raw_batch,
    encode_parts,
    encode_raw_many_into,
    value_bound,
)

OBJECT_PREFIX = "kvtier"
GET_SLOTS = 16  # values per batch through a registered staging buffer (one for puts, one for gets)
OBJECT_NOT_FOUND = -704  # Mooncake's error code for an absent object
CONNECT_TIMEOUT_S = 3.0


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
        self._get_lock = threading.Lock()
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
        """Values are encoded ``GET_SLOTS`` at a time straight into a staging buffer registered
        with the store and written from there in one batch; returns the leading run written.
        ``pin_ttl_s`` soft-pins them (Mooncake evicts soft-pinned objects last, until the TTL):
        an agent's context kept through its tool call. Callers may be on several threads:
        one put at a time uses the staging buffer. ``codec``: instead of the tier's (cold blocks)."""
        config = self._pin_config(pin_ttl_s) if pin_ttl_s else None
        codec = self.codec if codec is None else check_codec_layout(codec, self.layout, "codec")
        done = 0
        with self._put_lock:
            for start in range(0, len(items), GET_SLOTS):
                chunk = items[start:start + GET_SLOTS]
                written = self._put_chunk(chunk, config, codec)
                done += written
                if written < len(chunk):
                    break
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

    def _put_chunk(self, items: Sequence[tuple[BlockKey, object, BlockKey | None]], config: Any = None,
                   codec: str | None = None) -> int:
        staging = self._registered("_put_staging")
        if staging is None:
            return 0
        slot, base = self._slot_bytes, staging.ctypes.data
        codec = codec or self.codec
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
        try:
            args = ([self.object_name(k) for k, _, _ in items], [base + i * slot for i in range(len(items))], sizes)
            codes = self._store.batch_upsert_from(*args) if config is None else self._store.batch_upsert_from(*args,
                                                                                                            config)
        except (RuntimeError, ValueError, TypeError) as e:
            return self._error("put", e)
        written = next((i for i, c in enumerate(codes) if c != 0), len(codes))
        if written < len(items):
            self.counters["remote_errors"] += 1
        self.counters["put_bytes"] += sum(sizes[:written])
        return written

    def get_many_into(self, keys: Sequence[BlockKey], outs: Sequence[Any]) -> list[bool]:
        """Values are read ``GET_SLOTS`` at a time straight into a staging buffer registered
        with the store, then verified and decoded into ``outs``."""
        oks: list[bool] = []
        with self._get_lock:  # one get at a time uses the staging buffer
            for start in range(0, len(keys), GET_SLOTS):
                oks += self._get_chunk(keys[start:start + GET_SLOTS], outs[start:start + GET_SLOTS])
        self.counters["get_hit_blocks"] += sum(oks)
        return oks

    def _get_chunk(self, keys: Sequence[BlockKey], outs: Sequence[Any]) -> list[bool]:
        staging = self._registered("_get_staging")
        if staging is None:
            return [False] * len(keys)
        slot, base = self._slot_bytes, staging.ctypes.data
        try:
            got = self._store.batch_get_into([self.object_name(k) for k in keys],
                                             [base + i * slot for i in range(len(keys))], [slot] * len(keys))
        except (RuntimeError, ValueError, TypeError) as e:
            self._error("get", e)
            return [False] * len(keys)
        got = list(got)[:len(keys)]
        values = [staging[i * slot:i * slot + n] if n > 0 else None for i, n in enumerate(got)]
        # raw values checked and copied in one C call; anything it does not show OK goes to the general decoder
        fast = decode_raw_batch(values, [key_to_bytes(k) for k in keys[:len(got)]], list(outs[:len(got)]), self._ctx)
        oks = []
        for key, n, out, value, ok in zip(keys, got, outs, values, fast):
            if value is None:  # absent (Mooncake's OBJECT_NOT_FOUND), else a store error (e.g. -900: RPC failed)
                self.counters["missing" if n == OBJECT_NOT_FOUND else "remote_errors"] += 1
                oks.append(False)
                continue
            oks.append(ok or decode_into(value, out, self._ctx, self.counters, key=key))
        return oks + [False] * (len(keys) - len(oks))

    def _registered(self, name: str) -> np.ndarray | None:
        """The staging buffer ``name`` (``GET_SLOTS`` value-sized slots), registered with the
        store for zero-copy transfers on first use."""
        staging = getattr(self, name)
        if staging is None and self._store is not None:
            staging = np.empty(GET_SLOTS * self._slot_bytes, dtype=np.uint8)
            if self._store.register_buffer(staging.ctypes.data, staging.nbytes) != 0:
                self.counters["remote_errors"] += 1
                return None
            setattr(self, name, staging)
        return staging

    def contains_many(self, keys: Sequence[BlockKey]) -> list[bool]:
        if not keys or self._store is None:
            return [False] * len(keys)
        try:
            found = self._store.batch_is_exist([self.object_name(k) for k in keys])
        except (RuntimeError, ValueError, TypeError) as e:
            self._error("exists", e)
            return [False] * len(keys)
        return [r == 1 for r in found]

    def delete_many(self, keys: Sequence[BlockKey]) -> int:
        if not keys or self._store is None:
            return 0
        try:
            codes = self._store.batch_remove([self.object_name(k) for k in keys], True)
        except (RuntimeError, ValueError, TypeError) as e:
            return self._error("remove", e)
        return sum(1 for c in codes if c == 0)

    def healthy(self) -> bool:
        """True while the store answers (Mooncake's ``health_check`` is 0)."""
        return self._store is not None and self._store.health_check() == 0

    def close(self) -> None:
        store, self._store = self._store, None
        if store is not None:
            for staging in (self._get_staging, self._put_staging):
                if staging is not None:
                    store.unregister_buffer(staging.ctypes.data)
            store.close()

    def _error(self, op: str, exc: BaseException) -> int:
        self.counters["remote_errors"] += 1
        self.counters[f"{op}_exceptions"] += 1
        return 0


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
