"""What every recorded trace file shares: safe file names, atomic writes, stop reasons, totals.

Owns: the parts of writing an AgentX / Weka trace file that do not depend on
where the requests came from. Must not hold state or decide what is recorded.

>>> safe_name("tenant a/../b", 64)
'tenant_a_.._b'
>>> totals([{"type": "n", "in": 10, "out": 2}, {"type": "subagent", "requests": [{"type": "n", "in": 5, "out": 1}]}])
... # doctest: +NORMALIZE_WHITESPACE
{'parent_tokens': {'input': 10, 'output': 2}, 'subagent_tokens': {'input': 5, 'output': 1},
 'combined_tokens': {'input': 15, 'output': 3}, 'subagent_count': 1}
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

STOP_TOOL_USE = "tool_use"
STOP_END_TURN = "end_turn"
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def safe_name(text: str, limit: int) -> str:
    """``text`` as a file-name part: runs of other characters become ``_``, at most ``limit`` long."""
    return _UNSAFE.sub("_", text)[:limit] or "_"


def write_atomic(path: Path, data: bytes, *, sync: bool = True) -> None:
    """Replace ``path`` with ``data`` through a temporary file and a rename, so a process
    crash leaves the old file or the new one, never a torn one; ``sync`` also survives a
    power cut (an fsync: not for a caller on an event loop). ``OSError`` is the caller's."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        if sync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)


def totals(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """Token sums of a trace, shaped like the public traces' ``totals`` (root requests vs sub-agents')."""
    sums = {"parent": [0, 0], "subagent": [0, 0]}
    count = 0

    def walk(items: list[dict[str, Any]], who: str) -> None:
        nonlocal count
        for e in items:
            if e["type"] == "subagent":
                count += 1
                walk(e["requests"], "subagent")
            else:
                sums[who][0] += e["in"]
                sums[who][1] += e["out"]

    walk(entries, "parent")
    (p_in, p_out), (s_in, s_out) = sums["parent"], sums["subagent"]
    return {"parent_tokens": {"input": p_in, "output": p_out}, "subagent_tokens": {"input": s_in, "output": s_out},
            "combined_tokens": {"input": p_in + s_in, "output": p_out + s_out}, "subagent_count": count}
