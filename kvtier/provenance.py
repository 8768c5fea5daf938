"""Where a result came from: the commit, whether the code differed from it, and the command.

Owns: the provenance stamp every result JSON carries (``kvtier replay`` /
``kvtier tune`` reports and the ``bench/`` scripts' files), so that a figure
can be traced to the code that produced it and ``bench/stale_results.py`` can
tell which committed results predate a change to their inputs. Must not fail a
run: outside a git checkout (an installed package) the git fields are
``None``.

>>> stamp = provenance()
>>> sorted(stamp) == ["command", "commit", "kvtier_dirty"]
True
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any, Sequence

ROOT = Path(__file__).resolve().parent.parent  # the checkout, when kvtier runs from one


def git(*args: str, root: Path = ROOT) -> str | None:
    """``git ARGS`` in ``root``, stripped stdout; ``None`` where git is absent or fails."""
    try:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True,
                              timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def provenance(paths: Sequence[str] = ("kvtier",), *, dirty_key: str = "kvtier_dirty",
               argv: Sequence[str] | None = None) -> dict[str, Any]:
    """``{"commit", dirty_key, "command"}``: HEAD, whether ``paths`` have uncommitted
    changes (``None`` where git cannot say), and the command line of this process."""
    status = git("status", "--porcelain", "--", *paths)
    args = list(sys.argv if argv is None else argv)
    if args and args[0].endswith(("/kvtier", "kvtier/__main__.py")):
        args[0] = "kvtier"
    return {"commit": git("rev-parse", "HEAD"), dirty_key: None if status is None else bool(status),
            "command": shlex.join(args)}
