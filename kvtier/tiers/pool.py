"""Fixed-slot tensor pools: the bytes of the ``hbm`` and ``dram`` tiers.

Owns: one pre-allocated ``uint8`` tensor of ``num_slots x bytes_per_block``
(on the accelerator for ``hbm``; in host memory, pinned when an accelerator
is present, for ``dram``), and copies into and out of its slots. No
allocation per block; :meth:`TensorPool.view` is zero-copy. Must not decide
which slot holds what: the TierManager hands out slots.

Also the helpers that turn the caller's tensors into what the copies need:
byte views (:func:`as_byte_tensors`), one view of a run of adjacent blocks
(:func:`host_run`), and buffer-protocol views for the SSD codec, which takes
no tensors (:func:`host_buffers`, :meth:`TensorPool.host_buffers`).
"""

from __future__ import annotations

import ctypes
import functools
import operator
from typing import Any, Sequence

import torch

from ..errors import ConfigError


def accelerator_device() -> torch.device | None:
    """The first CUDA or Ascend NPU device, or ``None`` on a CPU-only machine."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    npu = getattr(torch, "npu", None)
    if npu is not None and npu.is_available():  # torch_npu registers torch.npu
        return torch.device("npu", npu.current_device())
    return None


def resolve_device(spec: str) -> torch.device:
    """``auto`` → the accelerator if present else CPU; otherwise a torch device string."""
    if spec == "auto":
        return accelerator_device() or torch.device("cpu")
    try:
        return torch.device(spec)
    except RuntimeError as exc:
        raise ConfigError("tiers.hbm.device", spec, f"not a torch device ({exc})") from None


def as_byte_tensor(buf: Any) -> torch.Tensor:
    """A flat ``uint8`` view of a contiguous tensor, numpy array or bytes-like (no copy
    where the input allows it)."""
    if isinstance(buf, torch.Tensor):
        if buf.dtype == torch.uint8 and buf.dim() == 1:
            return buf
        if not buf.is_contiguous():
            raise ValueError("KV buffers must be contiguous tensors")
        return buf.reshape(-1).view(torch.uint8)
    if isinstance(buf, (bytes, bytearray, memoryview)):
        mv = memoryview(buf)
        if mv.readonly:
            return torch.frombuffer(bytearray(mv), dtype=torch.uint8)
        return torch.frombuffer(mv, dtype=torch.uint8)
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy is a dependency
        raise TypeError(f"unsupported KV buffer type {type(buf).__name__}") from None
    if isinstance(buf, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(buf).reshape(-1).view(np.uint8))
    raise TypeError(f"unsupported KV buffer type {type(buf).__name__}; use a tensor, ndarray or bytes")


def as_byte_tensors(bufs: Sequence[Any], nbytes: int) -> list[torch.Tensor] | None:
    """:func:`as_byte_tensor` of each of ``bufs``, or ``None`` when one of them does
    not hold exactly ``nbytes`` bytes. When every buffer already is a flat
    ``uint8`` tensor of that size (engines and pools hand over such views) that
    is checked by C-speed maps over two tensor attributes, with no Python call
    per buffer: this runs once per block of every put and get."""
    n = len(bufs)
    if (
        all(map(_IS_TENSOR, bufs))
        and list(map(_DTYPE, bufs)).count(_U8) == n
        and list(map(_SHAPE, bufs)).count((nbytes,)) == n
    ):
        return list(bufs)
    ts = list(map(as_byte_tensor, bufs))
    return ts if list(map(torch.Tensor.numel, ts)).count(nbytes) == n else None


_HAS_FOREACH_COPY = hasattr(torch, "_foreach_copy_")
_IS_CPU = operator.attrgetter("is_cpu")
_DATA_PTR = torch.Tensor.data_ptr
_IS_CONTIGUOUS = torch.Tensor.is_contiguous
_DTYPE = operator.attrgetter("dtype")
_SHAPE = operator.attrgetter("shape")
_IS_TENSOR = torch.Tensor.__instancecheck__
_U8 = torch.uint8
_NBYTES = operator.attrgetter("nbytes")


@functools.cache
def _byte_array(nbytes: int) -> Any:
    """The ctypes type of ``nbytes`` unsigned bytes (made once per block size)."""
    return ctypes.c_ubyte * nbytes


def host_buffers(ts: Sequence[torch.Tensor], nbytes: int) -> list[Any] | None:
    """Writable buffer-protocol views of ``ts`` for code that takes buffers, not
    tensors (the SSD tier's codec), or ``None`` unless every tensor is a
    contiguous host tensor of exactly ``nbytes`` bytes (the caller then falls
    back to ``Tensor.numpy()``).

    Each view is a ctypes array over the tensor's data pointer, made by C-speed
    maps: about 0.3 us a block against 1.4 us for ``Tensor.numpy()`` (this
    runs once per block of every SSD read and write; 256 KiB take about 40 us
    to copy). The views do not keep their tensors alive: use them only while
    the caller holds ``ts``."""
    n = len(ts)
    if not (all(map(_IS_CPU, ts)) and all(map(_IS_CONTIGUOUS, ts)) and list(map(_NBYTES, ts)).count(nbytes) == n):
        return None
    return list(map(_byte_array(nbytes).from_address, map(_DATA_PTR, ts)))


def host_run(ts: Sequence[torch.Tensor], nbytes: int) -> torch.Tensor | None:
    """``ts`` (flat ``uint8`` tensors of ``nbytes`` bytes each) as one ``[len(ts),
    nbytes]`` view, when they are adjacent blocks of one host buffer, in order:
    ``ts[i]`` contiguous and starting ``i * nbytes`` bytes after ``ts[0]``, all
    inside ``ts[0]``'s storage (rows of one tensor, such as an engine's or a
    host pool's pages, usually are). ``None`` otherwise. C-speed checks only."""
    n = len(ts)
    if n < 2:
        return None
    first = ts[0]
    p0 = first.data_ptr()
    if (
        ts[1].data_ptr() != p0 + nbytes  # separate buffers (most gets) fail here, before any map
        or not all(map(_IS_CPU, ts))
        or list(map(_DATA_PTR, ts)) != list(range(p0, p0 + n * nbytes, nbytes))
        or not all(map(_IS_CONTIGUOUS, ts))
        or first.storage_offset() + n * nbytes > first.untyped_storage().nbytes()
    ):
        return None
    return first.as_strided((n, nbytes), (nbytes, 1))


def copy_all(dsts: list[torch.Tensor], srcs: list[torch.Tensor], non_blocking: bool) -> None:
    """``dsts[i].copy_(srcs[i])`` for all i in one call (one C++ loop, no per-block
    Python dispatch) when one ``_foreach_copy_`` may copy every pair: all on the
    host (it converts dtypes there itself; tested with ``is_cpu``, which builds
    no ``torch.device``, mapped at C speed: once per block of every copy), or
    every pair sharing dtype and device. Per pair otherwise."""
    if _HAS_FOREACH_COPY and (
        (all(map(_IS_CPU, dsts)) and all(map(_IS_CPU, srcs)))
        or all(d.dtype == s.dtype and d.device == s.device for d, s in zip(dsts, srcs))
    ):
        torch._foreach_copy_(dsts, srcs, non_blocking=non_blocking)
        return
    for d, s in zip(dsts, srcs):
        d.copy_(s, non_blocking=non_blocking)


class TensorPool:
    """``num_slots`` blocks of ``bytes_per_block`` bytes on ``device``."""

    def __init__(self, num_slots: int, bytes_per_block: int, device: torch.device, *, pin_memory: bool = False) -> None:
        self.num_slots = num_slots
        self.bytes_per_block = bytes_per_block
        self.device = device
        pin = pin_memory and device.type == "cpu" and accelerator_device() is not None
        self.pinned = pin
        # zeros, not empty: every page is faulted in now, not on the first put
        self.data = torch.zeros((num_slots, bytes_per_block), dtype=torch.uint8, device=device, pin_memory=pin)
        self._views = list(self.data.unbind(0))  # one zero-copy view per slot, made once
        self._non_blocking = pin or device.type != "cpu"
        self._asynchronous = device.type != "cpu"  # copies into or out of it need a synchronize()
        # a host pool copies with one _foreach_copy_ whenever the caller's tensors are on the host too
        self._host = device.type == "cpu"
        self._host_foreach = self._host and _HAS_FOREACH_COPY

    @property
    def nbytes(self) -> int:
        return self.num_slots * self.bytes_per_block

    def view(self, slot: int) -> torch.Tensor:
        """Zero-copy ``uint8`` view of one slot."""
        return self._views[slot]

    def host_buffers(self, slots: Sequence[int]) -> list[Any]:
        """Writable buffer-protocol views of ``slots`` of a host pool (see
        :func:`host_buffers`; made from the slots' addresses, no tensor touched).
        They are valid while this pool lives."""
        if not self._host:
            raise ValueError(f"host_buffers: a pool on {self.device} has no host memory to view")
        if slots and not (0 <= min(slots) and max(slots) < self.num_slots):
            raise IndexError(f"host_buffers: slots {min(slots)}..{max(slots)} outside 0..{self.num_slots - 1}")
        base, size = self.data.data_ptr(), self.bytes_per_block
        return list(map(_byte_array(size).from_address, [base + s * size for s in slots]))

    def write(self, slots: list[int] | tuple[int, ...], srcs: list[torch.Tensor]) -> list[bool]:
        """Copy each ``srcs[i]`` (``bytes_per_block`` bytes) into ``slots[i]``."""
        if self._is_slot_run(slots):
            src = host_run(srcs, self.bytes_per_block)
            if src is not None:  # adjacent blocks into adjacent slots: one copy
                self.data[slots[0] : slots[0] + len(slots)].copy_(src)
                return [True] * len(slots)
        self._copy(list(map(self._views.__getitem__, slots)), srcs, srcs)
        return [True] * len(slots)

    def read(self, slots: list[int] | tuple[int, ...], dsts: list[torch.Tensor]) -> list[bool]:
        """Copy ``slots[i]`` into the caller's ``dsts[i]``."""
        dsts = list(dsts)
        if self._is_slot_run(slots):
            dst = host_run(dsts, self.bytes_per_block)
            if dst is not None:  # adjacent slots into adjacent blocks: one copy
                dst.copy_(self.data[slots[0] : slots[0] + len(slots)])
                return [True] * len(slots)
        self._copy(dsts, list(map(self._views.__getitem__, slots)), dsts)
        return [True] * len(slots)

    def _is_slot_run(self, slots: list[int] | tuple[int, ...]) -> bool:
        """True when ``slots`` are several adjacent slots, in order (a fresh chain's
        usually are), of a host pool. Plain int checks: the view of the run is
        made only once the caller's buffers form a run too."""
        n = len(slots)
        if n < 2 or not self._host:
            return False
        first = slots[0]
        return slots[-1] == first + n - 1 and list(slots) == list(range(first, first + n))

    def _copy(self, dsts: list[torch.Tensor], srcs: list[torch.Tensor], callers: list[torch.Tensor]) -> None:
        """``copy_all(dsts, srcs)`` where one side is this pool's views and ``callers``
        the other: only the caller's tensors are checked (the pool's side is
        on the pool's device by construction; once per block of every put and
        get, each check reads a tensor that is likely out of cache)."""
        if self._host_foreach and all(map(_IS_CPU, callers)):
            torch._foreach_copy_(dsts, srcs, non_blocking=self._non_blocking)
        else:
            copy_all(dsts, srcs, self._non_blocking)
        if self._asynchronous:
            self.synchronize()

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        elif self.device.type == "npu":  # pragma: no cover - needs Ascend hardware
            torch.npu.current_stream(self.device).synchronize()  # type: ignore[attr-defined]
