"""Block diffs of a mirror against its master: lossless XOR or bounded-error lossy.

Owns: turning (master block bytes, mirror block bytes) into one
self-describing, checksummed diff value, and a verified diff value back into
the rows a restore must patch. Must not do I/O, keep state, or pick which
copy is the master (that is :mod:`kvtier.shared.index`); must never hand out
rows from a value that did not verify (a bad value is ``None``: a miss).

A block is cut into *rows* of ``row_bytes`` (by default one token's K or V in
one layer: ``num_kv_heads * head_dim * dtype_bytes``). Only rows whose bits
differ from the master are kept:

* ``lossless`` — the XOR of the raw bits of each differing row. XOR is exact
  whatever the dtype; rows of tokens the engine reused are all-zero and not
  stored, and the sign/exponent bytes of a recomputed row mostly XOR to zero.
* ``lossy`` — for float KV, the delta ``mirror - master`` of each differing row
  quantised to int16 steps of ``error_bound_abs``; the encoder replays the
  restore arithmetic and keeps any row whose restored values would miss the
  bound by more than ``error_bound_abs`` (or overflow int16) as an exact XOR
  row, so every restored element is within the bound, by construction.

Payload (before zstd): exact row indices (u32), lossy row indices (u32), the
XOR bytes of exact rows, the int16 steps of lossy rows; both arrays are
byte-plane transposed (byte ``i`` of every element together) so the
near-constant high bytes compress. The payload is one zstd frame.

Header (56 bytes, little-endian, covered by the header checksum)::

    magic "KVTD" | version u8 | mode u8 | dtype_bytes u8 | dtype id u8
    | row_bytes u32 | block_bytes u32 | num_exact u32 | num_lossy u32
    | raw_payload_len u32 | error_bound_abs f32 | payload checksum u64
    | target checksum u64 | header checksum u64

``payload checksum`` (XXH3-64 of the stored zstd frame) catches a corrupted
diff before any byte is decoded; ``target checksum`` is XXH3-64 of the block a
correct restore produces (the mirror itself when lossless), checked by
restores that ask for output verification.

>>> import numpy as np
>>> spec = DiffSpec(dtype="bfloat16", row_bytes=8)
>>> master = np.arange(32, dtype=np.uint8); mirror = master.copy(); mirror[9] ^= 0xFF
>>> value = encode_diff(master, mirror, spec)
>>> rows = decode_diff(value, block_bytes=32)
>>> rows.exact_rows.tolist(), rows.num_rows
([1], 1)
>>> decode_diff(value[:-1] + bytes([value[-1] ^ 1]), block_bytes=32) is None  # corrupted: a miss
True
"""

from __future__ import annotations

import struct
import threading
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import xxhash
import zstandard

from ..errors import ConfigError
from ..tiers.codec import join_planes, split_planes

DiffMode = Literal["lossless", "lossy"]
DIFF_MODES: tuple[str, ...] = ("lossless", "lossy")

MAGIC = b"KVTD"
FORMAT_VERSION = 1
_MODE_TO_ID = {"lossless": 0, "lossy": 1}
_ID_TO_MODE = {v: k for k, v in _MODE_TO_ID.items()}
DTYPE_TO_ID: dict[str, int] = {"bfloat16": 1, "float16": 2, "float32": 3, "uint8": 4, "int8": 5,
                               "float8_e4m3fn": 6, "float8_e5m2": 7}
_ID_TO_DTYPE = {v: k for k, v in DTYPE_TO_ID.items()}
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "uint8": 1, "int8": 1, "float8_e4m3fn": 1,
                "float8_e5m2": 1}
LOSSY_DTYPES: tuple[str, ...] = ("bfloat16", "float16", "float32")
_TORCH_FLOAT = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

_FIELDS = struct.Struct("<4sBBBBIIIIIfQQ")
_CHECK = struct.Struct("<Q")
HEADER_BYTES = _FIELDS.size + _CHECK.size
_Q_LIMIT = 32767


@dataclass(frozen=True, slots=True)
class DiffSpec:
    """How mirrors are diffed: element dtype, row size, mode, bound, zstd level.

    ``error_bound_abs`` is the largest absolute error per element a ``lossy``
    diff may restore with (ignored when ``lossless``). ``zstd_level`` 1 suits
    DRAM (fast); the SSD tier re-encodes at a higher level.
    """

    dtype: str
    row_bytes: int
    mode: DiffMode = "lossless"
    error_bound_abs: float = 0.0
    zstd_level: int = 1

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_TO_ID:
            raise ConfigError("shared.dtype", self.dtype, f"unknown dtype; valid: {sorted(DTYPE_TO_ID)}")
        if not isinstance(self.row_bytes, int) or self.row_bytes <= 0 or self.row_bytes % _DTYPE_BYTES[self.dtype]:
            raise ConfigError("shared.row_bytes", self.row_bytes,
                              f"must be a positive multiple of the {self.dtype} element size")
        if self.mode not in DIFF_MODES:
            raise ConfigError("shared.diff_mode", self.mode, f"valid: {list(DIFF_MODES)}")
        if self.mode == "lossy":
            if self.dtype not in LOSSY_DTYPES:
                raise ConfigError("shared.diff_mode", self.mode,
                                  f"lossy diffs need a float dtype ({', '.join(LOSSY_DTYPES)}), not {self.dtype}")
            if not self.error_bound_abs > 0.0:
                raise ConfigError("shared.error_bound_abs", self.error_bound_abs, "lossy diffs need a bound > 0")

    @property
    def dtype_bytes(self) -> int:
        return _DTYPE_BYTES[self.dtype]


@dataclass(frozen=True, slots=True)
class DiffHeader:
    """A parsed, checksum-valid diff header."""

    mode: DiffMode
    dtype: str
    row_bytes: int
    block_bytes: int
    num_exact: int
    num_lossy: int
    raw_payload_len: int
    error_bound_abs: float
    payload_checksum: int
    target_checksum: int


@dataclass(frozen=True, slots=True)
class DiffRows:
    """The verified content of one diff: which rows to patch and how.

    ``exact_rows`` (int64) get ``^= exact_xor[i]`` (uint8, ``row_bytes`` each);
    ``lossy_rows`` get ``master + lossy_steps[i] * step_abs`` (int16 steps per
    element) rounded to the dtype. ``target_checksum`` is that of the restored block.
    """

    header: DiffHeader
    exact_rows: np.ndarray
    exact_xor: np.ndarray
    lossy_rows: np.ndarray
    lossy_steps: np.ndarray

    @property
    def num_rows(self) -> int:
        return int(self.exact_rows.size + self.lossy_rows.size)

    @property
    def step_abs(self) -> float:
        return self.header.error_bound_abs


class _Zstd(threading.local):
    def __init__(self) -> None:
        self.compressors: dict[int, zstandard.ZstdCompressor] = {}
        self.decompressor = zstandard.ZstdDecompressor()

    def compressor(self, level: int) -> zstandard.ZstdCompressor:
        c = self.compressors.get(level)
        if c is None:
            c = self.compressors[level] = zstandard.ZstdCompressor(level=level, write_checksum=False)
        return c


_ZSTD = _Zstd()


def checksum(data: object) -> int:
    """XXH3-64 of a buffer."""
    return xxhash.xxh3_64_intdigest(data)


# ------------------------------------------------------------------ encoding


def changed_rows(master: np.ndarray, mirror: np.ndarray, row_bytes: int) -> np.ndarray:
    """Indices (int64) of the ``row_bytes`` rows whose bits differ between two blocks."""
    words = _word_view(np.bitwise_xor(master, mirror), row_bytes)
    return np.flatnonzero(words.any(axis=1))


def encode_diff(master: object, mirror: object, spec: DiffSpec) -> bytes:
    """The diff value that turns ``master`` into ``mirror`` (two blocks of equal length).

    Cost: one XOR pass over the block, then work proportional to the
    differing rows. Raises ``ValueError`` on unequal lengths or a block that
    is not a whole number of rows.
    """
    m8, r8 = _bytes_of(master), _bytes_of(mirror)
    if m8.size != r8.size or m8.size % spec.row_bytes:
        raise ValueError(f"diff: blocks of {m8.size} and {r8.size} bytes; both must be equal and a multiple "
                         f"of shared.row_bytes={spec.row_bytes}")
    xor = np.bitwise_xor(m8, r8)
    rows = np.flatnonzero(_word_view(xor, spec.row_bytes).any(axis=1))
    exact, lossy, steps = rows, rows[:0], np.empty((0, spec.row_bytes // spec.dtype_bytes), np.int16)
    target = r8
    if spec.mode == "lossy" and rows.size:
        exact, lossy, steps, target = _quantise(m8, r8, rows, spec)
    xor_rows = xor.reshape(-1, spec.row_bytes)[exact]
    payload = b"".join((
        exact.astype("<u4").tobytes(), lossy.astype("<u4").tobytes(),
        _to_planes(xor_rows, spec.dtype_bytes), _to_planes(steps.view(np.uint8), 2),
    ))
    frame = _ZSTD.compressor(spec.zstd_level).compress(payload)
    fields = _FIELDS.pack(MAGIC, FORMAT_VERSION, _MODE_TO_ID[spec.mode], spec.dtype_bytes, DTYPE_TO_ID[spec.dtype],
                          spec.row_bytes, m8.size, exact.size, lossy.size, len(payload),
                          spec.error_bound_abs if spec.mode == "lossy" else 0.0, checksum(frame), checksum(target))
    return fields + _CHECK.pack(checksum(fields)) + frame


def recompress(value: bytes, zstd_level: int) -> bytes | None:
    """The same diff with its payload re-compressed at ``zstd_level`` (the SSD tier
    uses a higher level than DRAM), or ``value`` unchanged when that is not smaller;
    ``None`` if ``value`` does not verify."""
    header = read_header(value)
    if header is None:
        return None
    payload = _payload(value, header)
    if payload is None:
        return None
    frame = _ZSTD.compressor(zstd_level).compress(payload)
    if HEADER_BYTES + len(frame) >= len(value):
        return bytes(value)
    fields = bytearray(value[: _FIELDS.size])
    _put_payload_checksum(fields, checksum(frame))
    return bytes(fields) + _CHECK.pack(checksum(bytes(fields))) + frame


def _quantise(m8: np.ndarray, r8: np.ndarray, rows: np.ndarray, spec: DiffSpec
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Split ``rows`` into exact and lossy rows; returns (exact, lossy, int16 steps, restored block)."""
    dtype = _TORCH_FLOAT[spec.dtype]
    elems = spec.row_bytes // spec.dtype_bytes
    master_rows = torch.from_numpy(m8.reshape(-1, spec.row_bytes)[rows].copy()).view(dtype).reshape(-1, elems)
    mirror_rows = torch.from_numpy(r8.reshape(-1, spec.row_bytes)[rows].copy()).view(dtype).reshape(-1, elems)
    step_abs = as_f32(spec.error_bound_abs)
    delta = (mirror_rows.float() - master_rows.float()) / step_abs
    steps_f = torch.round(delta)
    fits = steps_f.abs().le(_Q_LIMIT).all(dim=1)
    steps = torch.where(fits[:, None], steps_f, torch.zeros_like(steps_f)).to(torch.int16)
    restored = apply_steps(master_rows, steps, step_abs)
    err = (restored.float() - mirror_rows.float()).abs()
    ok = fits & err.le(spec.error_bound_abs).all(dim=1) & torch.isfinite(mirror_rows.float()).all(dim=1)
    ok_np = ok.numpy()
    target = r8.copy()
    lossy_rows = rows[ok_np]
    target.reshape(-1, spec.row_bytes)[lossy_rows] = restored[ok].view(torch.uint8).reshape(-1, spec.row_bytes).numpy()
    return rows[~ok_np], lossy_rows, steps[ok].numpy(), target


def as_f32(x: float) -> float:
    """``x`` rounded to float32 (the precision the header stores the step in)."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def apply_steps(master_rows: torch.Tensor, steps: torch.Tensor, step_abs: float) -> torch.Tensor:
    """``master + steps * step_abs`` rounded to ``master_rows.dtype`` (the one lossy
    restore formula; the encoder checks its bound with this very function)."""
    return (master_rows.float() + steps.float() * step_abs).to(master_rows.dtype)


# ------------------------------------------------------------------ decoding


def read_header(value: object) -> DiffHeader | None:
    """Parse and validate a diff header (magic, version, checksum, ids, lengths); ``None`` if off."""
    mv = memoryview(value).cast("B")
    if mv.nbytes < HEADER_BYTES or mv[:4] != MAGIC:
        return None
    fields = mv[: _FIELDS.size]
    (_, version, mode_id, dtype_bytes, dtype_id, row_bytes, block_bytes, num_exact, num_lossy, raw_len, bound,
     payload_sum, target_sum) = _FIELDS.unpack(fields)
    if version != FORMAT_VERSION or _CHECK.unpack(mv[_FIELDS.size:HEADER_BYTES])[0] != checksum(fields):
        return None
    mode, dtype = _ID_TO_MODE.get(mode_id), _ID_TO_DTYPE.get(dtype_id)
    if mode is None or dtype is None or _DTYPE_BYTES[dtype] != dtype_bytes or row_bytes == 0:
        return None
    elems = row_bytes // dtype_bytes
    expected = 4 * (num_exact + num_lossy) + num_exact * row_bytes + num_lossy * elems * 2
    if block_bytes % row_bytes or raw_len != expected or num_exact + num_lossy > block_bytes // row_bytes:
        return None
    return DiffHeader(mode, dtype, row_bytes, block_bytes, num_exact, num_lossy, raw_len, bound, payload_sum,
                      target_sum)


def decode_diff(value: object, block_bytes: int) -> DiffRows | None:
    """The rows of a verified diff for a block of ``block_bytes``; ``None`` (a miss) when
    the header, the payload checksum, the zstd frame or any row index is wrong."""
    header = read_header(value)
    if header is None or header.block_bytes != block_bytes:
        return None
    payload = _payload(value, header)
    if payload is None:
        return None
    buf = np.frombuffer(payload, dtype=np.uint8)
    ne, nl, rb = header.num_exact, header.num_lossy, header.row_bytes
    elems = rb // _DTYPE_BYTES[header.dtype]
    exact = buf[: 4 * ne].view("<u4").astype(np.int64)
    lossy = buf[4 * ne: 4 * (ne + nl)].view("<u4").astype(np.int64)
    num_rows = block_bytes // rb
    if (exact.size and int(exact.max()) >= num_rows) or (lossy.size and int(lossy.max()) >= num_rows):
        return None
    start = 4 * (ne + nl)
    xor = _from_planes(buf[start: start + ne * rb], _DTYPE_BYTES[header.dtype]).reshape(ne, rb)
    start += ne * rb
    steps = _from_planes(buf[start:], 2).view(np.int16).reshape(nl, elems)
    return DiffRows(header, exact, xor, lossy, steps)


def _payload(value: object, header: DiffHeader) -> bytes | None:
    frame = memoryview(value).cast("B")[HEADER_BYTES:]
    if checksum(frame) != header.payload_checksum:
        return None
    try:
        if zstandard.frame_content_size(frame) != header.raw_payload_len:
            return None
        payload = _ZSTD.decompressor.decompress(frame, max_output_size=header.raw_payload_len)
    except zstandard.ZstdError:
        return None
    return payload if len(payload) == header.raw_payload_len else None


def _put_payload_checksum(fields: bytearray, value: int) -> None:
    offset = _FIELDS.size - 16  # payload checksum, then target checksum, end the fields
    fields[offset: offset + 8] = struct.pack("<Q", value)


# ------------------------------------------------------------------ helpers


def _bytes_of(buf: object) -> np.ndarray:
    if isinstance(buf, torch.Tensor):
        return buf.reshape(-1).view(torch.uint8).numpy()
    if isinstance(buf, np.ndarray):
        return buf.reshape(-1).view(np.uint8)
    return np.frombuffer(buf, dtype=np.uint8)


def _word_view(a8: np.ndarray, row_bytes: int) -> np.ndarray:
    """``a8`` as rows of the widest unsigned words dividing ``row_bytes``."""
    for width, dt in ((8, np.uint64), (4, np.uint32), (2, np.uint16)):
        if row_bytes % width == 0:
            return a8.view(dt).reshape(-1, row_bytes // width)
    return a8.reshape(-1, row_bytes)


def _to_planes(a8: np.ndarray, width: int) -> bytes:
    """Bytes of ``width``-byte elements regrouped by byte position (byte 0 of all, byte 1 ...)."""
    if a8.size == 0:
        return b""
    if width == 1:
        return np.ascontiguousarray(a8).tobytes()
    if width == 2:
        high, low = split_planes(np.ascontiguousarray(a8).reshape(-1))
        return low.tobytes() + high.tobytes()
    return np.ascontiguousarray(a8.reshape(-1, width).T).tobytes()


def _from_planes(a8: np.ndarray, width: int) -> np.ndarray:
    """Inverse of :func:`_to_planes` (a new contiguous uint8 array)."""
    if width == 1 or a8.size == 0:
        return a8.copy()
    if width == 2:
        half = a8.size // 2
        out = np.empty(a8.size, dtype=np.uint8)
        join_planes(a8[half:], a8[:half], out)
        return out
    return np.ascontiguousarray(a8.reshape(width, -1).T).reshape(-1)
