"""Running a ``kvtier`` command in-process and reading its one-line error, for the tests of bad flags."""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.cli import main


def cli_error(argv: Sequence[str], capsys) -> tuple[int, list[str], str]:
    """Run ``kvtier argv``; returns its exit status, the non-blank lines of its stderr and the stderr."""
    try:
        rc = main(list(argv))
    except SystemExit as done:
        rc = done.code
    err = capsys.readouterr().err
    return rc, [x for x in err.strip().splitlines() if x.strip()], err
