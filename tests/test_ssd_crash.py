"""SIGKILL a writer of the SSD tier at random moments; values are whole or absent.

A child process (``ssd_crash_child.py``) puts batches of chained blocks and
deletes older batches, each in one synced LMDB transaction, printing every
commit. The parent kills it after a seeded random delay (sometimes before the
tier is even open), reopens the same directory and checks:

* every stored value verifies and equals the bytes derived from its key, and
  its header names the expected parent (never a partial or stale value);
* every batch is all present or all absent (transactions are atomic);
* acknowledged puts are present, acknowledged deletes absent; only the one
  operation in flight at the kill may have gone either way;
* the next child can open the directory and write (lock recovery).
"""

from __future__ import annotations

import importlib.util
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from kvtier.tiers.ssd import SSDTier

CHILD = Path(__file__).with_name("ssd_crash_child.py")
_spec = importlib.util.spec_from_file_location("ssd_crash_child", CHILD)
child = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(child)

NUM_KILLS = 24
SEED = 20240229
PRESENT, ABSENT, EITHER = "present", "absent", "either"


def next_op(first_batch: int, lines: list[str]) -> tuple[str, int]:
    """The operation the child was doing when killed (its sequence is deterministic)."""
    if not lines:
        return "P", first_batch
    op, batch = lines[-1].split()
    batch = int(batch)
    if op == "P" and child.deletes_after(batch) is not None:
        return "D", child.deletes_after(batch)
    last_put = batch if op == "P" else max(int(ln.split()[1]) for ln in lines if ln[0] == "P")
    return "P", last_put + 1


def run_child_until_killed(path: Path, first_batch: int, rng: random.Random) -> list[str]:
    proc = subprocess.Popen(
        [sys.executable, str(CHILD), str(path), str(first_batch)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        if rng.random() < 0.2:
            time.sleep(rng.uniform(0.0, 0.4))  # may land while the tier is opening
        else:
            assert proc.stdout.readline().strip() == "R", proc.stderr.read()
            time.sleep(rng.uniform(0.02, 0.5))
        os.kill(proc.pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL, f"child exited by itself ({proc.returncode}): {err}"
    lines = out.splitlines()
    if out and not out.endswith("\n"):
        lines.pop()  # killed while printing it: that operation's ack is incomplete, so it is not acked
    return [line for line in lines if line and line != "R"]


def apply_lines(state: dict[int, str], first_batch: int, lines: list[str]) -> int:
    """Update the expected state of each batch; returns the next child's first batch."""
    for line in lines:
        op, batch = line.split()
        state[int(batch)] = PRESENT if op == "P" else ABSENT
    op, batch = next_op(first_batch, lines)
    state[batch] = EITHER
    if op == "P":
        return batch + 1
    return max(int(ln.split()[1]) for ln in lines if ln[0] == "P") + 1


def check_directory(path: Path, state: dict[int, str]) -> int:
    """Reopen the tier and check every value and batch; returns the number of blocks stored."""
    found: dict[int, int] = {}
    with SSDTier(path, child.NAMESPACE, child.LAYOUT, map_size_bytes=child.MAP_SIZE_BYTES) as tier:
        out = np.empty(child.LAYOUT.bytes_per_block, dtype=np.uint8)
        entries = list(tier.scan(include_foreign=True))
        assert len(entries) == len(tier), "every stored value must have a valid header"
        for entry in entries:
            assert entry.parent == child.expected_parent(entry.key)
            out.fill(0)
            assert tier.get_into(entry.key, out), f"key {entry.key} does not verify: {tier.stats}"
            assert np.array_equal(out, child.expected_block(entry.key)), f"key {entry.key}: wrong bytes"
            batch, _ = child.key_batch_index(entry.key)
            found[batch] = found.get(batch, 0) + 1
        assert tier.verify_all() == (len(entries), 0)
        stats = tier.stats
        assert stats["checksum_failures"] == stats["decode_failures"] == stats["mismatches"] == 0
    for batch, count in found.items():
        assert count == child.BLOCKS_PER_BATCH, f"batch {batch} is partial: {count} blocks"
        assert state.get(batch) in (PRESENT, EITHER), f"batch {batch} present but {state.get(batch)}"
    for batch, expected in state.items():
        if expected == PRESENT:
            assert batch in found, f"acknowledged batch {batch} lost"
        elif expected == ABSENT:
            assert batch not in found, f"deleted batch {batch} came back"
    return len(entries)


def test_sigkill_never_leaves_partial_values(tmp_path: Path) -> None:
    rng = random.Random(SEED)
    path = tmp_path / "ssd"
    state: dict[int, str] = {}
    first_batch = 0
    num_acked_ops = 0
    for _ in range(NUM_KILLS):
        lines = run_child_until_killed(path, first_batch, rng)
        num_acked_ops += len(lines)
        first_batch = apply_lines(state, first_batch, lines)
        if path.exists():
            check_directory(path, state)
    # The loop made real progress: many commits, and some data survives.
    assert num_acked_ops >= NUM_KILLS
    assert check_directory(path, state) > 0
