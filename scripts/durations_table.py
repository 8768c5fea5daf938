"""Where a test run's time went: per-module totals from pytest's ``--durations=0`` output.

Usage: ``python scripts/durations_table.py LOG [LOG ...] [--top N]``, where each LOG
holds the output of ``pytest --durations=0 ...`` (setup, call and teardown lines). Prints
a Markdown table, longest module first: seconds, share of the run, the number of timed
phases and the longest single phase. docs/testing.md's table comes from the engine
suite's log of a clean CI rehearsal (``scripts/test.sh`` with ``--durations=0`` added to
its engine step; see docs/testing.md).

Owns: parsing pytest's duration lines and the table. Must not: run tests.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import defaultdict
from pathlib import Path

LINE = re.compile(r"^\s*([0-9.]+)s (setup|call|teardown)\s+(\S+?)::(\S.*)$")


def parse(text: str) -> dict[str, list[tuple[float, str]]]:
    """Per module (file path): ``(seconds, "phase test")`` for each duration line."""
    out: dict[str, list[tuple[float, str]]] = defaultdict(list)
    for line in text.splitlines():
        m = LINE.match(line)
        if m:
            seconds, phase, module, test = m.groups()
            out[module].append((float(seconds), f"{phase} {test}"))
    return out


def table(per_module: dict[str, list[tuple[float, str]]], top: int) -> str:
    totals = sorted(((sum(s for s, _ in rows), module, rows) for module, rows in per_module.items()), reverse=True)
    whole = sum(t for t, _, _ in totals) or 1.0
    lines = ["| module | seconds | share | longest phase |", "|---|---:|---:|---|"]
    for total, module, rows in totals[:top]:
        longest_s, longest = max(rows)
        lines.append(f"| `{Path(module).name}` | {total:.0f} | {100 * total / whole:.0f}% | {longest} ({longest_s:.0f} s) |")
    rest = totals[top:]
    if rest:
        lines.append(f"| {len(rest)} more modules | {sum(t for t, _, _ in rest):.0f} | "
                     f"{100 * sum(t for t, _, _ in rest) / whole:.0f}% | |")
    lines.append(f"| **all** | **{whole:.0f}** | 100% | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="Example: python scripts/durations_table.py engine.log --top 15")
    ap.add_argument("logs", nargs="+", type=Path, help="files holding pytest --durations=0 output")
    ap.add_argument("--top", type=int, default=15, help="modules listed before the rest are summed (default 15)")
    args = ap.parse_args(argv)
    per_module: dict[str, list[tuple[float, str]]] = defaultdict(list)
    for log in args.logs:
        try:
            text = log.read_text(errors="replace")
        except OSError as e:
            print(f"durations_table: cannot read {log}: {e.strerror}", file=sys.stderr)
            return 2
        for module, rows in parse(text).items():
            per_module[module].extend(rows)
    if not per_module:
        print(f"durations_table: no pytest duration lines in {', '.join(map(str, args.logs))} "
              "(run pytest with --durations=0)", file=sys.stderr)
        return 1
    print(table(per_module, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
