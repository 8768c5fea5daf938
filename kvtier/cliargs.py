"""Argument types and the error path shared by every ``kvtier`` command.

Owns: :class:`Parser` (argparse with one-line errors: ``kvtier <cmd>: error:
argument --flag: ...``, exit status 2, no usage dump), range-checked numeric
types (an out-of-range or non-finite value is refused while parsing, before
any work), comma-separated lists of them, and :func:`writable_file` (an
output path whose directory must exist, checked before the work that would
write it). Must not import anything heavier than the standard library.

>>> positive_int("3")
3
>>> positive_int("0")
Traceback (most recent call last):
...
argparse.ArgumentTypeError: must be an integer >= 1, got '0'
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Callable, NoReturn


class Parser(argparse.ArgumentParser):
    """``argparse`` whose errors are one line on stderr (``PROG: error: ...``) and exit 2."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def _int(lo: int | None, what: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer {what}, got {text!r}") from None
        if lo is not None and value < lo:
            raise argparse.ArgumentTypeError(f"must be an integer {what}, got {text!r}")
        return value

    parse.__name__ = "integer"
    return parse


def _float(lo: float, hi: float | None, lo_open: bool, what: str) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number {what}, got {text!r}") from None
        bad = not math.isfinite(value) or value < lo or (lo_open and value == lo) or (hi is not None and value > hi)
        if bad:
            raise argparse.ArgumentTypeError(f"must be a finite number {what}, got {text!r}")
        return value

    parse.__name__ = "number"
    return parse


positive_int = _int(1, ">= 1")
nonnegative_int = _int(0, ">= 0")
positive_float = _float(0.0, None, True, "> 0")
nonnegative_float = _float(0.0, None, False, ">= 0")
fraction = _float(0.0, 1.0, False, "in [0, 1]")


def port(text: str) -> int:
    """A TCP port, 0..65535 (0: any free port)."""
    value = _int(0, "in 0..65535")(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be an integer in 0..65535, got {text!r}")
    return value


def listed(item: Callable[[str], object]) -> Callable[[str], tuple]:
    """A comma-separated list of ``item`` values (at least one)."""

    def parse(text: str) -> tuple:
        parts = [x for x in text.split(",") if x.strip()]
        if not parts:
            raise argparse.ArgumentTypeError(f"must list at least one value, got {text!r}")
        return tuple(item(x.strip()) for x in parts)

    parse.__name__ = "list"
    return parse


def writable_file(text: str) -> str:
    """An output file path whose directory exists and is writable (checked before the work)."""
    if not text or text.endswith(os.sep):
        raise argparse.ArgumentTypeError(f"must be a file path, got {text!r}")
    directory = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(directory):
        raise argparse.ArgumentTypeError(f"directory {directory!r} does not exist (of {text!r})")
    if not os.access(directory, os.W_OK):
        raise argparse.ArgumentTypeError(f"directory {directory!r} is not writable (of {text!r})")
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is a directory")
    return text
