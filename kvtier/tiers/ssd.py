"""SSD tier storage engine: block bytes in one LMDB environment.

Owns: the on-disk bytes of SSD-resident blocks — batched, atomic, checksummed
writes (values in the :mod:`kvtier.tiers.codec` format, keys as 16 big-endian
bytes), verified reads into caller buffers, deletes, and a header scan so a
warm restart can rebuild chains. Must not decide which blocks live here, keep
any index of its own, or evict: that is the TierManager's bookkeeping. Must not
import torch.

Failure model. Expected failures are values, counted in :attr:`SSDTier.stats`:
a missing, corrupt, truncated or foreign (other namespace / layout) value, or
a valid value found under another key than it was written for, is a miss; a
full LMDB map makes :meth:`SSDTier.put_many` write fewer blocks (the longest
prefix that fits) and sets :attr:`SSDTier.last_error`, which names
``tiers.ssd.map_size_bytes``; deletes still work on a full map (see
:meth:`SSDTier.delete_many`). Exceptions are for misuse and configuration: a
directory that cannot be created or opened raises ``StorageError`` naming
``tiers.ssd.path``.

Durability. Each ``put_many`` / ``delete_many`` is one LMDB write transaction:
all of it becomes visible at commit or none of it does, also when the process
is SIGKILLed mid-write (tested). With ``sync=True`` a returned ``put_many`` is
on disk (``fdatasync`` of the data pages, then an ``O_DSYNC`` meta-page write)
and survives power loss too. With ``sync=False`` commits are still atomic but
the last ones may be lost on power loss; :meth:`SSDTier.close` syncs.
``writemap`` is deliberately not used: with a sparse map file a full disk
would kill the process with SIGBUS instead of failing a write.

Threading. Reads may run concurrently from several threads; writers are
serialized by LMDB's writer lock. A large :meth:`SSDTier.get_many_into` also
shares its blocks among ``read_threads`` threads (the caller's and a small pool
of this tier's, shut down by :meth:`SSDTier.close`), each taking the next chunk
of blocks from a shared queue in a read transaction of its own; the copies and
checksums let go of the GIL. :meth:`SSDTier.scatter_many` reads raw values
straight into spans of a caller's buffers (the vLLM connector's KV cache), one
copy, each value verified before a byte of it lands. Raw values are checked and copied a chunk at a
time by the optional C module ``kvtier.tiers._rawread`` (built by ``pip
install`` where a C compiler is present), with the GIL released once per
chunk; without it, or for any value it does not show OK, the Python codec
decodes (same results). Every transaction holds a shared gate that the (rare)
map resize of a delete on a full map, and :meth:`SSDTier.close`, take
exclusively. Counters are best-effort under races. Buffers are anything with
the buffer protocol (bytes, bytearray, numpy arrays); pass a torch CPU tensor
as ``t.view(torch.uint8).numpy()``.

>>> import tempfile
>>> from kvtier.keys import Namespace
>>> from kvtier.layout import KVLayout
>>> layout = KVLayout(2, 1, 64, "bfloat16", 4)
>>> tmp = tempfile.TemporaryDirectory()
>>> tier = SSDTier(tmp.name, Namespace("m", "bfloat16", "fused", 4), layout)
>>> block = bytes(layout.bytes_per_block)
>>> tier.put_many([(BlockKey(1), block, None), (BlockKey(2), block, BlockKey(1))])
2
>>> out = bytearray(layout.bytes_per_block)
>>> tier.get_into(BlockKey(2), out), tier.get_into(BlockKey(3), out)
(True, False)
>>> [(b.key, b.parent) for b in tier.scan()]
[(1, None), (2, 1)]
>>> tier.close(); tmp.cleanup()
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from typing import Callable, Iterator, NamedTuple, Sequence, TypeVar

import lmdb

from ..errors import ConfigError, ProtocolError, StorageError
from ..keys import KEY_BYTES, BlockKey, Namespace, key_from_bytes, key_to_bytes
from ..layout import KVLayout
from .lmdbfile import data_file_problem
from .codec import (
    ValueContext,
    ValueHeader,
    check_codec_layout,
    decode_into,
    decode_raw_batch,
    encode_into,
    scatter_raw_batch,
    read_header,
    value_bound,
)

log = logging.getLogger(__name__)

DEFAULT_MAP_SIZE_BYTES = 16 << 30
_DELETE_HEADROOM_BYTES = 1 << 20
_NUDGE_KEY = b"\x00"  # never a block key (those are 16 bytes)
_SCAN_CHUNK_ENTRIES = 1024
# a read of fewer raw bytes stays on the caller's thread: handing blocks to a
# pool thread costs tens of microseconds, about what 256 KiB takes to copy
PARALLEL_READ_MIN_BYTES = 1 << 20
# blocks are handed out to read threads in chunks of about this many raw bytes:
# fewer lookups between copies, and a late thread waits at most one chunk
READ_CHUNK_BYTES = 512 << 10
# a put is encoded in groups of about this many raw bytes, each into one of the
# tier's ``write_threads`` reused buffers; the next groups encode on the tier's
# encoder threads while the caller copies the last one into the transaction
WRITE_GROUP_BYTES = 8 << 20
_T = TypeVar("_T")

STAT_NAMES: tuple[str, ...] = (
    "puts",  # blocks written (committed)
    "gets",  # blocks looked up by get_into / get_many_into
    "hits",  # lookups that returned verified bytes
    "misses",  # lookups that did not (absent, corrupt or foreign)
    "checksum_failures",  # header or raw checksum mismatch
    "decode_failures",  # bad magic/version/codec/lengths, zstd error, truncation
    "mismatches",  # valid value of another namespace or layout
    "key_mismatches",  # valid value written for another key (copied / renamed under this one)
    "map_full",  # put_many / delete_many calls that hit the LMDB map size
    "write_errors",  # other LMDB errors while writing (disk full, I/O error)
    "deletes",  # keys removed by delete_many
    "purged",  # unreadable values removed by purge_unreadable
    "bytes_written",  # stored (encoded) bytes committed
    "raw_bytes_written",  # raw block bytes committed
    "bytes_read",  # stored bytes of hits
    "raw_bytes_read",  # raw bytes returned by hits
)


class StoredBlock(NamedTuple):
    """One entry of :meth:`SSDTier.scan` (read from the header only)."""

    key: BlockKey
    parent: BlockKey | None
    codec: str
    raw_len: int
    stored_len: int


class SSDTier:
    """Block bytes for one (namespace, layout) in an LMDB directory.

    ``codec`` is the write codec (``auto``, ``raw``, ``zstd``,
    ``bplane-zstd``); reads accept every codec. ``min_ratio`` is the least
    raw/stored ratio for which ``auto`` keeps a compressed value.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        namespace: Namespace,
        layout: KVLayout,
        map_size_bytes: int = DEFAULT_MAP_SIZE_BYTES,
        codec: str = "auto",
        zstd_level: int = 1,
        sync: bool = True,
        readonly: bool = False,
        min_ratio: float = 1.05,
        read_threads: int = 2,
        write_threads: int = 2,
    ) -> None:
        if not isinstance(map_size_bytes, int) or map_size_bytes <= 0:
            raise ConfigError("tiers.ssd.map_size_bytes", map_size_bytes, "must be a positive integer")
        if not isinstance(read_threads, int) or read_threads < 1:
            raise ConfigError("tiers.ssd.read_threads", read_threads, "must be an integer >= 1")
        if not isinstance(write_threads, int) or write_threads < 1:
            raise ConfigError("tiers.ssd.write_threads", write_threads, "must be an integer >= 1")
        self.path = os.fspath(path)
        self.namespace = namespace
        self.layout = layout
        self.codec = check_codec_layout(codec, layout, "tiers.ssd.codec")
        self.zstd_level = zstd_level
        self.min_ratio = min_ratio
        self.sync = sync
        self.readonly = readonly
        self.last_error: str | None = None
        self._ctx = ValueContext.of(namespace, layout)
        self._stats: dict[str, int] = dict.fromkeys(STAT_NAMES, 0)
        self._gate = _TxnGate()
        self.read_threads = read_threads
        self._chunk_blocks = max(1, READ_CHUNK_BYTES // layout.bytes_per_block)
        self._read_pool: ThreadPoolExecutor | None = None  # made on the first large read
        self._pool_lock = threading.Lock()
        self.write_threads = write_threads
        self._group_blocks = max(1, WRITE_GROUP_BYTES // layout.bytes_per_block)
        self._put_lock = threading.Lock()  # one put at a time: it owns the write buffers
        self._write_bufs: list[bytearray] = []
        self._encode_pool: ThreadPoolExecutor | None = None  # made on the first put of several groups
        self._env: lmdb.Environment | None = _open_env(self.path, map_size_bytes, sync, readonly)
        self.map_size_bytes: int = self._env.info()["map_size"]
        if not readonly:
            self._env.reader_check()  # free slots of readers that died (e.g. SIGKILL)

    # ------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Close the environment (idempotent). With ``sync=False``, flushes first."""
        with self._pool_lock:
            pools = [self._read_pool, self._encode_pool]
            self._read_pool = self._encode_pool = None
        for pool in pools:
            if pool is not None:
                pool.shutdown(wait=True)
        with self._gate.exclusive():  # a read in flight on another thread finishes first (its views map the file)
            if self._env is not None:
                if not self.sync and not self.readonly:
                    self._env.sync(True)
                self._env.close()
                self._env = None

    def __enter__(self) -> SSDTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __len__(self) -> int:
        """Number of stored values (any namespace, valid or not). O(1)."""
        return self._live_env().stat()["entries"]

    @property
    def stats(self) -> dict[str, int]:
        """A snapshot of the counters listed in :data:`STAT_NAMES`."""
        return dict(self._stats)

    # ---------------------------------------------------------------- writes

    def put_many(self, items: Sequence[tuple[BlockKey, object, BlockKey | None]], codec: str | None = None,
                 between: Callable[[], None] | None = None) -> int:
        """Store ``(key, raw block bytes, parent key or None)`` items in one transaction, encoded with ``codec``
        (default: the tier's; e.g. a lossy one for cold blocks); ``between`` is called between groups, inside
        the transaction (a writer yielding to loads: reads never wait on it; it must not write to or close
        this tier, whose write lock its thread holds; an exception from it aborts the put, committing none).

        Returns how many were written: all, or on a full map the longest prefix that fits (possibly 0;
        ``stats["map_full"]`` and :attr:`last_error` say so). Existing keys are overwritten. The first
        ``WRITE_GROUP_BYTES`` are encoded before LMDB's write lock is taken, the rest while the transaction copies
        the groups before them (see Threading). Raises ``ValueError`` for a block not ``layout.bytes_per_block``
        long, ``ProtocolError`` when read-only. Cost ≈ the larger of encoding and copying, plus one synced commit."""
        self._writable_env()
        codec = self.codec if codec is None else check_codec_layout(codec, self.layout, "codec")
        for _, buf, _ in items:
            self._check_block(buf)
        with self._put_lock:
            num_written, stored_bytes = self._write_prefix(items, codec, between)
        if num_written:
            self._stats["puts"] += num_written
            self._stats["bytes_written"] += stored_bytes
            self._stats["raw_bytes_written"] += num_written * self.layout.bytes_per_block
        return num_written

    def delete_many(self, keys: Sequence[BlockKey]) -> int:
        """Remove ``keys`` in one transaction; returns how many existed.

        Deletes need fresh pages too (copy-on-write, free-list records), so on
        a completely full map the map is grown for this one transaction by
        about 1 MiB plus 0.2% of the bytes being freed, then set back (LMDB
        keeps it at least as large as the data). Eviction therefore always
        works; the file may end up slightly above ``tiers.ssd.map_size_bytes``.
        If even that fails, nothing is removed, 0 is returned and it is counted.
        """
        self._writable_env()
        key_bytes = [key_to_bytes(k) for k in keys]
        try:
            try:
                num_deleted = self._delete(key_bytes)
            except lmdb.MapFullError:
                num_deleted = self._delete_with_headroom(key_bytes)
        except lmdb.MapFullError:
            self._note_map_full(0, len(keys), "delete_many")
            return 0
        except lmdb.Error as exc:
            self._note_write_error(exc)
            return 0
        self._stats["deletes"] += num_deleted
        return num_deleted

    def _delete(self, key_bytes: list[bytes]) -> int:
        with self._write_txn() as txn:
            return sum(txn.delete(k) for k in key_bytes)

    def _delete_with_headroom(self, key_bytes: list[bytes]) -> int:
        with self._read_txn() as txn:
            freed_bytes = sum(len(v) for v in map(txn.get, key_bytes) if v is not None)
        with self._headroom(_DELETE_HEADROOM_BYTES + freed_bytes // 512):
            num_deleted = self._delete(key_bytes)
            self._nudge()
        return num_deleted

    def _nudge(self) -> None:
        """Commit a no-op write (put and delete a 1-byte key) to advance the txn id.

        LMDB reuses pages freed by transaction N only from transaction N+2 on
        (the previous snapshot stays intact), so after deletes on a full map no
        put could ever commit to advance it. Raises ``lmdb.MapFullError``.
        """
        with self._write_txn() as txn:
            txn.put(_NUDGE_KEY, b"")
            txn.delete(_NUDGE_KEY)

    def _nudge_with_headroom(self) -> bool:
        """:meth:`_nudge`, growing the map briefly if even that does not fit."""
        try:
            try:
                self._nudge()
            except lmdb.MapFullError:
                with self._headroom(_DELETE_HEADROOM_BYTES):
                    self._nudge()
        except lmdb.Error:
            return False
        return True

    @contextmanager
    def _headroom(self, extra_bytes: int) -> Iterator[None]:
        """Grow the map by ``extra_bytes`` for the body, then set it back (LMDB keeps
        it at least as large as the data). No transaction may be open meanwhile."""
        env = self._live_env()
        with self._gate.exclusive():
            env.set_mapsize(self.map_size_bytes + extra_bytes)
        try:
            yield
        finally:
            with self._gate.exclusive():
                env.set_mapsize(self.map_size_bytes)

    def _check_block(self, buf: object) -> None:
        nbytes = memoryview(buf).nbytes
        if nbytes != self.layout.bytes_per_block:
            raise ValueError(
                f"block has {nbytes} bytes, layout {self.layout.describe()} needs {self.layout.bytes_per_block}"
            )

    def _write_prefix(self, items: Sequence[tuple[BlockKey, object, BlockKey | None]], codec: str,
                      between: Callable[[], None] | None) -> tuple[int, int]:
        """Commit the longest prefix of ``items`` that fits; returns its length and stored bytes."""
        n = len(items)
        nudged = False
        stored_bytes = 0
        while n > 0:
            try:
                failed_at, stored_bytes = self._write(items[:n], codec, between)
            except lmdb.Error as exc:
                self._note_write_error(exc)
                return 0, 0
            if failed_at is None:
                break
            if not nudged:  # LMDB reuses pages freed by txn N only from txn N+2: an eviction's
                nudged = True  # delete just before this put frees nothing it can use yet
                if self._nudge_with_headroom():
                    continue
            n = failed_at if failed_at < n else n // 2  # failed at commit: halve
        if n < len(items):
            self._note_map_full(n, len(items), "put_many")
        return n, stored_bytes if n else 0

    def _write(self, items: Sequence[tuple[BlockKey, object, BlockKey | None]], codec: str,
               between: Callable[[], None] | None = None) -> tuple[int | None, int]:
        """One write transaction of ``items``, encoded group by group (see Threading). Returns ``(None,
        stored bytes)`` if committed, else how many puts fit before the map filled (``len(items)`` when
        the commit itself did not fit). No encoder writes into the tier's buffers once this returns."""
        per = self._group_blocks
        groups = [items[i : i + per] for i in range(0, len(items), per)]
        bufs = self._buffers(min(len(items), per), min(len(groups), self.write_threads))
        pool = self._encoder() if len(bufs) > 1 else None
        pending: dict[int, Future[list[memoryview]] | None] = {}

        def encode(g: int) -> list[memoryview]:
            buf = memoryview(bufs[g % len(bufs)])
            return encode_into(groups[g], self._ctx, buf, codec, self.zstd_level, self.min_ratio)

        def start(g: int) -> None:
            if pool is not None and g < len(groups):
                try:
                    pending[g] = pool.submit(encode, g)
                except RuntimeError:  # close() on another thread shut the pool down: encode inline
                    pending[g] = None

        def take(g: int) -> list[memoryview]:
            future = pending.pop(g, None)
            return future.result() if future is not None else encode(g)

        num_put = stored_bytes = 0
        try:
            for g in range(len(bufs)):
                start(g)
            values = take(0)  # before the write lock
            with self._write_txn() as txn:
                for g, group in enumerate(groups):
                    if g:
                        values = take(g)
                    for (key, _, _), value in zip(group, values):
                        txn.put(key_to_bytes(key), value)
                        num_put += 1
                        stored_bytes += len(value)
                    if between is not None and g + 1 < len(groups):
                        between()  # before encoding more: only groups already begun encode meanwhile
                    start(g + len(bufs))  # into the buffer just copied
        except lmdb.MapFullError:
            return num_put, 0
        finally:
            wait([f for f in pending.values() if f is not None])
        return None, stored_bytes

    def _buffers(self, group_blocks: int, count: int) -> list[bytearray]:
        """``count`` reused buffers, each big enough for ``group_blocks`` encoded blocks."""
        nbytes = group_blocks * value_bound(self.layout.bytes_per_block)
        bufs = self._write_bufs
        for i in range(count):
            if i == len(bufs):
                bufs.append(bytearray(nbytes))
            elif len(bufs[i]) < nbytes:
                bufs[i] = bytearray(nbytes)
        return bufs[:count]

    def _encoder(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._encode_pool is None:
                self._encode_pool = ThreadPoolExecutor(self.write_threads - 1, thread_name_prefix="kvtier-ssd-encode")
            return self._encode_pool

    def _note_map_full(self, num_written: int, num_asked: int, op: str) -> None:
        self._stats["map_full"] += 1
        self.last_error = (
            f"tiers.ssd.map_size_bytes={self.map_size_bytes}: LMDB map at {self.path!r} is full; "
            f"{op} wrote {num_written} of {num_asked}. Raise tiers.ssd.map_size_bytes or evict blocks."
        )

    def _note_write_error(self, exc: lmdb.Error) -> None:
        self._stats["write_errors"] += 1
        self.last_error = f"tiers.ssd.path={self.path!r}: LMDB write failed: {exc}"

    # ----------------------------------------------------------------- reads

    def get_into(self, key: BlockKey, out: object) -> bool:
        """Decode ``key``'s bytes into ``out`` (writable, ``bytes_per_block`` long).

        ``True`` only when the bytes verified and were written for ``key``; on
        ``False`` (absent, corrupt, foreign, misplaced) ``out`` holds
        unspecified bytes. Never raises for bad data.
        """
        return self.get_many_into([key], [out])[0]

    def get_many_into(self, keys: Sequence[BlockKey], outs: Sequence[object]) -> list[bool]:
        """:meth:`get_into` for many keys (zero-copy reads: each value is decoded
        straight out of the map). A read of at least ``PARALLEL_READ_MIN_BYTES``
        runs on up to ``read_threads`` threads (see :meth:`_read_shared`)."""
        if len(keys) != len(outs):
            raise ValueError(f"{len(keys)} keys but {len(outs)} output buffers")
        self._live_env()  # a closed tier raises here, before a read pool is made again
        for out in outs:
            self._check_out(out)
        n = len(keys)
        num_chunks = -(-n // self._chunk_blocks)
        parts = min(self.read_threads, num_chunks) if n * self.layout.bytes_per_block >= PARALLEL_READ_MIN_BYTES else 1
        if parts == 1:
            results = [False] * n
            self._read_queued(keys, outs, iter(range(0, n, self._chunk_blocks)), results, self._stats)
        else:
            results = self._read_shared(keys, outs, parts)
        num_hits = sum(results)
        self._stats["gets"] += len(keys)
        self._stats["hits"] += num_hits
        self._stats["misses"] += len(keys) - num_hits
        self._stats["raw_bytes_read"] += num_hits * self.layout.bytes_per_block
        return results

    def scatter_many(self, keys: Sequence[BlockKey], dsts: list[object], table: object) -> int:
        """Raw values of ``keys`` verified in the map, then copied straight out of it into
        spans of ``dsts`` (one copy; see :func:`~kvtier.tiers.codec.scatter_raw_batch` for
        ``table``). Returns ``k``: the first ``k`` blocks landed; block ``k`` (absent,
        compressed, or failing a check) and those after it were not written: read those through
        :meth:`get_many_into`, which decodes any codec and says why a value is rejected. ``-1``
        (nothing copied) without the C read path."""
        key_bytes = [key_to_bytes(k) for k in keys]
        # one thread, one transaction: sharing the blocks with the read pool (as get_many_into
        # does) measured no faster on the worker's whole load path (the copy is memory-bound)
        with self._read_txn() as txn:
            values = [txn.get(kb) for kb in key_bytes]
            landed = scatter_raw_batch(values, key_bytes, dsts, table, self._ctx) if keys else 0
            nbytes = sum(len(v) for v in values[:max(landed, 0)])  # type: ignore[arg-type]
        if landed > 0:
            self._stats["gets"] += landed
            self._stats["hits"] += landed
            self._stats["raw_bytes_read"] += landed * self.layout.bytes_per_block
            self._stats["bytes_read"] += nbytes
        return landed

    def _read_shared(self, keys: Sequence[BlockKey], outs: Sequence[object], parts: int) -> list[bool]:
        """Read ``keys`` into ``outs`` on ``parts`` threads (the caller's and pool
        threads) that take chunks of ``_chunk_blocks`` blocks (about
        ``READ_CHUNK_BYTES``) from a shared queue.

        Each thread opens its own read transaction, looks its blocks up and decodes
        them, so a pool thread that wakes late (tens of microseconds) takes fewer
        blocks instead of holding the caller up, and no lookups run before the first
        copy. Transactions opened a moment apart may see different commits; that
        is harmless, since a key's value is its block's bytes whichever commit wrote
        it, and a key deleted in between reads as a miss. The caller's transaction
        ends before it waits for the pool: a resize queued for the exclusive gate
        then runs, and a pool thread it held up finds the queue empty."""
        # next() on a range iterator is atomic under the GIL
        queue = iter(range(0, len(keys), self._chunk_blocks))
        results = [False] * len(keys)
        counts: list[dict[str, int]] = [{} for _ in range(parts)]
        pool = self._pool()
        futures = []
        try:
            for c in counts[1:]:
                try:
                    futures.append(pool.submit(self._read_queued, keys, outs, queue, results, c))
                except RuntimeError:  # close() on another thread shut the pool down: read alone
                    break
            self._read_queued(keys, outs, queue, results, counts[0])
        finally:
            wait(futures)  # no thread may write into outs once this returns or raises
        for f in futures:
            f.result()
        for c in counts:  # merged on this thread: no increment lost to a race
            for name, value in c.items():
                self._stats[name] += value
        return results

    def _read_queued(self, keys: Sequence[BlockKey], outs: Sequence[object], queue: Iterator[int],
                     results: list[bool], stats: dict[str, int]) -> None:
        """One thread's share of a read: until ``queue`` runs dry, take the next
        start index, look up the ``_chunk_blocks`` blocks from there in this
        thread's transaction and decode them into ``outs`` (raw values in one
        call of the C read path, with the GIL released; anything it does not
        show OK through the general decoder, which says why)."""
        ctx, bytes_read, chunk, n = self._ctx, 0, self._chunk_blocks, len(keys)
        with self._read_txn() as txn:
            get = txn.get
            for start in queue:
                stop = min(start + chunk, n)
                key_bytes = [key_to_bytes(k) for k in keys[start:stop]]
                values = [get(kb) for kb in key_bytes]
                fast = decode_raw_batch(values, key_bytes, list(outs[start:stop]), ctx)
                for i, value, ok in zip(range(start, stop), values, fast):
                    if value is not None and (ok or decode_into(value, outs[i], ctx, stats, key=keys[i])):
                        results[i] = True
                        bytes_read += len(value)
        if bytes_read:
            stats["bytes_read"] = stats.get("bytes_read", 0) + bytes_read

    def _pool(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._read_pool is None:
                self._read_pool = ThreadPoolExecutor(self.read_threads - 1, thread_name_prefix="kvtier-ssd-read")
            return self._read_pool

    def contains(self, key: BlockKey) -> bool:
        """Whether a value is stored under ``key`` (not verified; O(log n), no copy)."""
        with self._read_txn() as txn:
            return txn.get(key_to_bytes(key)) is not None

    def scan(self, include_foreign: bool = False) -> Iterator[StoredBlock]:
        """Every stored block with a valid header, in key order (headers only).

        Values of another namespace or layout are skipped unless
        ``include_foreign``; values with a bad header, or whose header names
        another key than the one they are stored under, are always skipped.
        Reads in short transactions of 1024 entries, so a slow consumer never
        pins old pages; blocks written during a scan may or may not appear.
        """
        return self._walk(lambda key_bytes, value: self._scan_entry(key_bytes, value, include_foreign))

    def _scan_entry(self, key_bytes: bytes, value: memoryview, include_foreign: bool) -> StoredBlock | None:
        header = _own_header(key_bytes, value)
        if header is None:
            return None
        foreign = header.namespace_digest != self._ctx.namespace_digest or header.layout_hash != self._ctx.layout_hash
        if foreign and not include_foreign:
            return None
        return StoredBlock(header.key, header.parent, header.codec, header.raw_len, header.stored_len)

    def purge_unreadable(self) -> int:
        """Delete values no reader can ever use: a key that is not 16 bytes, a
        header that does not parse (truncated, bit-flipped, bad magic), a header
        naming another key than the one it is stored under, or an *older* format
        version (version 1 values carry no key, so they cannot prove whose bytes
        they are; they are stale). All are invisible to :meth:`scan`, so nothing
        would ever evict them. Values of other namespaces, and values of a
        *newer* format version (a newer kvtier's: not ours to judge), are kept.
        Returns the number deleted (counted as ``purged``). O(entries), headers only."""
        from .codec import FORMAT_VERSION, MAGIC

        def bad(key_bytes: bytes, value: memoryview) -> bytes | None:
            if _own_header(key_bytes, value) is not None:
                return None
            if value.nbytes > 4 and value[:4] == MAGIC and value[4] > FORMAT_VERSION:
                return None
            return key_bytes

        doomed = list(self._walk(bad))
        if doomed and not self.readonly:
            try:
                with self._write_txn() as txn:
                    for key_bytes in doomed:
                        txn.delete(key_bytes)
            except lmdb.Error as exc:
                self._note_write_error(exc)
                return 0
            self._stats["purged"] += len(doomed)
        return len(doomed) if not self.readonly else 0

    def verify_all(self, delete_bad: bool = False) -> tuple[int, int]:
        """Fully decode and verify every stored value; returns ``(ok, bad)``.

        Bad = not decodable into a verified block of this namespace and layout
        under its own key (corrupt, truncated, foreign, misplaced, or a key that
        is not 16 bytes). Failures bump the same counters as reads. With
        ``delete_bad`` they are removed afterwards (one write transaction).
        O(total stored bytes).
        """
        scratch = bytearray(self.layout.bytes_per_block)

        def check(key_bytes: bytes, value: memoryview) -> tuple[bytes, bool]:
            ok = len(key_bytes) == KEY_BYTES and decode_into(
                value, scratch, self._ctx, self._stats, key=key_from_bytes(key_bytes)
            )
            return key_bytes, ok

        num_ok = 0
        bad_keys: list[bytes] = []
        for key_bytes, ok in self._walk(check):
            if ok:
                num_ok += 1
            else:
                bad_keys.append(key_bytes)
        if delete_bad and bad_keys:
            self._delete(bad_keys)
        return num_ok, len(bad_keys)

    def _walk(self, visit: Callable[[bytes, memoryview], _T | None]) -> Iterator[_T]:
        """``visit(key, value)`` for every entry in key order, in read transactions of
        1024 entries (``value`` is only valid during the call); yields non-``None`` results."""
        start = b""
        while True:
            results: list[_T] = []
            num_seen = 0
            with self._read_txn() as txn:
                cursor = txn.cursor()
                if cursor.set_range(start):
                    for key_mv, value in cursor:
                        key_bytes = bytes(key_mv)
                        if key_bytes == start:
                            continue  # resumed on the last key of the previous chunk
                        num_seen += 1
                        result = visit(key_bytes, value)
                        if result is not None:
                            results.append(result)
                        if num_seen == _SCAN_CHUNK_ENTRIES:
                            start = key_bytes
                            break
            yield from results
            if num_seen < _SCAN_CHUNK_ENTRIES:
                return

    # ---------------------------------------------------------------- helpers

    @contextmanager
    def _read_txn(self) -> Iterator[lmdb.Transaction]:
        """A zero-copy read transaction; its memoryviews must not outlive it."""
        with self._gate.shared(), self._live_env().begin(buffers=True) as txn:
            yield txn

    @contextmanager
    def _write_txn(self) -> Iterator[lmdb.Transaction]:
        """A write transaction, committed on normal exit and aborted on an exception."""
        with self._gate.shared(), self._writable_env().begin(write=True) as txn:
            yield txn

    def _check_out(self, out: object) -> None:
        view = memoryview(out)
        if view.readonly:
            raise TypeError("output buffer must be writable")
        nbytes = view.nbytes
        if nbytes != self.layout.bytes_per_block:
            raise ValueError(f"output buffer has {nbytes} bytes, needs {self.layout.bytes_per_block}")

    def _live_env(self) -> lmdb.Environment:
        if self._env is None:
            raise ProtocolError(f"SSDTier at {self.path!r} is closed")
        return self._env

    def _writable_env(self) -> lmdb.Environment:
        if self.readonly:
            raise ProtocolError(f"SSDTier at {self.path!r} was opened read-only (tiers.ssd.readonly=True)")
        return self._live_env()


def _own_header(key_bytes: bytes, value: memoryview) -> ValueHeader | None:
    """The valid header of ``value`` if it was written for ``key_bytes``, else ``None``."""
    if len(key_bytes) != KEY_BYTES:
        return None
    header = read_header(value)
    if header is None or key_to_bytes(header.key) != key_bytes:
        return None
    return header


def _open_env(path: str, map_size_bytes: int, sync: bool, readonly: bool) -> lmdb.Environment:
    """Open (creating unless ``readonly``) the LMDB directory, or raise ``StorageError``.
    ``path`` may be a symlink to the real directory (it is resolved and the real
    one opened), but a symlinked LMDB file inside it is refused (see
    :func:`kvtier.config.lmdb_dir_problem`): the tier writes only inside that directory."""
    from pathlib import Path

    from ..config import lmdb_dir_problem

    real_path = os.path.realpath(path)
    problem = lmdb_dir_problem(Path(real_path))
    if problem is not None:
        raise StorageError(f"tiers.ssd.path={path!r}: {problem}")
    if not readonly:
        try:
            os.makedirs(real_path, exist_ok=True)
        except OSError as exc:
            raise StorageError(f"tiers.ssd.path={path!r}: cannot create directory: {exc.strerror or exc}") from exc
    bad = data_file_problem(real_path)
    if bad is not None:
        if readonly:  # never map it: a truncated file is a SIGBUS, not an exception
            raise StorageError(f"tiers.ssd.path={path!r}: {bad}; not opened")
        _set_aside(path, real_path, bad)

    def open_() -> lmdb.Environment:
        return lmdb.open(real_path, map_size=map_size_bytes, subdir=True, readonly=readonly, create=not readonly,
                         sync=sync, metasync=sync, readahead=True, max_readers=256)

    try:
        return open_()
    except (lmdb.Error, OSError) as exc:
        if readonly or bad is not None:
            raise StorageError(f"tiers.ssd.path={path!r}: cannot open LMDB environment: {exc}") from exc
        _set_aside(path, real_path, f"LMDB refused it ({exc})")  # a cache starts over rather than fail its host
        try:
            return open_()
        except (lmdb.Error, OSError) as exc2:
            raise StorageError(f"tiers.ssd.path={path!r}: cannot open LMDB environment: {exc2}") from exc2


def _set_aside(path: str, real_path: str, problem: str) -> None:
    """Rename an SSD tier directory that cannot be opened safely (kept for a
    look, named in a WARNING) and make an empty one in its place: the tier
    starts empty instead of crashing or failing its host."""
    aside = f"{real_path}.unusable-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
    try:
        os.rename(real_path, aside)
    except FileNotFoundError:  # another process set it aside first
        aside = "(set aside by another process)"
    except OSError as exc:
        raise StorageError(f"tiers.ssd.path={path!r}: {problem}, and it cannot be set aside: "
                           f"{exc.strerror or exc}") from exc
    log.warning("kvtier: SSD tier %s: %s; set aside as %s, the tier starts empty", path, problem, aside)
    try:
        os.makedirs(real_path, exist_ok=True)
    except OSError as exc:
        raise StorageError(f"tiers.ssd.path={path!r}: cannot create directory: {exc.strerror or exc}") from exc


class _TxnGate:
    """Shared/exclusive gate: transactions hold it shared; resizing the map holds it
    exclusively (LMDB forbids ``set_mapsize`` while this process has a transaction
    open, and zero-copy memoryviews would dangle). A waiting exclusive holder
    blocks new shared ones, so a busy reader pool cannot starve a resize."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._num_shared = 0
        self._num_exclusive_waiting = 0
        self._exclusive = False

    @contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            while self._exclusive or self._num_exclusive_waiting:
                self._cond.wait()
            self._num_shared += 1
        try:
            yield
        finally:
            with self._cond:
                self._num_shared -= 1
                if self._num_shared == 0:
                    self._cond.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            self._num_exclusive_waiting += 1
            while self._exclusive or self._num_shared:
                self._cond.wait()
            self._num_exclusive_waiting -= 1
            self._exclusive = True
        try:
            yield
        finally:
            with self._cond:
                self._exclusive = False
                self._cond.notify_all()
