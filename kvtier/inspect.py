"""``kvtier inspect DIR``: what an SSD tier directory holds, and whether it verifies.

Owns: a read-only walk over an LMDB tier directory that groups values by
namespace, layout and codec (read from each value's header, so no config is
needed), reports how old the values are (each value carries its store time)
and, unless told not to, decodes every value to verify its checksum. With
``blocks=True`` it also prints one line per value. Must not write to the
directory.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TextIO

import lmdb

from .errors import StorageError
from .tiers.lmdbfile import data_file_problem
from .keys import KEY_BYTES, BlockKey, key_from_bytes
from .tiers.codec import FORMAT_VERSION, MAGIC, DecodeOutcome, ValueContext, ValueHeader, decode_outcome, read_header


@dataclass(slots=True)
class _Group:
    """Running totals of one (namespace, layout, codec) group."""

    num_blocks: int = 0
    raw_bytes: int = 0
    stored_bytes: int = 0
    num_bad: int = 0
    stored_at_s: list[int] = field(default_factory=list)


def inspect_dir(path: str, *, verify: bool = True, blocks: bool = False, out: TextIO) -> int:
    """Print a summary of ``path`` (and one line per value if ``blocks``); returns 0
    when every value verifies, 1 otherwise. O(stored bytes) with ``verify``."""
    if not os.path.isdir(path) or not os.path.exists(os.path.join(path, "data.mdb")):
        raise StorageError(f"{path!r} is not an SSD tier directory (no data.mdb); see tiers.ssd.path")
    bad = data_file_problem(path)
    if bad is not None:  # never map it: a truncated file is a SIGBUS, not an exception
        raise StorageError(f"{path!r}: {bad}; not opened")
    now_s = time.time()
    try:
        env = lmdb.open(path, readonly=True, lock=False, subdir=True, max_readers=8)
    except lmdb.Error as exc:
        raise StorageError(f"{path!r}: cannot open LMDB environment: {exc}") from exc
    groups: dict[tuple[str, str, str], _Group] = defaultdict(_Group)
    num_unreadable = num_old_format = num_misplaced = 0
    block_lines: list[str] = []
    try:
        with env.begin(buffers=True) as txn:
            for key_mv, value in txn.cursor():
                key_bytes = bytes(key_mv)
                header = read_header(value)
                if header is None or len(key_bytes) != KEY_BYTES:
                    num_unreadable += 1
                    num_old_format += _older_format(value)
                    continue
                key = key_from_bytes(key_bytes)
                g = groups[(header.namespace_digest.hex()[:16], header.layout_hash.hex(), header.codec)]
                g.num_blocks += 1
                g.raw_bytes += header.raw_len
                g.stored_bytes += header.stored_len
                g.stored_at_s.append(header.stored_at_s)
                status = _status(value, header, key, verify)
                num_misplaced += status == DecodeOutcome.KEY_MISMATCH.value
                g.num_bad += status not in ("ok", "-")
                if blocks:
                    block_lines.append(_block_line(key, header, now_s, status))
    finally:
        env.close()
    _print_summary(path, groups, num_unreadable, num_old_format, num_misplaced, now_s, verify, out)
    if blocks:
        print(f"{'key':>34}  {'parent':>34}  {'codec':>11}  {'stored_B':>9}  {'age':>8}  status", file=out)
        for line in block_lines:
            print(line, file=out)
    bad_total = num_unreadable + sum(g.num_bad for g in groups.values())
    return 1 if bad_total else 0


def _status(value: memoryview, header: ValueHeader, key: BlockKey, verify: bool) -> str:
    """``ok``, ``-`` (not verified) or the failed :class:`DecodeOutcome`'s counter name.
    A value whose header names another key is flagged even without ``verify``."""
    if header.key != key:
        return DecodeOutcome.KEY_MISMATCH.value
    if not verify:
        return "-"
    ctx = ValueContext(header.namespace_digest, header.layout_hash, 2)
    return decode_outcome(value, bytearray(header.raw_len), ctx, key=key).value


def _older_format(value: memoryview) -> bool:
    """Whether ``value`` is a kvtier value of an older format version (e.g. 1)."""
    return value.nbytes > 4 and value[:4] == MAGIC and value[4] < FORMAT_VERSION


def _block_line(key: BlockKey, header: ValueHeader, now_s: float, status: str) -> str:
    parent = "-" if header.parent is None else f"{header.parent:#034x}"
    return (f"{key:#034x}  {parent:>34}  {header.codec:>11}  {header.stored_len:>9}"
            f"  {_age(now_s - header.stored_at_s):>8}  {status}")


def _print_summary(path: str, groups: dict[tuple[str, str, str], _Group], num_unreadable: int,
                   num_old_format: int, num_misplaced: int, now_s: float, verify: bool, out: TextIO) -> None:
    print(f"{path}: {sum(g.num_blocks for g in groups.values())} blocks, {num_unreadable} values with a bad header",
          file=out)
    if num_old_format:
        print(f"{num_old_format} values of an older format version (unreadable; purged at the next warm restart)",
              file=out)
    if num_misplaced:
        print(f"{num_misplaced} values stored under another key than they were written for (never served)",
              file=out)
    mtime_s = os.path.getmtime(os.path.join(path, "data.mdb"))
    print(f"last written {_age(now_s - mtime_s)} ago (data.mdb modified)", file=out)
    print(f"{'namespace':>16}  {'layout':>16}  {'codec':>11}  {'blocks':>8}  {'raw_MiB':>9}  {'stored_MiB':>10}"
          f"  {'ratio':>6}  {'newest':>8}  {'oldest':>8}  {'bad':>5}", file=out)
    for (ns, lay, codec), g in sorted(groups.items()):
        ratio = g.raw_bytes / g.stored_bytes if g.stored_bytes else 0.0
        bad_txt = str(g.num_bad) if verify else "-"
        newest, oldest = _age(now_s - max(g.stored_at_s)), _age(now_s - min(g.stored_at_s))
        print(f"{ns:>16}  {lay:>16}  {codec:>11}  {g.num_blocks:>8}  {g.raw_bytes / 2**20:>9.1f}"
              f"  {g.stored_bytes / 2**20:>10.1f}  {ratio:>6.2f}  {newest:>8}  {oldest:>8}  {bad_txt:>5}", file=out)


def _age(age_s: float) -> str:
    """``3h05m`` style age (one token: no spaces) of ``age_s`` seconds; ``0s`` if negative."""
    s = max(0, int(age_s))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"
