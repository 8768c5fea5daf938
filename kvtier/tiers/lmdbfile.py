"""Is an LMDB data file safe to map? Checked before LMDB opens it.

Owns: reading the two meta pages of an LMDB ``data.mdb`` (LMDB 0.9's on-disk
format, little-endian 64-bit: a 16-byte page header, then ``mm_magic``
0xBEEFC0DE, ``mm_version`` 1, address, map size, the free and main DB
records of 48 bytes each — the free DB's first word is the page size — then
``mm_last_pg`` and ``mm_txnid``), and saying in words what is wrong with a
file whose newest meta page is missing, foreign, or points past the file's
end. LMDB maps the whole file: a page past the end of a truncated file is a
SIGBUS that kills the process, with no Python exception to catch, so a
cache must look before it maps. Must not open, lock or change the file.

>>> import tempfile, os
>>> d = tempfile.mkdtemp()
>>> open(os.path.join(d, "data.mdb"), "wb").close()
>>> data_file_problem(d)
'data.mdb is empty (0 bytes)'
"""

from __future__ import annotations

import os
import struct

MAGIC = 0xBEEFC0DE
VERSION = 1
_PAGE_HEADER = 16
_MIN_META_BYTES = _PAGE_HEADER + 8 + 16 + 2 * 48 + 16  # through mm_txnid


def _meta(buf: bytes, offset: int) -> tuple[int, int, int] | None:
    """(page size, last page, txn id) of the meta page at ``offset``, or None if not one."""
    if len(buf) < offset + _MIN_META_BYTES:
        return None
    magic, version = struct.unpack_from("<II", buf, offset + _PAGE_HEADER)
    if magic != MAGIC or version != VERSION:
        return None
    dbs = offset + _PAGE_HEADER + 24
    (page_size,) = struct.unpack_from("<I", buf, dbs)
    last_pg, txnid = struct.unpack_from("<QQ", buf, dbs + 96)
    if page_size < 512 or page_size & (page_size - 1):
        return None
    return page_size, last_pg, txnid


def data_file_problem(directory: str) -> str | None:
    """What makes ``directory``'s ``data.mdb`` unsafe to map, in words; ``None`` when
    it is sound (or absent: LMDB creates it). O(1): reads at most two pages."""
    path = os.path.join(directory, "data.mdb")
    try:
        size = os.path.getsize(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"data.mdb cannot be read: {exc.strerror or exc}"
    if size == 0:
        return "data.mdb is empty (0 bytes)"
    try:
        with open(path, "rb") as f:
            head = f.read(_MIN_META_BYTES)
            first = _meta(head, 0)
            if first is None:
                return f"data.mdb ({size:,} bytes) does not start with an LMDB meta page"
            f.seek(first[0])
            second = _meta(f.read(_MIN_META_BYTES), 0)
    except OSError as exc:
        return f"data.mdb cannot be read: {exc.strerror or exc}"
    metas = [m for m in (first, second) if m is not None and m[0] == first[0]]
    page_size, last_pg, _ = max(metas, key=lambda m: m[2])
    need = (last_pg + 1) * page_size
    if size < need:
        return (f"data.mdb is truncated: {size:,} bytes, but its newest meta page uses pages up to {last_pg:,} "
                f"({need:,} bytes)")
    return None
