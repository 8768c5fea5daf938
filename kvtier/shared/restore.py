"""Restore kernels: rebuild agents' blocks from master bytes plus decoded diffs.

Owns: the byte arithmetic of a restore into a destination block tensor
(``[num_slots, bytes_per_block]`` uint8: an engine's KV blocks or a
:class:`~kvtier.tiers.pool.TensorPool`), in two forms measured against each
other by ``kvtier bench shared``:

* **fused** — every master block of the round is copied straight into its
  destination slot (one batched copy), then every differing row of every
  agent is patched in place (one gather / XOR / scatter over the whole round
  for exact rows, one per step size for lossy rows). No block is materialised
  anywhere but in its destination.
* **dense** — the plain reconstruct-then-copy path: each agent's block is
  rebuilt in full in a staging buffer — its diff expanded to a dense XOR
  block (zeros where rows are equal), XORed with the master over the whole
  block — and the staging buffer is then copied into the destination. Both
  paths start from the same decoded rows, so the zstd decode is not counted
  twice against either.

Must not decode or verify diff values (the store hands in verified
:class:`~kvtier.shared.diff.DiffRows`), touch the index, or do I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..tiers.pool import copy_all
from .diff import DiffRows, apply_steps

_TORCH_DTYPE = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True, slots=True)
class Patch:
    """The decoded diff of one mirror segment and the destination slot of each of its blocks."""

    rows: DiffRows
    dst_slots: tuple[int, ...]


def apply_patches(dst: torch.Tensor, patches: Sequence[Patch], bytes_per_block: int) -> int:
    """Patch ``dst`` (uint8 ``[num_slots, bytes_per_block]``, holding master bytes at
    every patched slot) in place; returns the number of rows patched.

    All exact rows of all patches go through one gather / XOR / scatter; lossy
    rows through one per (dtype, step). Destination slots must be distinct.
    """
    exact_idx: list[np.ndarray] = []
    exact_xor: list[np.ndarray] = []
    lossy: dict[tuple[str, float, int], tuple[list[np.ndarray], list[np.ndarray]]] = {}
    row_bytes = 0
    for p in patches:
        h = p.rows.header
        if h.num_exact + h.num_lossy == 0:
            continue
        row_bytes = h.row_bytes
        rpb = bytes_per_block // h.row_bytes
        slots = np.asarray(p.dst_slots, dtype=np.int64)
        if h.num_exact:
            r = p.rows.exact_rows
            exact_idx.append(slots[r // rpb] * rpb + r % rpb)
            exact_xor.append(p.rows.exact_xor)
        if h.num_lossy:
            r = p.rows.lossy_rows
            idx_list, steps_list = lossy.setdefault((h.dtype, p.rows.step_abs, h.row_bytes), ([], []))
            idx_list.append(slots[r // rpb] * rpb + r % rpb)
            steps_list.append(p.rows.lossy_steps)
    num_rows = 0
    if exact_idx:
        idx = torch.from_numpy(np.concatenate(exact_idx))
        xor = torch.from_numpy(np.concatenate(exact_xor)).to(dst.device)
        rows = _words(dst.view(-1, row_bytes))
        xor_w = _words(xor)
        gathered = rows.index_select(0, idx.to(dst.device))
        gathered.bitwise_xor_(xor_w)
        rows.index_copy_(0, idx.to(dst.device), gathered)
        num_rows += idx.numel()
    for (dtype, step_abs, rb), (idx_list, steps_list) in lossy.items():
        idx = torch.from_numpy(np.concatenate(idx_list)).to(dst.device)
        steps = torch.from_numpy(np.concatenate(steps_list)).to(dst.device)
        rows = dst.view(-1, rb).view(_TORCH_DTYPE[dtype])
        rows.index_copy_(0, idx, apply_steps(rows.index_select(0, idx), steps, step_abs))
        num_rows += idx.numel()
    return num_rows


def fused_restore(dst: torch.Tensor, dst_slots: Sequence[int], srcs: Sequence[torch.Tensor],
                  patches: Sequence[Patch], bytes_per_block: int) -> int:
    """Copy ``srcs[i]`` (master block views) into ``dst[dst_slots[i]]`` in one batched
    copy, then patch the differing rows in place. Returns rows patched."""
    if srcs:
        copy_all([dst[s] for s in dst_slots], list(srcs), non_blocking=False)
    return apply_patches(dst, patches, bytes_per_block)


def dense_restore(dst: torch.Tensor, dst_slots: Sequence[int], srcs: Sequence[torch.Tensor],
                  patches: Sequence[Patch], bytes_per_block: int, staging: torch.Tensor) -> int:
    """Reconstruct-then-copy baseline. ``staging`` (uint8 ``[>= 2 * len(srcs),
    bytes_per_block]``, preallocated by the caller) holds the rebuilt blocks in
    its first half and the dense XOR blocks in its second: masters are copied
    in, every diff is expanded to a dense XOR block (zeros, then its rows),
    the halves are XORed over the whole blocks, and the result is copied into
    ``dst``. Lossless diffs only; same result as :func:`fused_restore`."""
    if any(p.rows.header.num_lossy for p in patches):
        raise ValueError("dense_restore: lossy diffs have no dense XOR form; use fused_restore")
    n = len(srcs)
    if staging.shape[0] < 2 * n:
        raise ValueError(f"dense_restore: staging has {staging.shape[0]} blocks, needs {2 * n}")
    rebuilt, xor = staging[:n], staging[n: 2 * n]
    slot_to_stage = {s: i for i, s in enumerate(dst_slots)}
    views = [rebuilt[i] for i in range(n)]
    copy_all(views, list(srcs), non_blocking=False)
    xor.zero_()
    num_rows = apply_patches(xor, [Patch(p.rows, tuple(slot_to_stage[s] for s in p.dst_slots)) for p in patches],
                             bytes_per_block)
    _words(rebuilt).bitwise_xor_(_words(xor))
    copy_all([dst[s] for s in dst_slots], views, non_blocking=False)
    return num_rows


def _words(rows8: torch.Tensor) -> torch.Tensor:
    """A uint8 ``[n, row_bytes]`` tensor as rows of the widest integer words that divide it."""
    width = rows8.shape[1]
    for nbytes, dt in ((8, torch.int64), (4, torch.int32), (2, torch.int16)):
        if width % nbytes == 0:
            return rows8.view(dt)
    return rows8
