"""Validate AgentX / Weka trace files with aiperf's own ``WekaTrace`` model.

Run with an interpreter that has aiperf (see setup_aiperf_venv.sh); needs no
kvtier. Every ``.json`` file under the given paths is validated; prints one
JSON line ``{"aiperf": VERSION, "valid": N, "invalid": [{"file", "errors"}]}``
and exits 1 when a file is invalid (2 when no file was found).

    .venv-aiperf/bin/python integrations/aiperf/check_traces.py DIR_OR_FILE...
"""

from __future__ import annotations

import json
import sys
from importlib.metadata import version
from pathlib import Path

from aiperf.dataset.loader.weka_trace_models import WekaTrace
from pydantic import ValidationError


def main(paths: list[str]) -> int:
    files = sorted(f for p in map(Path, paths) for f in ([p] if p.is_file() else p.rglob("*.json")))
    invalid = []
    for f in files:
        try:
            WekaTrace.model_validate(json.loads(f.read_text(encoding="utf-8")))
        except (ValidationError, ValueError) as e:
            errors = e.errors(include_url=False) if isinstance(e, ValidationError) else [str(e)]
            invalid.append({"file": str(f), "errors": [str(x) for x in errors[:5]]})
    print(json.dumps({"aiperf": version("aiperf"), "valid": len(files) - len(invalid), "invalid": invalid}))
    return 2 if not files else (1 if invalid else 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
