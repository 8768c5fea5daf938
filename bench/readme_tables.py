#!/usr/bin/env python3
"""Results tables in the README (and bench/RESULTS.md) written from committed JSON.

Owns: the registry of generated tables (name -> the JSON file under
``bench/out/`` it reads and the function that renders it as markdown), and
rewriting or checking every block between the markers

    <!-- table:NAME -->
    ...generated markdown...
    <!-- /table:NAME -->

in ``README.md``, the pages under ``docs/`` and ``bench/RESULTS.md``. Must not run replays or benchmarks
(the scripts that write ``bench/out/*.json`` do: ``bench/replay_results.py``,
``bench/tune_kvtier.py``, ``bench/misc_results.py``, ``bench/connector_path.py``, ``bench/soak_serve.py``,
``bench/chaos_serve.py``, and
``kvtier tune --json`` for ``tune-dev*.json``, with the command in the table's caption); figures reach a
document only through here, so a stale figure is a failed check
(``tests/test_readme_tables.py``).

Usage: ``python bench/readme_tables.py`` rewrites the blocks;
``python bench/readme_tables.py --check`` exits 1 naming every block whose
text differs from what its JSON gives.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "out"
DOCUMENTS = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "bench" / "RESULTS.md")
_BLOCK = re.compile(r"(<!-- table:(?P<name>[\w.-]+) -->\n)(?P<body>.*?)(<!-- /table:(?P=name) -->)", re.S)

Render = Callable[[dict[str, Any]], str]
TABLES: dict[str, tuple[str | tuple[str, ...], Render]] = {}


def table(name: str, json_name: str | tuple[str, ...]) -> Callable[[Render], Render]:
    """Register ``fn`` as the renderer of table ``name`` from ``bench/out/<json_name>``
    (several names: ``fn`` gets ``{json name: its data}``)."""

    def deco(fn: Render) -> Render:
        if name in TABLES:
            raise ValueError(f"table {name!r} registered twice")
        TABLES[name] = (json_name, fn)
        return fn

    return deco


def md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def _load_renderers() -> None:
    """Import the modules that register tables (each next to this file)."""
    sys.modules.setdefault("readme_tables", sys.modules[__name__])  # one registry, also when run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    try:
        import replay_tables  # noqa: F401  (registers the replay tables)
        import misc_tables  # noqa: F401  (registers the rounds / shared tables)
        import datapath_tables  # noqa: F401  (registers the connector byte-path table)
        import codec_tables  # noqa: F401  (registers the codec tables)
        import soak_tables  # noqa: F401  (registers the server soak's table)
    finally:
        sys.path.pop(0)


def render(name: str, out_dir: Path = OUT) -> str:
    if not TABLES:
        _load_renderers()
    try:
        json_name, fn = TABLES[name]
    except KeyError:
        raise SystemExit(f"readme_tables: unknown table {name!r} in a document; known: {', '.join(sorted(TABLES))}")
    def load(json_file: str) -> Any:
        path = out_dir / json_file
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise SystemExit(f"readme_tables: table {name!r} needs {path}: {e}")

    if isinstance(json_name, tuple):
        return fn({n: load(n) for n in json_name})
    return fn(load(json_name))


def rewrite(text: str, out_dir: Path = OUT) -> tuple[str, list[str]]:
    """``text`` with every table block regenerated, and the names whose text changed."""
    changed: list[str] = []

    def sub(m: re.Match[str]) -> str:
        body = render(m.group("name"), out_dir)
        if body != m.group("body"):
            changed.append(m.group("name"))
        return m.group(1) + body + m.group(4)

    return _BLOCK.sub(sub, text), changed


def blocks(text: str) -> list[str]:
    return [m.group("name") for m in _BLOCK.finditer(text)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 if any block differs from its JSON")
    args = ap.parse_args(argv)
    stale = []
    for doc in DOCUMENTS:
        if not doc.exists():
            continue
        text = doc.read_text()
        new, changed = rewrite(text)
        stale += [f"{doc.relative_to(ROOT)}: table {n}" for n in changed]
        if changed and not args.check:
            doc.write_text(new)
    if stale:
        verb = "differs from its JSON" if args.check else "rewritten"
        print("\n".join(f"{s} {verb}" for s in stale))
        if args.check:
            print("run `python bench/readme_tables.py` after regenerating bench/out/*.json", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
