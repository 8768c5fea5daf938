"""The largest classes and functions of kvtier/ and integrations/, against issue 43's bounds.

Prints the classes over ``--top`` (largest first, lines from ``class`` to its
last statement) and the functions with the most branches, and exits 1 when a
class is over the limit (550 lines) or a function over the branch limit,
unless it is one of the known offenders below and has not grown past the size
recorded for it. The list only shrinks: splitting a class removes its line;
a new class over the limit, or a known one that grew, fails.

    python scripts/class_sizes.py            # the table, and the verdict
    python scripts/class_sizes.py --top 20

tests/test_class_sizes.py runs it in CI.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TREES = ("kvtier", "integrations")
CLASS_LIMIT = 550
BRANCH_LIMIT = 30  # if/for/while/try/with/match arms, boolean operators and comprehension ifs of one function
EXEMPT = {"kvtier/manager.py:TierManager": "one job (the tiers' bookkeeping), invariants checked after each change"}
# Known offenders (issue 43), at their size when this check was written: they may shrink, not grow.
KNOWN_CLASSES = {
}
KNOWN_FUNCTIONS = {
}


def _branches(fn: ast.AST) -> int:
    n = 0
    for node in ast.walk(fn):
        if isinstance(node, (ast.If, ast.For, ast.AsyncFor, ast.While, ast.IfExp, ast.ExceptHandler,
                             ast.With, ast.AsyncWith, ast.match_case)):
            n += 1
        elif isinstance(node, ast.BoolOp):
            n += len(node.values) - 1
        elif isinstance(node, ast.comprehension):
            n += 1 + len(node.ifs)
    return n


def measure(root: Path = ROOT) -> tuple[dict[str, int], dict[str, int]]:
    """(class -> lines, function -> branches) over the package trees, named ``path:Qualified``."""
    classes: dict[str, int] = {}
    functions: dict[str, int] = {}
    for tree in TREES:
        for path in sorted((root / tree).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if "/." in rel or rel.startswith("."):
                continue
            mod = ast.parse(path.read_text(encoding="utf-8"), filename=rel)

            def walk(node: ast.AST, prefix: str) -> None:
                for child in ast.iter_child_nodes(node):
                    if isinstance(child, ast.ClassDef):
                        name = f"{prefix}{child.name}"
                        classes[f"{rel}:{name}"] = child.end_lineno - child.lineno + 1
                        walk(child, name + ".")
                    elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        name = f"{prefix}{child.name}"
                        functions[f"{rel}:{name}"] = _branches(child)
                        walk(child, name + ".")

            walk(mod, "")
    return classes, functions


def problems(classes: dict[str, int], functions: dict[str, int]) -> list[str]:
    """Every class or function over its limit that is neither exempt nor a known offender within its size."""
    out = []
    for name, lines in classes.items():
        if lines > CLASS_LIMIT and name not in EXEMPT:
            known = KNOWN_CLASSES.get(name)
            if known is None:
                out.append(f"{name}: {lines} lines, over {CLASS_LIMIT}: split it along its jobs")
            elif lines > known:
                out.append(f"{name}: {lines} lines, grew past the {known} recorded for it: split it, do not grow it")
    for name, n in functions.items():
        if n > BRANCH_LIMIT:
            known = KNOWN_FUNCTIONS.get(name)
            if known is None:
                out.append(f"{name}: {n} branches, over {BRANCH_LIMIT}")
            elif n > known:
                out.append(f"{name}: {n} branches, grew past the {known} recorded for it")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--top", type=int, default=10, help="how many classes and functions to list (default 10)")
    args = ap.parse_args(argv)
    classes, functions = measure()
    print(f"largest classes (limit {CLASS_LIMIT} lines):")
    for name, lines in sorted(classes.items(), key=lambda x: -x[1])[: args.top]:
        tag = " (exempt)" if name in EXEMPT else " (known, may not grow)" if name in KNOWN_CLASSES else ""
        print(f"  {lines:5d}  {name}{tag}")
    print(f"most branching functions (limit {BRANCH_LIMIT}):")
    for name, n in sorted(functions.items(), key=lambda x: -x[1])[: args.top]:
        tag = " (known, may not grow)" if name in KNOWN_FUNCTIONS else ""
        print(f"  {n:5d}  {name}{tag}")
    bad = problems(classes, functions)
    for line in bad:
        print("FAIL", line)
    print("ok" if not bad else f"{len(bad)} over the limits")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
