"""Value format of the SSD tier: a checksummed header plus a (compressed) payload.

Owns: turning one block's raw bytes into one self-describing value and back.
Must not do I/O, must not import torch, and must never report unverified bytes
as valid: every way a value can be wrong (truncated, bit-flipped, foreign
namespace or layout, stored under another key, corrupt zstd frame) makes
:func:`decode_into` return ``False`` and bump a counter; it never raises for bad
data and never claims partially written output.

Header (96 bytes, little-endian, every byte covered by the header checksum)::

    magic "KVTB" | version u8 | codec u8 | flags u16 | block key 16B
    | namespace digest 16B | layout hash 8B | parent key 16B (zeros: none)
    | stored_at_s u32 | raw_len u32 | payload_len u32 | plane0_len u32
    | raw checksum u64 | header checksum u64

The block key (the same 16 big-endian bytes as the LMDB key) binds a value to
the key it was written for: a valid value found under another key (a copy or
rename bug, a restore from another store) is a ``key_mismatches`` miss, never
that key's bytes. ``stored_at_s`` is the unix time of encoding (for
``kvtier inspect``; never used to accept or reject a value).

Format versions: 2 (this one) added the block key and ``stored_at_s``. A
value of version 1 cannot prove which key it belongs to, so it is unreadable
(a ``decode_failures`` miss) and is purged at a warm restart; values of a
*newer* version are left alone (see
:meth:`kvtier.tiers.ssd.SSDTier.purge_unreadable`).

Checksums are XXH3-64 (``xxhash``; ~25 GB/s here, against ~2 GB/s for
``zlib.crc32``). The raw checksum is over the *decoded* bytes and is checked on
the caller's output buffer after decoding, for every codec, so zstd frame
checksums are not written (they would be a second, slower XXH64 pass).

Codecs (stored id in brackets):

* ``raw`` [0] — payload is the raw bytes.
* ``zstd`` [1] — one zstd frame of the raw bytes at ``zstd_level``.
* ``bplane-zstd`` [2] — for 16-bit floats: the bytes at odd offsets (the
  sign/exponent byte of little-endian bf16/fp16) and at even offsets (mantissa)
  are split into two planes; each plane is a zstd frame (flag bit set) or raw.
  The exponent plane of bf16 KV compresses ~3x with a literal-only zstd setup
  that compresses at ~0.6 GB/s and decompresses at ~1.5 GB/s; the mantissa
  plane is near random and is stored raw, so a bf16 block shrinks to ~0.67x.

* ``rq4`` [3], ``rq3`` [4] — lossy: each head vector rotated (randomized
  Hadamard) and coded with 4 or 3 bits per coordinate plus a bf16 scale
  (:mod:`kvtier.tiers.rq`; ~3.8x / ~5x smaller than bf16, relative MSE ~0.008 /
  ~0.03). The payload says bits, dtype, head_dim and rotation seed. For these
  codecs the raw checksum covers the *payload* (decoded bytes are not the
  stored ones), and is checked before decoding. Only floating-point layouts
  with a power-of-two ``head_dim``, and MLA's 512 + 64 latent (coded as nine
  64-wide vectors, the rope part scaled on its own), take them:
  :func:`check_codec_layout` refuses others at start. A block whose values
  are not all finite is stored ``raw`` instead. :meth:`ValueHeader.lossy`
  tells a reader that a value is not the exact bytes.

``auto`` (a write-time choice, never stored) picks ``bplane-zstd`` for 16-bit
dtypes and ``zstd`` otherwise, and keeps the result only if
``raw_len / payload_len >= min_ratio``; else ``raw``. Planes and blocks that
are likely incompressible (the mantissa plane; 1-byte dtypes) are first probed
on a 64 KiB sample (4 spread chunks) so their full compression is skipped.

>>> from kvtier.keys import Namespace
>>> from kvtier.layout import KVLayout
>>> layout = KVLayout(2, 1, 64, "bfloat16", 4)
>>> ctx = ValueContext.of(Namespace("m", "bfloat16", "fused", 4), layout)
>>> raw = bytes(range(256)) * (layout.bytes_per_block // 256)
>>> value = encode(raw, ctx, codec="zstd", key=BlockKey(7))
>>> out = bytearray(len(raw))
>>> decode_into(value, out, ctx, key=BlockKey(7)), bytes(out) == raw
(True, True)
>>> decode_into(value[:-1], out, ctx, key=BlockKey(7))
False
>>> decode_outcome(value, out, ctx, key=BlockKey(8))  # right bytes, wrong key
<DecodeOutcome.KEY_MISMATCH: 'key_mismatches'>
"""

from __future__ import annotations

import struct
import sys
import threading
import time
from dataclasses import dataclass
from enum import Enum
from hashlib import blake2b
from typing import MutableMapping, Sequence

import numpy as np
import xxhash
import zstandard

from ..errors import ConfigError
from ..keys import KEY_BYTES, BlockKey, Namespace, key_from_bytes, key_to_bytes
from ..layout import KVLayout
from . import rq

try:  # the optional C read path (setup.py); absent where no compiler built it
    from . import _rawread
except ImportError:  # not built, or its XXH3 binding failed its self-check
    _rawread = None

MAGIC = b"KVTB"
FORMAT_VERSION = 2
LAYOUT_HASH_BYTES = 8

CODEC_TO_ID: dict[str, int] = {"raw": 0, "zstd": 1, "bplane-zstd": 2, "rq4": 3, "rq3": 4}
ID_TO_CODEC: dict[int, str] = {v: k for k, v in CODEC_TO_ID.items()}
WRITE_CODECS: tuple[str, ...] = ("auto", *CODEC_TO_ID)
"""Codec names accepted for writes (``auto`` chooses one of the lossless others)."""
LOSSY_CODECS: frozenset[str] = frozenset(rq.RQ_BITS)
"""Codecs whose decoded bytes only approximate the block's (see :mod:`kvtier.tiers.rq`)."""

FLAG_PLANE0_ZSTD = 1  # bplane: odd-offset plane is a zstd frame
FLAG_PLANE1_ZSTD = 2  # bplane: even-offset plane is a zstd frame

_FIELDS = struct.Struct("<4sBBH16s16s8s16sIIIIQ")
_CHECK = struct.Struct("<Q")
HEADER_BYTES = _FIELDS.size + _CHECK.size
_ZERO_KEY = bytes(KEY_BYTES)
_PROBE_BYTES = 64 * 1024
_PROBE_CHUNKS = 4
_LITTLE_ENDIAN = sys.byteorder == "little"

# Exponent planes are low-entropy bytes with few long repeats: a literal-heavy
# setup (min_match 7, tiny hash table) is both faster and ~8% smaller than
# level 1 defaults on bf16 KV (measured: 2.98x vs 2.73x, 3.3 ms vs 13 ms per
# 2 MiB plane; decode 1.5 ms vs 4.7 ms).
_PLANE_PARAMS = dict(
    strategy=zstandard.STRATEGY_FAST,
    window_log=17,
    hash_log=6,
    chain_log=6,
    search_log=1,
    min_match=7,
    write_checksum=False,
    write_content_size=True,
)


class DecodeOutcome(str, Enum):
    """Result of a decode; the value of a failure is the counter it bumps."""

    OK = "ok"
    MISMATCH = "mismatches"  # valid value of another namespace or layout
    KEY_MISMATCH = "key_mismatches"  # valid value written for another block key
    DECODE_FAILURE = "decode_failures"  # bad magic/version/codec/lengths, zstd error
    CHECKSUM_FAILURE = "checksum_failures"  # header or raw checksum differs


@dataclass(frozen=True, slots=True)
class ValueContext:
    """What every value of one tier must carry: namespace, layout, dtype width; and,
    for the lossy codecs' encoder, the dtype's name and the head dimension (empty
    and 0 where only decoding is needed: an rq payload describes itself)."""

    namespace_digest: bytes
    layout_hash: bytes
    dtype_bytes: int
    dtype: str = ""
    head_dim: int = 0

    @classmethod
    def of(cls, namespace: Namespace, layout: KVLayout) -> ValueContext:
        return cls(namespace.digest, layout_hash(layout), layout.dtype_bytes, layout.dtype, layout.head_dim)


@dataclass(slots=True, unsafe_hash=True)
class ValueHeader:
    """A parsed header whose magic, version, checksum, codec and lengths are valid.
    A value (never mutated); not ``frozen`` because one is made per block of every
    SSD read and a frozen dataclass sets its 11 fields through ``object.__setattr__``."""

    codec: str
    flags: int
    key: BlockKey
    namespace_digest: bytes
    layout_hash: bytes
    parent: BlockKey | None
    stored_at_s: int
    raw_len: int
    payload_len: int
    plane0_len: int
    raw_checksum: int

    @property
    def stored_len(self) -> int:
        return HEADER_BYTES + self.payload_len

    @property
    def lossy(self) -> bool:
        """Whether decoding gives an approximation of the block (an ``rq`` codec)."""
        return self.codec in LOSSY_CODECS


def layout_hash(layout: KVLayout) -> bytes:
    """8 bytes of blake2b over :meth:`KVLayout.describe`."""
    return blake2b(layout.describe().encode(), digest_size=LAYOUT_HASH_BYTES).digest()


def checksum(data: object) -> int:
    """XXH3-64 of a buffer (the checksum of both raw bytes and headers)."""
    return xxhash.xxh3_64_intdigest(data)


def check_codec(codec: str) -> str:
    """Return ``codec`` if it is a write codec; else raise naming ``tiers.ssd.codec``."""
    if codec not in WRITE_CODECS:
        raise ConfigError("tiers.ssd.codec", codec, f"unknown codec; valid: {list(WRITE_CODECS)}")
    return codec


def check_codec_layout(codec: str, layout: KVLayout, setting: str = "tiers.ssd.codec") -> str:
    """:func:`check_codec`, and refuse a lossy codec that cannot store ``layout``'s
    blocks (MLA latents other than 512 + 64, integer or 8-bit dtypes, a head_dim
    that is not a power of two), naming ``setting``. Tiers call it when they open."""
    check_codec(codec)
    if codec in LOSSY_CODECS:
        problem = rq.layout_problem(layout)
        if problem is not None:
            raise ConfigError(setting, codec, f"cannot store layout {layout.describe()}: {problem}")
    return codec


# ---------------------------------------------------------------- encoding


class _Scratch(threading.local):
    """Per-thread zstd contexts and reusable buffers.

    zstd contexts are not thread-safe and costly to build. Fresh multi-MiB
    allocations cost more than the work done in them here (page faults on
    this VM: splitting 4 MiB into new arrays takes 5 ms, into reused ones
    0.85 ms), so plane buffers are kept per thread (the values themselves go
    into the caller's buffer: :func:`encode_into`).
    """

    def __init__(self) -> None:
        self.by_level: dict[int, zstandard.ZstdCompressor] = {}
        self.plane = zstandard.ZstdCompressor(
            compression_params=zstandard.ZstdCompressionParameters(**_PLANE_PARAMS)
        )
        self.decompressor = zstandard.ZstdDecompressor()
        self.odd = np.empty(0, dtype=np.uint8)
        self.even = np.empty(0, dtype=np.uint8)

    def level(self, level: int) -> zstandard.ZstdCompressor:
        c = self.by_level.get(level)
        if c is None:
            c = zstandard.ZstdCompressor(level=level, write_checksum=False, write_content_size=True)
            self.by_level[level] = c
        return c

    def planes(self, half: int) -> tuple[np.ndarray, np.ndarray]:
        if self.odd.size < half:
            self.odd, self.even = np.empty(half, dtype=np.uint8), np.empty(half, dtype=np.uint8)
        return self.odd[:half], self.even[:half]



_SCRATCH = _Scratch()


def encode(
    raw: object,
    ctx: ValueContext,
    codec: str = "auto",
    parent: BlockKey | None = None,
    zstd_level: int = 1,
    min_ratio: float = 1.05,
    *,
    key: BlockKey,
) -> bytes:
    """Encode one block's raw bytes (any C-contiguous buffer) into the value stored
    under ``key`` (it only decodes for that key).

    Raises ``ConfigError`` for an unknown codec and ``ValueError`` when
    ``bplane-zstd`` is asked for an odd number of bytes. Cost per 4 MiB bf16
    block on this machine: raw ~0.3 ms, bplane ~4-5 ms, zstd level 1 ~8 ms.
    """
    return b"".join(encode_parts(raw, ctx, codec, parent, zstd_level, min_ratio, key=key))


def encode_into(
    items: Sequence[tuple[BlockKey, object, BlockKey | None]],
    ctx: ValueContext,
    out: memoryview,
    codec: str = "auto",
    zstd_level: int = 1,
    min_ratio: float = 1.05,
) -> list[memoryview]:
    """:func:`encode` for ``(key, raw, parent)`` items (the shape of
    :meth:`~kvtier.tiers.ssd.SSDTier.put_many`), back to back in ``out``.

    ``out`` must hold :func:`value_bound` of every item; the returned views
    are slices of it. Reusing one ``out`` saves a fresh allocation per value,
    which costs more here than the copy. Raises ``ValueError`` if ``out`` is
    too small.
    """
    check_codec(codec)
    bound = sum(value_bound(memoryview(raw).nbytes) for _, raw, _ in items)
    if len(out) < bound:
        raise ValueError(f"encode_into: output buffer of {len(out)} bytes, {bound} needed")
    values: list[memoryview] = []
    offset = 0
    stored_at_s = _now_s()
    for key, raw, parent in items:
        start = offset
        for part in _encode_parts(raw, ctx, codec, key, parent, zstd_level, min_ratio, stored_at_s):
            nbytes = len(part)
            out[offset : offset + nbytes] = part
            offset += nbytes
        values.append(out[start:offset])
    return values


def encode_parts(
    raw: object,
    ctx: ValueContext,
    codec: str = "auto",
    parent: BlockKey | None = None,
    zstd_level: int = 1,
    min_ratio: float = 1.05,
    *,
    key: BlockKey,
) -> list:
    """:func:`encode` as pieces (the header, then the payload: for ``raw`` the caller's
    own buffer, uncopied), for a store that writes one object from several buffers.
    Pieces may be per-thread scratch: use them before the next encode in this thread."""
    return _encode_parts(raw, ctx, codec, key, parent, zstd_level, min_ratio, _now_s())


def value_bound(raw_len: int) -> int:
    """The most bytes one encoded value of a ``raw_len``-byte block can take."""
    return HEADER_BYTES + _payload_bound(raw_len)


def _now_s() -> int:
    """Unix seconds as stored in ``stored_at_s`` (clamped to u32)."""
    return min(max(0, int(time.time())), 0xFFFFFFFF)


def _payload_bound(raw_len: int) -> int:
    """Upper bound of a payload (zstd's compressBound, plus slack)."""
    return raw_len + (raw_len >> 7) + 1024


def _encode_parts(
    raw: object,
    ctx: ValueContext,
    codec: str,
    key: BlockKey,
    parent: BlockKey | None,
    zstd_level: int,
    min_ratio: float,
    stored_at_s: int,
) -> list:
    """Header and payload pieces of one value (pieces may be per-thread scratch)."""
    data = memoryview(raw).cast("B") if not isinstance(raw, bytes) else raw
    check_codec(codec)
    if codec in LOSSY_CODECS:
        packed = _encode_rq(data, ctx, codec, key)
        if packed is not None:  # the raw checksum then covers the payload: decoded bytes are not the stored ones
            header = _header(data, ctx, CODEC_TO_ID[codec], 0, 0, [packed], key, parent, stored_at_s, summed=packed)
            return [header, packed]
        codec = "raw"  # a value that is not finite: stored exact
    if codec == "auto":
        codec_id, flags, plane0_len, payload = _encode_auto(data, ctx, zstd_level, min_ratio)
    elif codec == "bplane-zstd":
        if len(data) % 2:
            raise ValueError(f"bplane-zstd needs an even byte count, got {len(data)}")
        codec_id, flags, plane0_len, payload = _encode_bplane(data, zstd_level, 0.0, probe=False)
    elif codec == "zstd":
        codec_id, flags, plane0_len, payload = 1, 0, 0, [_SCRATCH.level(zstd_level).compress(data)]
    else:
        codec_id, flags, plane0_len, payload = 0, 0, 0, [data]
    header = _header(data, ctx, codec_id, flags, plane0_len, payload, key, parent, stored_at_s)
    return [header, *payload]


def _encode_rq(data: bytes | memoryview, ctx: ValueContext, codec: str, key: BlockKey) -> bytearray | None:
    """The rq payload of ``data``, or ``None`` when a value is not finite. The
    rotation's seed is the key's low 32 bits: blocks get independent rotations."""
    if not ctx.dtype or not ctx.head_dim:
        raise ValueError(f"codec {codec} needs the layout's dtype and head_dim in the ValueContext")
    return rq.encode_payload(data, ctx.dtype, ctx.head_dim, rq.RQ_BITS[codec], int(key) & 0xFFFFFFFF)


def _encode_auto(
    data: bytes | memoryview, ctx: ValueContext, zstd_level: int, min_ratio: float
) -> tuple[int, int, int, list]:
    raw_len = len(data)
    if ctx.dtype_bytes == 2 and raw_len % 2 == 0:
        codec_id, flags, plane0_len, payload = _encode_bplane(data, zstd_level, min_ratio, probe=True)
    elif _probe(data, _SCRATCH.level(zstd_level), min_ratio):
        codec_id, flags, plane0_len, payload = 1, 0, 0, [_SCRATCH.level(zstd_level).compress(data)]
    else:
        return 0, 0, 0, [data]
    payload_len = sum(len(p) for p in payload)
    if payload_len == 0 or raw_len / payload_len < min_ratio:
        return 0, 0, 0, [data]
    return codec_id, flags, plane0_len, payload


def _encode_bplane(
    data: bytes | memoryview, zstd_level: int, min_ratio: float, probe: bool
) -> tuple[int, int, int, list]:
    """Split into planes; the exponent plane is always compressed, the mantissa
    plane (near random for real KV) only if ``probe`` is off or its sample compresses."""
    odd, even = split_planes(data, *_SCRATCH.planes(len(data) // 2))
    flags = 0
    stored = []
    for bit, plane, compressor, probe_first in (
        (FLAG_PLANE0_ZSTD, odd, _SCRATCH.plane, False),
        (FLAG_PLANE1_ZSTD, even, _SCRATCH.level(zstd_level), probe),
    ):
        frame = None
        if not probe_first or _probe(plane, compressor, min_ratio):
            frame = compressor.compress(plane)
        if frame is not None and len(frame) < len(plane):
            flags |= bit
            stored.append(frame)
        else:
            stored.append(plane)
    return 2, flags, len(stored[0]), stored


def _probe(data: object, compressor: zstandard.ZstdCompressor, min_ratio: float) -> bool:
    """Whether a sample of ``data`` (4 spread chunks, 64 KiB) compresses by ``min_ratio``."""
    mv = memoryview(data).cast("B")
    if len(mv) <= _PROBE_BYTES:
        return True  # small: just compress the whole thing
    chunk = _PROBE_BYTES // _PROBE_CHUNKS
    step = (len(mv) - chunk) // (_PROBE_CHUNKS - 1)
    sample = b"".join(mv[i * step : i * step + chunk] for i in range(_PROBE_CHUNKS))
    return len(sample) / max(1, len(compressor.compress(sample))) >= min_ratio


def split_planes(
    data: object, odd: np.ndarray | None = None, even: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(bytes at odd offsets, bytes at even offsets) of an even-length buffer,
    written into ``odd`` / ``even`` (uint8, half the length) when given."""
    a8 = np.frombuffer(data, dtype=np.uint8)
    half = a8.size // 2
    odd = np.empty(half, dtype=np.uint8) if odd is None else odd
    even = np.empty(half, dtype=np.uint8) if even is None else even
    if _LITTLE_ENDIAN:
        a16 = a8.view(np.uint16)
        np.right_shift(a16, 8, out=odd, casting="unsafe")
        np.copyto(even, a16, casting="unsafe")  # keeps the low byte
    else:
        np.copyto(odd, a8[1::2])
        np.copyto(even, a8[0::2])
    return odd, even


def join_planes(odd: np.ndarray, even: np.ndarray, out8: np.ndarray) -> None:
    """Inverse of :func:`split_planes`, writing into ``out8`` (uint8, writable)."""
    if _LITTLE_ENDIAN:
        o16 = out8.view(np.uint16)
        np.left_shift(odd, 8, out=o16, dtype=np.uint16)
        np.bitwise_or(o16, even, out=o16)
    else:
        out8[1::2] = odd
        out8[0::2] = even


def _header(
    data: bytes | memoryview,
    ctx: ValueContext,
    codec_id: int,
    flags: int,
    plane0_len: int,
    payload: list,
    key: BlockKey,
    parent: BlockKey | None,
    stored_at_s: int,
    summed: object = None,
    raw_sum: int | None = None,
) -> bytes:
    """The header; its raw checksum is of ``summed`` (default: ``data``), or ``raw_sum``
    when the caller computed it already."""
    payload_len = sum(memoryview(p).nbytes for p in payload)
    fields = _FIELDS.pack(
        MAGIC,
        FORMAT_VERSION,
        codec_id,
        flags,
        key_to_bytes(key),
        ctx.namespace_digest,
        ctx.layout_hash,
        _ZERO_KEY if parent is None else key_to_bytes(parent),
        stored_at_s,
        len(data),
        payload_len,
        plane0_len,
        checksum(data if summed is None else summed) if raw_sum is None else raw_sum,
    )
    return fields + _CHECK.pack(checksum(fields))


# ---------------------------------------------------------------- decoding


def read_header(value: object) -> ValueHeader | None:
    """Parse and validate the header of ``value``; ``None`` if anything is off.

    Checks magic, version, header checksum, codec id and flags, and that the
    payload length matches the value's length (so truncation is caught here).
    Does not check the payload itself, nor that ``header.key`` is the key the
    value was found under (callers compare; :func:`decode_into` does).
    """
    outcome, header = _parse_header(memoryview(value))
    return header if outcome is DecodeOutcome.OK else None


def _parse_header(mv: memoryview) -> tuple[DecodeOutcome, ValueHeader | None]:
    # once per block of every SSD read: unpack in place (no slices but the one hashed)
    if mv.nbytes < HEADER_BYTES:
        return DecodeOutcome.DECODE_FAILURE, None
    (magic, version, codec_id, flags, key, ns, lh, parent, stored_at_s, raw_len, payload_len, plane0_len,
     raw_sum) = _FIELDS.unpack_from(mv)
    if magic != MAGIC or version != FORMAT_VERSION:
        return DecodeOutcome.DECODE_FAILURE, None
    if _CHECK.unpack_from(mv, _FIELDS.size)[0] != checksum(mv[: _FIELDS.size]):
        return DecodeOutcome.CHECKSUM_FAILURE, None
    codec = ID_TO_CODEC.get(codec_id)
    if codec is None or payload_len != mv.nbytes - HEADER_BYTES or not _lengths_ok(
        codec, flags, raw_len, payload_len, plane0_len
    ):
        return DecodeOutcome.DECODE_FAILURE, None
    parent_key = None if parent == _ZERO_KEY else BlockKey(int.from_bytes(parent, "big"))
    header = ValueHeader(
        codec, flags, key_from_bytes(key), ns, lh, parent_key, stored_at_s, raw_len, payload_len, plane0_len, raw_sum
    )
    return DecodeOutcome.OK, header


def _lengths_ok(codec: str, flags: int, raw_len: int, payload_len: int, plane0_len: int) -> bool:
    if codec == "raw":
        return flags == 0 and plane0_len == 0 and payload_len == raw_len
    if codec == "zstd" or codec in LOSSY_CODECS:  # an rq payload's own lengths are checked as it decodes
        return flags == 0 and plane0_len == 0
    if flags & ~(FLAG_PLANE0_ZSTD | FLAG_PLANE1_ZSTD) or raw_len % 2 or plane0_len > payload_len:
        return False
    half = raw_len // 2
    plane1_len = payload_len - plane0_len
    return (flags & FLAG_PLANE0_ZSTD or plane0_len == half) and (
        flags & FLAG_PLANE1_ZSTD or plane1_len == half
    )


def decode_into(
    value: object,
    out: object,
    ctx: ValueContext,
    counters: MutableMapping[str, int] | None = None,
    *,
    key: BlockKey,
) -> bool:
    """Decode ``value``, found under ``key``, into ``out`` and verify it; ``True``
    only for verified bytes that were encoded for ``key``.

    ``out`` must be a writable, C-contiguous buffer (bytearray, numpy array,
    memoryview) of exactly the block's raw length. On ``False`` its contents
    are unspecified and must not be used; ``counters[outcome.value]`` is then
    incremented. Raises only for caller bugs (read-only or non-contiguous
    ``out``).
    """
    if _decode_raw_fast(value, out, ctx, key):
        return True
    outcome = decode_outcome(value, out, ctx, key=key)
    if outcome is DecodeOutcome.OK:
        return True
    if counters is not None:
        counters[outcome.value] = counters.get(outcome.value, 0) + 1
    return False


_RAW_ID = 0  # CODEC_TO_ID["raw"]


def _decode_raw_fast(value: object, out: object, ctx: ValueContext, key: BlockKey) -> bool:
    """:func:`decode_outcome` is ``OK`` for a ``raw`` value, checked with no header
    object built (it runs once per block of every SSD read): every check of the
    general path for that codec, in one unpack. ``False`` means "not shown OK
    here" (another codec, or any check failed); the caller then runs the general
    path, which says why. Never ``True`` where the general path would not be."""
    mv = memoryview(value)
    if mv.ndim != 1 or mv.itemsize != 1 or mv.nbytes < HEADER_BYTES:
        return False
    (magic, version, codec_id, flags, key_bytes, ns, lh, _parent, _stored_at_s, raw_len, payload_len, plane0_len,
     raw_sum) = _FIELDS.unpack_from(mv)
    if (codec_id != _RAW_ID or magic != MAGIC or version != FORMAT_VERSION or flags or plane0_len
            or payload_len != raw_len or payload_len != mv.nbytes - HEADER_BYTES or ns != ctx.namespace_digest
            or lh != ctx.layout_hash or key_bytes != key_to_bytes(key)):
        return False
    dst = memoryview(out)
    if dst.readonly or not dst.c_contiguous or dst.nbytes != raw_len:
        return False
    if _CHECK.unpack_from(mv, _FIELDS.size)[0] != checksum(mv[: _FIELDS.size]):
        return False
    if dst.format != "B" or dst.ndim != 1:
        dst = dst.cast("B")
    # numpy's copy lets go of the GIL (a memoryview slice assignment does not), as
    # does the checksum: blocks decoded on several threads copy and verify in parallel
    np.copyto(np.frombuffer(dst, np.uint8), np.frombuffer(mv, np.uint8, offset=HEADER_BYTES))
    return checksum(dst) == raw_sum


def encode_raw_many_into(items: list[tuple[BlockKey, object, BlockKey | None]], ctx: ValueContext,
                         staging: np.ndarray, slot: int) -> list[int] | None:
    """``raw`` values of ``items`` (key, block, parent) written into ``staging`` (uint8), the
    i-th at ``i * slot``: the same bytes :func:`encode_parts` gives, with every payload
    copied and checksummed in C in one call (GIL released). Returns each value's length,
    or ``None`` without the C module (the caller encodes them one by one)."""
    if _rawread is None:
        return None
    raws = [memoryview(raw).cast("B") if not isinstance(raw, bytes) else raw for _, raw, _ in items]
    dsts = [staging[i * slot + HEADER_BYTES:(i + 1) * slot] for i in range(len(items))]
    sums = _rawread.copy_sum_many(dsts, raws)
    now = _now_s()
    sizes = []
    for i, ((key, _, parent), data, raw_sum) in enumerate(zip(items, raws, sums)):
        header = _header(data, ctx, 0, 0, 0, [data], key, parent, now, raw_sum=raw_sum)
        staging[i * slot:i * slot + HEADER_BYTES] = np.frombuffer(header, dtype=np.uint8)
        sizes.append(HEADER_BYTES + len(data))
    return sizes


def raw_headers_into(items: list[tuple[BlockKey, object, BlockKey | None]], ctx: ValueContext,
                     headers: np.ndarray) -> bool:
    """The headers of ``raw`` values of ``items`` (key, block, parent) written into ``headers``
    (uint8), the i-th at ``i * HEADER_BYTES``, each payload checksummed where it is (in C,
    GIL released): header + block is the value :func:`encode_parts` gives, for a store that
    sends the two from where they are. ``False`` (nothing written) without the C module."""
    if _rawread is None:
        return False
    raws = [memoryview(raw).cast("B") if not isinstance(raw, bytes) else raw for _, raw, _ in items]
    now = _now_s()
    for i, ((key, _, parent), data, raw_sum) in enumerate(zip(items, raws, _rawread.sum_many(raws))):
        header = _header(data, ctx, 0, 0, 0, [data], key, parent, now, raw_sum=raw_sum)
        headers[i * HEADER_BYTES:(i + 1) * HEADER_BYTES] = np.frombuffer(header, dtype=np.uint8)
    return True


def copy_many(dsts: list[object], srcs: list[object]) -> bool:
    """Copy each ``srcs[i]`` to the start of ``dsts[i]`` (contiguous buffers), the bytes split
    between this thread and a second one that stays awake between copies (C, GIL released):
    a copy of a few MiB gains a core without waiting for a sleeping thread to wake. ``False``
    (nothing copied) without the C module."""
    if _rawread is None:
        return False
    _rawread.copy_many(dsts, srcs)
    return True


def copy_spans(dsts: list[object], srcs: list[object], table: object, split: bool) -> bool:
    """Copy byte spans between buffers in one pass (C, GIL released): ``table`` is an
    ``int64 [n, 5]`` array of (dst index, dst offset, src index, src offset, length)
    into ``dsts`` / ``srcs``; every span is checked against its buffers first (``ValueError``,
    nothing copied). ``split``: share the bytes with :func:`copy_many`'s second thread.
    ``False`` (nothing copied) without the C module."""
    if _rawread is None:
        return False
    _rawread.copy_spans(dsts, srcs, table, split)
    return True


def native_raw_read() -> bool:
    """Whether :func:`decode_raw_batch` runs in C (``kvtier.tiers._rawread`` was
    built and bound XXH3) rather than reporting "not shown OK" for every value."""
    return _rawread is not None


def decode_raw_batch(
    values: list[object | None], key_bytes: list[bytes], outs: list[object], ctx: ValueContext, *,
    in_place: bool = False
) -> list[bool]:
    """:func:`_decode_raw_fast` for a batch, in C with the GIL released once:
    ``True`` where ``values[i]`` (found under ``key_bytes[i]``; ``None``: absent)
    is a verified ``raw`` value now copied into ``outs[i]``. ``False`` means only
    "not shown OK here" (absent, another codec, a failed check): the caller runs
    :func:`decode_into` for it, which says why. All ``False`` without the C
    module. Never ``True`` where :func:`decode_outcome` would not be ``OK``
    (tests/test_ssd.py checks this on corrupted values). ``in_place``: each payload was
    read straight into ``outs[i]`` and ``values[i]`` is the value's header alone
    (``HEADER_BYTES``); the payload is checked where it is."""
    if _rawread is None:
        return [False] * len(values)
    return _rawread.read_raw_many(values, key_bytes, outs, MAGIC, FORMAT_VERSION, ctx.namespace_digest,
                                  ctx.layout_hash, in_place)


def scatter_raw_batch(values: list[object | None], key_bytes: list[bytes], dsts: list[object], table: object,
                      ctx: ValueContext) -> int:
    """:func:`decode_raw_batch` with no buffer between a value and where its bytes go: each of
    ``values`` is verified where it is, then copied straight into spans of ``dsts`` (C, GIL
    released once). ``table``: ``int64 [m, 4]`` of (value index, dst index, dst offset,
    length), grouped by value in increasing order and, within a value, in payload order (its
    spans tile the payload). Returns ``k``: ``values[:k]`` verified and landed; the first one
    not shown OK stops it, and nothing of it or after it is written (the caller reads those
    through :func:`decode_into`, which says why). ``-1`` (nothing copied) without the C
    module. ``ValueError`` (nothing copied) for a table outside ``dsts`` or out of order."""
    scatter = getattr(_rawread, "read_raw_scatter", None)  # (a module built before it has none)
    if scatter is None:
        return -1
    return scatter(values, key_bytes, dsts, table, MAGIC, FORMAT_VERSION, ctx.namespace_digest, ctx.layout_hash)


def decode_outcome(value: object, out: object, ctx: ValueContext, *, key: BlockKey) -> DecodeOutcome:
    """Like :func:`decode_into`, but says why a value was rejected."""
    dst = _writable_bytes(out)
    mv = memoryview(value).cast("B")
    outcome, header = _parse_header(mv)
    if header is None:
        return outcome
    if header.namespace_digest != ctx.namespace_digest or header.layout_hash != ctx.layout_hash:
        return DecodeOutcome.MISMATCH
    if header.key != key:
        return DecodeOutcome.KEY_MISMATCH
    if header.raw_len != dst.nbytes:
        return DecodeOutcome.DECODE_FAILURE
    payload = mv[HEADER_BYTES:]
    if header.lossy:
        if checksum(payload) != header.raw_checksum:
            return DecodeOutcome.CHECKSUM_FAILURE
        try:
            rq.decode_payload(payload, rq.RQ_BITS[header.codec], dst)
        except ValueError:
            return DecodeOutcome.DECODE_FAILURE
        return DecodeOutcome.OK
    try:
        _DECODERS[header.codec](header, payload, dst)
    except zstandard.ZstdError:
        return DecodeOutcome.DECODE_FAILURE
    if checksum(dst) != header.raw_checksum:
        return DecodeOutcome.CHECKSUM_FAILURE
    return DecodeOutcome.OK


def _writable_bytes(out: object) -> memoryview:
    dst = memoryview(out)
    if dst.readonly:
        raise TypeError("decode_into: out must be a writable buffer")
    if not dst.c_contiguous:
        raise TypeError("decode_into: out must be C-contiguous")
    return dst if dst.format == "B" and dst.ndim == 1 else dst.cast("B")


# Decoders write ``dst`` (lengths already validated) or raise ``ZstdError``; the
# caller verifies the raw checksum of ``dst`` afterwards.


def _decode_raw(header: ValueHeader, payload: memoryview, dst: memoryview) -> None:
    dst[:] = payload


def _decode_zstd(header: ValueHeader, payload: memoryview, dst: memoryview) -> None:
    dst[:] = _unzstd(payload, header.raw_len)


def _decode_bplane(header: ValueHeader, payload: memoryview, dst: memoryview) -> None:
    half = header.raw_len // 2
    p0, p1 = payload[: header.plane0_len], payload[header.plane0_len :]
    odd = _unzstd(p0, half) if header.flags & FLAG_PLANE0_ZSTD else p0
    even = _unzstd(p1, half) if header.flags & FLAG_PLANE1_ZSTD else p1
    out8 = np.frombuffer(dst, dtype=np.uint8)
    join_planes(np.frombuffer(odd, dtype=np.uint8), np.frombuffer(even, dtype=np.uint8), out8)


def _unzstd(frame: memoryview, expected_len: int) -> bytes:
    """One whole zstd frame of exactly ``expected_len`` bytes, or ``ZstdError``.

    The frame's declared size is checked *before* decompressing, so a corrupt
    size field cannot make us allocate an arbitrary amount of memory.
    """
    if zstandard.frame_content_size(frame) != expected_len:
        raise zstandard.ZstdError(f"zstd frame size is not {expected_len}")
    data = _SCRATCH.decompressor.decompress(frame, max_output_size=expected_len, allow_extra_data=False)
    if len(data) != expected_len:
        raise zstandard.ZstdError(f"zstd frame decoded to {len(data)} bytes, not {expected_len}")
    return data


_DECODERS = {"raw": _decode_raw, "zstd": _decode_zstd, "bplane-zstd": _decode_bplane}
