"""Which committed results predate a change to the code that produced them.

Owns: for every ``bench/out/*.json``, the commit it was produced on (its
``commit`` field, stamped by :func:`kvtier.provenance.provenance`; for files
from before stamps, the commit that last wrote the file, a bound: they were
produced on it or earlier) and the commits since then that changed its
inputs (the code its figures depend on, :data:`INPUTS`). A change that
cannot move a figure does not count: an input file whose code is the same at
the result's commit and at HEAD once comments, docstrings and layout are set
aside (its syntax tree, for Python; its bytes, for anything else) is not a
change, however many commits touched it. Prints them, stalest first. Must not rerun anything or change a file: rerunning is the job of the
script that made each file (see the README captions).

    python bench/stale_results.py            # the list
    python bench/stale_results.py --json     # the same, as JSON

tests/test_stale_results.py runs it in CI, where it prints the list.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from kvtier.provenance import git  # noqa: E402

_REPLAY = ("kvtier/replay", "kvtier/placement", "kvtier/policies", "kvtier/manager.py", "kvtier/agents")
_CODECS = ("kvtier/tiers/codec.py", "kvtier/tiers/rq.py", "kvtier/tiers/_rq.c", "kvtier/benchmarks")
_CONNECTOR = ("integrations/vllm_ascend/kvtier_vllm", "kvtier/manager.py", "kvtier/placement", "kvtier/tiers")
# result file name prefix -> the code its figures depend on (first match wins)
INPUTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("replay-codec", _REPLAY + _CODECS),
    ("replay-", _REPLAY),
    ("tune-", _REPLAY),
    ("fleet-", _REPLAY),
    ("predicted-waits", _REPLAY),
    ("load-or-recompute", _REPLAY),
    ("tool_wait_predictor", ("kvtier/agents", "kvtier/placement/base.py", "kvtier/replay/readers.py")),
    ("codecs", _CODECS),
    ("remote", ("kvtier/tiers/remote.py", "kvtier/tiers/codec.py", "kvtier/benchmarks")),
    ("connector-path", _CONNECTOR),
    ("vllm-connector", _CONNECTOR),
    ("engine-", _CONNECTOR),
    ("rounds", ("kvtier/shared", "kvtier/replay")),
    ("shared", ("kvtier/shared",)),
)
DEFAULT_INPUTS = ("kvtier", "integrations")


def inputs_of(name: str) -> tuple[str, ...]:
    return next((paths for prefix, paths in INPUTS if name.startswith(prefix)), DEFAULT_INPUTS)


def _without_docstrings(tree: ast.AST) -> ast.AST:
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return tree


def code_of(commit: str, path: str, root: Path = ROOT, cache: dict | None = None) -> str | None:
    """What of ``path`` at ``commit`` can move a figure: a Python file's syntax tree
    without its docstrings (comments and layout are not in it); any other file's
    text, or a Python file's that does not parse. ``None`` where the file is absent."""
    if cache is not None and (commit, path) in cache:
        return cache[(commit, path)]
    text = git("show", f"{commit}:{path}", root=root)
    code = text
    if text is not None and path.endswith(".py"):
        try:
            code = ast.dump(_without_docstrings(ast.parse(text)))
        except (SyntaxError, ValueError):
            pass
    if cache is not None:
        cache[(commit, path)] = code
    return code


def _moves_code(commit: str, paths: list[str], root: Path, cache: dict) -> bool:
    """Whether ``commit`` changed the code (:func:`code_of`) of any of ``paths`` (against its first
    parent; a merge, for which ``diff-tree`` lists nothing, is compared on every one of ``paths``)."""
    touched = (git("diff-tree", "--no-commit-id", "--name-only", "-r", commit, "--", *paths, root=root) or "").split()
    touched = touched or paths
    return any(code_of(f"{commit}^", p, root, cache) != code_of(commit, p, root, cache) for p in touched)


def staleness(out_dir: Path, root: Path = ROOT) -> list[dict[str, Any]] | None:
    """One entry per result file: ``file``, ``produced_on`` (commit), ``stamped`` (the
    commit is the file's own record, not the last commit that wrote it), ``changed_by``
    (commits since that touched an input whose code moved, newest first) and
    ``text_only`` (inputs edited since in comments, docstrings or layout alone,
    which do not count). ``None`` where git has no history here."""
    if git("rev-parse", "--verify", "HEAD", root=root) is None:
        return None
    out, cache = [], {}
    for path in sorted(out_dir.glob("*.json")):
        rel = path.resolve().relative_to(root.resolve()).as_posix()
        try:
            stamp = json.loads(path.read_text(encoding="utf-8")).get("commit")
        except (OSError, ValueError, AttributeError):
            stamp = None
        known = stamp and git("cat-file", "-e", f"{stamp}^{{commit}}", root=root) is not None
        produced = stamp if known else git("log", "-1", "--format=%H", "--", rel, root=root)
        if not produced:
            continue  # never committed: nothing to compare
        inputs = inputs_of(path.stem)
        edited = (git("diff", "--name-only", produced, "HEAD", "--", *inputs, root=root) or "").split()
        moved = [p for p in edited if code_of(produced, p, root, cache) != code_of("HEAD", p, root, cache)]
        log = (git("log", "--format=%H %s", f"{produced}..HEAD", "--", *moved, root=root) or "") if moved else ""
        changed_by = [f"{line[:7]} {line[41:]}" for line in log.splitlines()
                      if line and _moves_code(line[:40], moved, root, cache)]
        out.append({"file": rel, "produced_on": produced, "stamped": bool(known), "changed_by": changed_by,
                    "text_only": sorted(set(edited) - set(moved))})
    out.sort(key=lambda e: (-len(e["changed_by"]), e["file"]))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", type=Path, default=ROOT / "bench" / "out", help="results folder (default bench/out)")
    ap.add_argument("--json", action="store_true", help="print JSON instead of the list")
    args = ap.parse_args(argv)
    entries = staleness(args.out_dir)
    if entries is None:
        print("stale_results: no git history here (a source tarball or a shallow copy): nothing to compare")
        return 0
    if args.json:
        print(json.dumps(entries, indent=1))
        return 0
    stale = [e for e in entries if e["changed_by"]]
    print(f"{len(stale)} of {len(entries)} results in {args.out_dir} predate a change to their inputs:")
    for e in stale:
        how = "stamped" if e["stamped"] else "last written"
        print(f"  {e['file']}: {how} at {e['produced_on'][:7]}, {len(e['changed_by'])} input commits since, "
              f"newest: {e['changed_by'][0][:90]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
