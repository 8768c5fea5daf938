"""``kvtier inspect DIR``: what an SSD tier directory holds, and whether it verifies.

Owns: a read-only walk over an LMDB tier directory that groups values by
namespace, layout and codec (read from each value's header, so no config is
needed) and, unless told not to, decodes every value to verify its checksum.
Must not write to the directory.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from typing import TextIO

import lmdb

from .errors import StorageError
from .tiers.codec import ValueContext, decode_outcome, read_header


def inspect_dir(path: str, *, verify: bool = True, out: TextIO) -> int:
    """Print a summary of ``path``; returns 0 when every value verifies, 1 otherwise."""
    if not os.path.isdir(path) or not os.path.exists(os.path.join(path, "data.mdb")):
        raise StorageError(f"{path!r} is not an SSD tier directory (no data.mdb); see tiers.ssd.path")
    env = lmdb.open(path, readonly=True, lock=False, subdir=True, max_readers=8)
    groups: dict[tuple[str, str, str], list[int]] = defaultdict(lambda: [0, 0, 0, 0])  # blocks, raw, stored, bad
    unreadable = 0
    try:
        with env.begin(buffers=True) as txn:
            for _key, value in txn.cursor():
                header = read_header(value)
                if header is None:
                    unreadable += 1
                    continue
                g = groups[(header.namespace_digest.hex()[:16], header.layout_hash.hex(), header.codec)]
                g[0] += 1
                g[1] += header.raw_len
                g[2] += header.stored_len
                if verify:
                    ctx = ValueContext(header.namespace_digest, header.layout_hash, 2)
                    scratch = bytearray(header.raw_len)
                    if decode_outcome(value, scratch, ctx).value != "ok":
                        g[3] += 1
    finally:
        env.close()
    print(f"{path}: {sum(g[0] for g in groups.values())} blocks, {unreadable} values with a bad header", file=out)
    print(f"last written {_age(os.path.getmtime(os.path.join(path, 'data.mdb')))} ago "
          "(values carry no timestamp of their own; this is the directory's)", file=out)
    print(f"{'namespace':>16}  {'layout':>16}  {'codec':>11}  {'blocks':>8}  {'raw_MiB':>9}  {'stored_MiB':>10}"
          f"  {'ratio':>6}  {'bad':>5}", file=out)
    for (ns, lay, codec), (n, raw, stored, bad) in sorted(groups.items()):
        ratio = raw / stored if stored else 0.0
        bad_txt = str(bad) if verify else "-"
        print(f"{ns:>16}  {lay:>16}  {codec:>11}  {n:>8}  {raw / 2**20:>9.1f}  {stored / 2**20:>10.1f}"
              f"  {ratio:>6.2f}  {bad_txt:>5}", file=out)
    bad_total = unreadable + sum(g[3] for g in groups.values())
    return 1 if bad_total else 0


def _age(mtime: float) -> str:
    """``3h 05m`` style age of a file modified at ``mtime``."""
    s = max(0, int(time.time() - mtime))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60:02d}s"
    return f"{s // 3600}h {s % 3600 // 60:02d}m"
