"""Shared helpers for benchmarks: timing, bf16-like data, table printing."""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch


def best_seconds(fn: Callable[[], object], repeats: int = 3) -> float:
    """Smallest wall time of ``repeats`` runs of ``fn`` (least disturbed by noise)."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def interleaved_best_seconds(fns: Sequence[Callable[[], object]], repeats: int = 5, *,
                             shuffle: bool = False) -> list[float]:
    """Smallest wall time of each of ``fns`` over ``repeats`` rounds that run them in
    turn (A B C, A B C, ...): a baseline and what is compared with it see the same
    moments of a shared, noisy machine, so a ratio of two is not skewed by a
    burst of someone else's load landing on one of them. ``shuffle``: each round
    in another order (seeded), so that no function always runs right after the
    same one: a torch copy leaves its OpenMP threads spinning on the cores for a
    while after it returns, which slows whatever runs next."""
    best = [float("inf")] * len(fns)
    order = list(range(len(fns)))
    rng = random.Random(0)
    for _ in range(repeats):
        if shuffle:
            rng.shuffle(order)
        for i in order:
            start = time.perf_counter()
            fns[i]()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def gbps(num_bytes: int, seconds: float) -> float:
    return num_bytes / seconds / 1e9 if seconds > 0 else float("inf")


def bf16_blocks(num_blocks: int, block_bytes: int, seed: int = 0) -> list[torch.Tensor]:
    """``num_blocks`` blocks of bf16 values drawn like KV activations (normal, unit
    scale), each viewed as ``block_bytes`` uint8."""
    gen = torch.Generator().manual_seed(seed)
    data = torch.randn(num_blocks, block_bytes // 2, generator=gen).to(torch.bfloat16)
    return [row.view(torch.uint8) for row in data]


def print_table(rows: Sequence[dict[str, Any]], columns: Sequence[str], out=sys.stdout) -> None:
    """A plain aligned text table of ``rows`` restricted to ``columns``."""
    cells = [[_fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)), file=out)
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)), file=out)


def write_json(path: str | Path, payload: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 1000 else f"{v:.0f}"
    return "-" if v is None else str(v)
