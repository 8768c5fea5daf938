"""Storage faults against a real TieredStore (DRAM pool + LMDB SSD tier).

Every scenario injects a real fault — SIGKILL of a writer process, bytes
changed inside the LMDB file's values, a full LMDB map, a file size limit
that makes every disk write fail, a directory removed underneath the store —
and then checks the one rule: a block is served with exactly the bytes that
were stored, or it is a counted miss. Nothing crashes, and what was
acknowledged before the fault reads back afterwards.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import lmdb
import numpy as np
import pytest
from fault_support import (
    BLOCK_BYTES,
    CODECS,
    FIGURES,
    blocks_for,
    chain_tokens,
    expected_block,
    make_store,
    read_and_check,
)

from kvtier.errors import StorageError
from kvtier.keys import key_to_bytes

HERE = Path(__file__).resolve().parent
CHILD = HERE / "store_crash_child.py"
NUM_KILLS = 6
SEED = 8_2024


# ---------------------------------------------------------------- SIGKILL


def _run_child_until_killed(path: Path, first: int, codec: str, rng: random.Random) -> list[str]:
    proc = subprocess.Popen([sys.executable, str(CHILD), str(path), str(first), codec],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=HERE)
    try:
        ready = proc.stdout.readline()
        assert ready.startswith("R"), proc.stderr.read()
        lines: list[str] = []
        # kill after a seeded number of acknowledged demotes, mid-stream (more moves are in flight)
        target = rng.randint(1, 120)
        while len(lines) < target:
            line = proc.stdout.readline().strip()
            if not line or line == "DONE":
                break
            lines.append(line)
        os.kill(proc.pid, signal.SIGKILL)
        FIGURES["faults_injected"] += 1
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL, f"child exited by itself ({proc.returncode}): {err}"
    lines += [ln for ln in out.splitlines() if ln.startswith("D")]
    return lines


def test_sigkill_during_writes_and_moves_never_loses_or_corrupts_acknowledged_blocks(tmp_path: Path) -> None:
    # A child puts chains into DRAM, demotes them to SSD and prefetches older
    # ones back; it is SIGKILLed mid-stream NUM_KILLS times, each restart with
    # another write codec. After every kill the directory is reopened (warm
    # restart: re-index) and every chain ever started is read: acknowledged
    # chains must read back whole, any block served must be byte-exact.
    rng = random.Random(SEED)
    path = tmp_path / "ssd"
    acked: dict[int, int] = {}  # chain -> blocks the demote acknowledged
    first = 0
    from store_crash_child import BLOCKS_PER_CHAIN, SSD_CAPACITY_BLOCKS

    for kill in range(NUM_KILLS):
        lines = _run_child_until_killed(path, first, CODECS[kill % len(CODECS)], rng)
        for line in lines:
            _, chain, moved = line.split()
            acked[int(chain)] = int(moved)
        last = max(acked) if acked else first - 1
        with make_store(path, dram=128, ssd=SSD_CAPACITY_BLOCKS) as store:
            ok, bad = store._ssd.verify_all()
            assert bad == 0, f"{bad} values in the SSD directory do not verify after SIGKILL"
            assert store.counters["ssd_reindexed_blocks"] == ok
            for chain in range(last + 2):  # +1: the chain in flight at the kill may or may not be there
                keys = store.keys_for(chain_tokens(chain, BLOCKS_PER_CHAIN))
                served, wrong = read_and_check(store, keys)
                assert wrong == 0, f"chain {chain}: {wrong} blocks served with wrong bytes"
                want = acked.get(chain, 0)
                if want == len(keys) and served < want:
                    FIGURES["blocks_lost"] += want - served
                    pytest.fail(f"chain {chain}: acknowledged {want} blocks on SSD, {served} read back")
            store.check_invariants()
        FIGURES["faults_survived"] += 1
        first = last + 2
    assert sum(acked.values()) >= NUM_KILLS * BLOCKS_PER_CHAIN  # the kills landed mid-stream, not before it


# ------------------------------------------------------- corrupted values


def _corrupt(value: bytes, how: str, rng: random.Random) -> bytes:
    b = bytearray(value)
    if how == "flip_header":
        b[rng.randrange(0, 76)] ^= 1 << rng.randrange(8)
    elif how == "flip_payload":
        b[rng.randrange(76, len(b))] ^= 1 << rng.randrange(8)
    elif how == "truncate":
        del b[rng.randrange(0, len(b)) :]
    elif how == "extend":
        b += bytes(rng.randrange(1, 64))
    elif how == "zero":
        b[:] = bytes(len(b))
    return bytes(b)


CORRUPTIONS = ("flip_header", "flip_payload", "truncate", "extend", "zero")


@pytest.mark.parametrize("codec", CODECS)
def test_flipped_and_truncated_values_are_counted_misses_for_every_codec(tmp_path: Path, codec: str) -> None:
    # 10 chains of 4 blocks go to SSD; one block of each of chains 0..4 is
    # corrupted in place in the LMDB file (one corruption kind per chain).
    # Reopened: a corrupted block and the rest of its chain are misses. A bad
    # header is found by the warm restart (the value is purged, the block is
    # absent); a bad payload by the read (a counted checksum failure, and the
    # value is deleted). Every other chain reads back exactly.
    # seeded from the codec's name, not hash(): str hashes change with PYTHONHASHSEED, and a header
    # flip that lands on the version byte reads as a newer kvtier's value (kept, never indexed)
    rng = random.Random(zlib.crc32(codec.encode()))
    path = tmp_path / "ssd"
    with make_store(path, dram=0, ssd=256, codec=codec, put_tier="ssd") as store:
        chains = [store.keys_for(chain_tokens(c, 4)) for c in range(10)]
        for keys in chains:
            assert store.put(keys, blocks_for(keys)) == 4
    env = lmdb.open(str(path), subdir=True)
    with env.begin(write=True) as txn:
        for c, how in enumerate(CORRUPTIONS):
            k = key_to_bytes(chains[c][1])
            txn.put(k, _corrupt(bytes(txn.get(k)), how, rng))
            FIGURES["faults_injected"] += 1
    env.close()
    with make_store(path, dram=16, ssd=256, codec=codec) as store:
        for c, keys in enumerate(chains):
            served, wrong = read_and_check(store, keys)
            assert wrong == 0
            assert served == (1 if c < len(CORRUPTIONS) else 4), (c, served)
            if c < len(CORRUPTIONS):
                FIGURES["faults_survived"] += 1
        st = store.stats()
        purged = st["counters"]["ssd_purged_unreadable_values"]
        assert st["ssd"]["checksum_failures"] + st["ssd"]["decode_failures"] + purged == len(CORRUPTIONS), st
        assert purged >= 3  # truncate, extend and zero always break the header
        reasons = {store.explain_miss(keys).reason for keys in chains[: len(CORRUPTIONS)]}
        assert reasons <= {"failed_verify", "absent"}, reasons
        assert store._ssd.verify_all() == (len(chains) * 4 - len(CORRUPTIONS), 0)
        store.check_invariants()


# ------------------------------------------------------------- full map


def test_full_lmdb_map_refuses_with_a_counted_error_and_keeps_serving(tmp_path: Path) -> None:
    # raw 8 KiB values take three 4 KiB LMDB pages, so a map of exactly
    # capacity * block bytes fills at about two thirds of the capacity.
    capacity = 120
    with make_store(tmp_path / "ssd", dram=32, ssd=capacity, codec="raw", write_through=True,
                    ssd_extra={"map_size_bytes": capacity * BLOCK_BYTES}) as store:
        stored: list[list[int]] = []
        for c in range(capacity // 4):
            keys = store.keys_for(chain_tokens(c, 4))
            assert store.put(keys, blocks_for(keys)) == 4  # DRAM always takes it
            stored.append(keys)
        FIGURES["faults_injected"] += 1
        st = store.stats()
        assert st["ssd"]["map_full"] > 0, st["ssd"]
        assert "tiers.ssd.map_size_bytes" in st["ssd_last_error"]
        on_ssd = [k for keys in stored for k in keys if store.manager.contains(k, "ssd")]
        assert 0 < len(on_ssd) < capacity
        # the SSD index holds exactly what LMDB holds: refused writes are not readable
        assert len(store._ssd) == len(on_ssd)
        assert store.contains_prefix(stored[-1]).tiers == ("dram",) * 4  # the newest chain is served from DRAM
        for keys in stored:  # whatever is readable reads back whole and exact (DRAM, or SSD when it fit)
            readable = store.contains_prefix(keys).num_blocks
            served, wrong = read_and_check(store, keys)
            assert wrong == 0 and served == readable
        assert store.stats()["counters"]["hit_blocks_ssd"] > 0
        store.check_invariants()
    FIGURES["faults_survived"] += 1


# -------------------------------------------------- disk writes failing


WRITE_FAIL_CHILD = textwrap.dedent('''
    import json, os, resource, signal, sys
    import numpy as np
    from fault_support import blocks_for, chain_tokens, make_store, read_and_check
    path = sys.argv[1]
    store = make_store(path, dram=64, ssd=512, codec="raw", write_through=True)
    before = [store.keys_for(chain_tokens(c, 4)) for c in range(4)]
    for keys in before:
        assert store.put(keys, blocks_for(keys)) == 4
    # From now on the disk refuses to grow the LMDB file (EFBIG, like a full or
    # read-only volume); SIGXFSZ would kill us, so ignore it.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    size = os.path.getsize(os.path.join(path, "data.mdb"))
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
    after = [store.keys_for(chain_tokens(100 + c, 4)) for c in range(8)]
    stored = [store.put(keys, blocks_for(keys)) for keys in after]
    served = [read_and_check(store, keys) for keys in before + after]
    st = store.stats()
    on_ssd = [int(k) for keys in before + after for k in keys if store.manager.contains(k, "ssd")]
    print(json.dumps({"stored": stored, "served": served, "ssd": st["ssd"], "error": st["ssd_last_error"],
                      "dram_hits": st["counters"].get("hit_blocks_dram", 0), "on_ssd": on_ssd}))
    store.check_invariants()
    store.close()
''')


def test_failing_disk_writes_are_counted_and_dram_keeps_serving(tmp_path: Path) -> None:
    # A child process limits its file size (RLIMIT_FSIZE) so every LMDB write
    # that grows the file fails with EFBIG, as on a full or read-only volume.
    path = tmp_path / "ssd"
    proc = subprocess.run([sys.executable, "-c", WRITE_FAIL_CHILD, str(path)], cwd=HERE, capture_output=True,
                          text=True, timeout=120, check=False)
    FIGURES["faults_injected"] += 1
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["stored"] == [4] * 8  # DRAM took every put
    assert r["ssd"]["write_errors"] + r["ssd"]["map_full"] > 0, r
    assert "tiers.ssd" in r["error"]
    assert all(wrong == 0 for _, wrong in r["served"])
    assert [n for n, _ in r["served"]] == [4] * 12  # DRAM (and the SSD blocks from before) kept serving
    assert r["dram_hits"] > 0
    # Reopened without the limit: whatever the SSD index held reads back byte-exact.
    with make_store(path, dram=64, ssd=512) as store:
        assert store._ssd.verify_all()[1] == 0
        for k in r["on_ssd"]:
            out = np.zeros(BLOCK_BYTES, dtype=np.uint8)
            assert store._ssd.get_into(k, out) and np.array_equal(out, expected_block(k))
            FIGURES["blocks_verified"] += 1
    FIGURES["faults_survived"] += 1


# --------------------------------------------------- vanished directory


def test_vanished_ssd_directory_keeps_dram_serving_and_restarts_empty(tmp_path: Path) -> None:
    path = tmp_path / "ssd"
    with make_store(path, dram=8, ssd=256, write_through=True) as store:
        chains = [store.keys_for(chain_tokens(c, 4)) for c in range(6)]
        for keys in chains:
            assert store.put(keys, blocks_for(keys)) == 4
        shutil.rmtree(path)  # an operator (or a cleanup job) removes the directory underneath
        FIGURES["faults_injected"] += 1
        for keys in chains:  # DRAM hits go on; SSD reads come from the still-mapped file or miss
            assert read_and_check(store, keys)[1] == 0
        assert read_and_check(store, chains[-1]) == (4, 0)
        more = store.keys_for(chain_tokens(99, 4))
        assert store.put(more, blocks_for(more)) == 4
        store.check_invariants()
    # A restart finds an empty directory: every old block is a counted miss, never foreign bytes.
    with make_store(path, dram=8, ssd=256) as store:
        assert store.counters["ssd_reindexed_blocks"] == 0
        for keys in chains:
            assert read_and_check(store, keys) == (0, 0)
            assert store.explain_miss(keys).reason == "absent"
        assert store.stats()["counters"]["get_blocks_missed"] == 4 * len(chains)
    FIGURES["faults_survived"] += 1


def test_ssd_directory_replaced_by_a_file_is_a_storage_error_naming_the_setting(tmp_path: Path) -> None:
    from fault_support import store_config

    from kvtier.store import TieredStore

    path = tmp_path / "ssd"
    cfg = store_config(path)  # validated while the directory could be created
    path.write_bytes(b"not a directory")
    FIGURES["faults_injected"] += 1
    with pytest.raises(StorageError, match="tiers.ssd.path"):
        TieredStore(cfg)
    FIGURES["faults_survived"] += 1


# ---------------------------------------------------------------- unusable LMDB files

_DAMAGE = {
    "truncated": lambda f: os.truncate(f, os.path.getsize(f) // 3),
    "empty": lambda f: os.truncate(f, 0),
    "random": lambda f: f.write_bytes(random.Random(SEED).randbytes(os.path.getsize(f))),
}

_OPEN_AND_SERVE = textwrap.dedent("""
    import sys, logging
    sys.path.insert(0, {here!r})
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    from fault_support import blocks_for, chain_tokens, make_store, read_and_check
    with make_store({path!r}, dram=8, ssd=256) as store:
        old = store.keys_for(chain_tokens(0, 4))
        print("old", read_and_check(store, old))
        keys = store.keys_for(chain_tokens(7, 4))
        print("put", store.put(keys, blocks_for(keys)))
        print("get", read_and_check(store, keys))
""")


def _damaged_tier(tmp_path: Path, damage: str) -> Path:
    path = tmp_path / "ssd"
    with make_store(path, dram=8, ssd=256, write_through=True) as store:
        for c in range(6):
            keys = store.keys_for(chain_tokens(c, 4))
            assert store.put(keys, blocks_for(keys)) == 4
    _DAMAGE[damage](path / "data.mdb")
    FIGURES["faults_injected"] += 1
    return path


@pytest.mark.parametrize("damage", sorted(_DAMAGE))
def test_an_unusable_lmdb_file_is_set_aside_and_the_store_starts_empty(tmp_path: Path, damage: str) -> None:
    """A truncated file used to kill the process (SIGBUS: LMDB maps pages past the
    end of the file); an empty or foreign one failed the open. The store now sets
    the directory aside, names it in a WARNING and serves from an empty tier.
    In a child process: a crash would otherwise take the test runner with it."""
    path = _damaged_tier(tmp_path, damage)
    proc = subprocess.run([sys.executable, "-c", _OPEN_AND_SERVE.format(here=str(HERE), path=str(path))],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert proc.stdout.split("\n")[:3] == ["old (0, 0)", "put 4", "get (4, 0)"], proc.stdout
    (aside,) = [p for p in tmp_path.iterdir() if p.name.startswith("ssd.unusable-")]
    assert f"set aside as {aside}" in proc.stderr and "WARNING" in proc.stderr
    assert (aside / "data.mdb").exists()  # kept for a look, never deleted
    FIGURES["faults_survived"] += 1


@pytest.mark.parametrize("damage", sorted(_DAMAGE))
def test_inspect_names_an_unusable_lmdb_file_and_does_not_crash(tmp_path: Path, damage: str) -> None:
    path = _damaged_tier(tmp_path, damage)
    proc = subprocess.run([sys.executable, "-m", "kvtier.cli", "inspect", str(path)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, (proc.returncode, proc.stderr)
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"kvtier inspect: error: {str(path)!r}: "), line
    assert "data.mdb" in line or "LMDB" in line, line
    assert not any(p.name.startswith("ssd.unusable-") for p in tmp_path.iterdir())  # inspect changes nothing
    FIGURES["faults_survived"] += 1
