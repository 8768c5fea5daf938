"""``kvtier bench remote``: the remote tier against Mooncake Store's own calls, in the same run.

For 256 KiB, 1 MiB and 4 MiB blocks, in batches of 16, through one client of
a Mooncake Store (a ``mooncake_master`` started here on loopback unless
``--master`` / ``--metadata-server`` name one):

* ``mooncake_put_gbps`` / ``mooncake_get_gbps``: the client's own batch
  put and get of the raw block bytes from and into Python buffers
  (``upsert_batch``, ``get_batch``): the baseline of the target;
* ``zero_copy_put_gbps`` / ``zero_copy_get_gbps``: its zero-copy calls from
  and into a buffer registered with the store (``batch_upsert_from``,
  ``batch_get_into``), for context: what kvtier's header, checksums and the
  copy through its registered staging cost against the fastest path
  (``*_vs_zero_copy``; no target);
* ``remote_put_gbps`` / ``remote_get_gbps``: :class:`~kvtier.tiers.remote.MooncakeTier`
  ``put_many`` / ``get_many_into`` of the same blocks (the checksummed,
  key-bound value format; every read verified into the caller's buffer),
  with the blocks and the read buffers in regions given to
  ``register_region``, as the vLLM connector gives its staging ring and its
  remote write queue: payloads move with no copy;
* ``staged_put_gbps`` / ``staged_get_gbps``: the same calls on buffers of
  no registered region (what ``TieredStore`` passes): every value is copied
  through the tier's registered staging buffer (no target; for context).

All run interleaved, best of ``repeats`` rounds. Target: >= 0.8x the
baseline both ways on the registered path. Must not be imported by
``import kvtier``.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..keys import Namespace, chain_foreign_keys
from ..layout import KVLayout
from ..tiers.remote import RemoteTierError
from .common import gbps, interleaved_best_seconds

BLOCK_SIZES_BYTES = (256 * 1024, 1024 * 1024, 4 * 1024 * 1024)
BATCH_BLOCKS = 16
TARGET = 0.8


def free_port() -> int:
    """A TCP port free on loopback right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def master_binary() -> str | None:
    """The ``mooncake_master`` on the PATH or beside this interpreter (the remote extra installs it), or None."""
    found = shutil.which("mooncake_master") or str(Path(sys.executable).with_name("mooncake_master"))
    return found if Path(found).exists() else None


def mooncake_problem() -> str | None:
    """Why a local Mooncake Store cannot run here (the client does not import, or no
    ``mooncake_master``), or ``None`` when it can."""
    try:
        import mooncake.store  # noqa: F401 - the client MooncakeTier loads
    except ImportError as e:
        return f"mooncake client not importable ({e})"
    return None if master_binary() is not None else "mooncake_master not found"


class LocalMaster:
    """A ``mooncake_master`` with its HTTP metadata server on free loopback ports,
    started by :meth:`start` and stopped by :meth:`stop`; a restart keeps the ports."""

    def __init__(self, log: Path) -> None:
        self.binary = master_binary()
        if self.binary is None:
            raise RemoteTierError("mooncake_master not found (pip install 'kvtier[remote]'); "
                                  "or give --master and --metadata-server")
        self.log = log
        self.rpc, self.http, self.metrics = free_port(), free_port(), free_port()
        self.master = f"127.0.0.1:{self.rpc}"
        self.metadata_server = f"http://127.0.0.1:{self.http}/metadata"
        self.proc: subprocess.Popen | None = None

    def start(self) -> LocalMaster:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [str(self.binary), f"--rpc_port={self.rpc}", "--enable_http_metadata_server=1",
                 f"--http_metadata_server_port={self.http}", f"--metrics_port={self.metrics}",
                 "--metrics_host=127.0.0.1"], stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while True:
            try:
                for port in (self.rpc, self.http):
                    socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                return self
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.stop()
                    raise RemoteTierError(f"mooncake_master did not start (log: {self.log})") from None
                time.sleep(0.1)

    def soft_pinned_keys(self) -> int:
        """The master's count of soft-pinned objects (its Prometheus gauge ``master_soft_pin_key_count``)."""
        import urllib.request

        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics}/metrics", timeout=5).read().decode()
        for line in text.splitlines():
            if line.startswith("master_soft_pin_key_count "):
                return int(float(line.split()[1]))
        raise RemoteTierError("mooncake_master's metrics have no master_soft_pin_key_count")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(10)
            self.proc = None


def _layout_for(block_bytes: int) -> KVLayout:
    # 16 tokens x 2 (K,V) x 8 heads x 128 dim x 2 bytes = 64 KiB per layer
    return KVLayout(block_bytes // (64 * 1024), 8, 128, "bfloat16", 16)


def _check(rc: Any, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"mooncake {what} returned {rc}")


def _operations(tier: Any, store: Any, region: np.ndarray, landing: np.ndarray, blocks: list, outs: list,
                plain_blocks: list, plain_outs: list, keys: list, plain_keys: list, names: list[str],
                batches: list[range], block_bytes: int) -> list[Callable[[], None]]:
    """The timed operations of one block size, in the order :func:`bench_size` interleaves them:
    Mooncake's batch calls (bytes, then zero-copy), the untimed clear, kvtier's registered and
    staged puts, then the gets in the same order."""
    def bytes_put() -> None:
        for b in batches:
            _check(store.upsert_batch([names[i] for i in b], [blocks[i] for i in b]), "upsert_batch")

    def bytes_get() -> None:
        for b in batches:
            if any(len(v) != block_bytes for v in store.get_batch([names[i] for i in b])):
                raise RuntimeError("mooncake get_batch returned a short value")

    def raw_put() -> None:
        for b in batches:
            codes = store.batch_upsert_from([names[i] for i in b], [region.ctypes.data + i * block_bytes for i in b],
                                            [block_bytes] * len(b))
            _check(max(map(abs, codes)), "batch_upsert_from")

    def raw_get() -> None:
        for b in batches:
            got = store.batch_get_into([names[i] for i in b], [landing.ctypes.data + i * block_bytes for i in b],
                                       [block_bytes] * len(b))
            if any(g != block_bytes for g in got):
                raise RuntimeError(f"mooncake batch_get_into returned {got}")

    def tier_put(ks: list, bs: list) -> Callable[[], None]:
        def put() -> None:
            for b in batches:
                if tier.put_many([(ks[i], bs[i], ks[i - 1] if i else None) for i in b]) != len(b):
                    raise RuntimeError(f"remote put failed: {dict(tier.counters)}")
        return put

    def clear() -> None:  # untimed: a registered put leaves a value already there (upsert has no zero-copy form)
        tier.delete_many(keys)
        if any(tier.contains_many(keys)):  # else the puts timed next would write nothing
            raise RuntimeError(f"remote delete failed: {dict(tier.counters)}")

    def tier_get(ks: list, os: list) -> Callable[[], None]:
        def get() -> None:
            for b in batches:
                if not all(tier.get_many_into([ks[i] for i in b], [os[i] for i in b])):
                    raise RuntimeError(f"remote get missed: {dict(tier.counters)}")
        return get

    return [bytes_put, raw_put, clear, tier_put(keys, blocks), tier_put(plain_keys, plain_blocks), bytes_get, raw_get,
            tier_get(keys, outs), tier_get(plain_keys, plain_outs)]


def bench_size(block_bytes: int, total_bytes: int, repeats: int, master: str, metadata_server: str) -> dict[str, Any]:
    from ..tiers.remote import MooncakeTier

    n = max(BATCH_BLOCKS, total_bytes // block_bytes) // BATCH_BLOCKS * BATCH_BLOCKS
    layout = _layout_for(block_bytes)
    ns = Namespace("bench-remote", "bfloat16", "fused", 16)
    segment = 4 * n * block_bytes + (64 << 20)
    tier = MooncakeTier(ns, layout, master=master, metadata_server=metadata_server, segment_bytes=segment,
                        buffer_bytes=2 * BATCH_BLOCKS * block_bytes + (16 << 20))
    try:
        rng = np.random.default_rng(block_bytes)
        region = rng.integers(0, 256, (n, block_bytes), dtype=np.uint8)  # the blocks, in one registered region
        blocks = list(region)
        out_region = np.zeros_like(region)
        outs = list(out_region)
        if not (tier.register_region(region) and tier.register_region(out_region)):
            raise RuntimeError(f"mooncake refused to register the bench's buffers: {dict(tier.counters)}")
        plain_blocks = [b.copy() for b in blocks]  # the same bytes outside every region
        plain_outs = [np.empty(block_bytes, dtype=np.uint8) for _ in range(n)]
        keys = chain_foreign_keys(ns, range(n))
        plain_keys = chain_foreign_keys(Namespace("bench-remote-staged", "bfloat16", "fused", 16), range(n))
        names = [f"bench-raw/{block_bytes}/{i}" for i in range(n)]
        store = tier.client  # the same client: the baseline is Mooncake's own batch calls
        batches = [range(i, i + BATCH_BLOCKS) for i in range(0, n, BATCH_BLOCKS)]
        landing = np.empty_like(region)
        _check(store.register_buffer(landing.ctypes.data, landing.nbytes), "register_buffer")

        fns = _operations(tier, store, region, landing, blocks, outs, plain_blocks, plain_outs, keys, plain_keys,
                          names, batches, block_bytes)
        (bytes_put_s, raw_put_s, _, put_s, staged_put_s, bytes_get_s, raw_get_s, get_s,
         staged_get_s) = interleaved_best_seconds(fns, repeats)
        verified = (np.array_equal(out_region, region) and np.array_equal(region, landing)
                    and all(np.array_equal(a, b) for a, b in zip(plain_blocks, plain_outs)))
        tier.unregister_region(out_region)
        store.unregister_buffer(landing.ctypes.data)
        nbytes = n * block_bytes
        row = {"block_kib": block_bytes // 1024, "blocks": n, "verified": verified,
               "mooncake_put_gbps": gbps(nbytes, bytes_put_s), "remote_put_gbps": gbps(nbytes, put_s),
               "mooncake_get_gbps": gbps(nbytes, bytes_get_s), "remote_get_gbps": gbps(nbytes, get_s),
               "zero_copy_put_gbps": gbps(nbytes, raw_put_s), "zero_copy_get_gbps": gbps(nbytes, raw_get_s),
               "staged_put_gbps": gbps(nbytes, staged_put_s), "staged_get_gbps": gbps(nbytes, staged_get_s)}
        for op in ("put", "get"):
            row[f"{op}_vs_mooncake"] = row[f"remote_{op}_gbps"] / row[f"mooncake_{op}_gbps"]
            row[f"staged_{op}_vs_mooncake"] = row[f"staged_{op}_gbps"] / row[f"mooncake_{op}_gbps"]
            row[f"{op}_vs_zero_copy"] = row[f"remote_{op}_gbps"] / row[f"zero_copy_{op}_gbps"]
        return row
    finally:
        tier.close()


def run(total_mib: int = 64, repeats: int = 7, master: str | None = None, metadata_server: str | None = None,
        sizes: tuple[int, ...] = BLOCK_SIZES_BYTES, progress: Callable[[str], None] = print) -> dict[str, Any]:
    """Every block size; returns ``{"results": [...], "target": ..., "targets_met": ...}``."""
    local = None
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-remote-") as tmp:
        if master is None:
            local = LocalMaster(Path(tmp) / "master.log").start()
            master, metadata_server = local.master, local.metadata_server
        assert metadata_server is not None
        try:
            results = []
            for size in sizes:
                progress(f"[bench remote] block {size // 1024} KiB ...")
                results.append(bench_size(size, total_mib << 20, repeats, master, metadata_server))
        finally:
            if local is not None:
                local.stop()
    met = {k: all(r[k] >= TARGET for r in results) for k in ("put_vs_mooncake", "get_vs_mooncake")}
    return {"results": results, "target": TARGET, "targets_met": met, "master": "local" if local else master,
            "total_mib": total_mib, "repeats": repeats}
