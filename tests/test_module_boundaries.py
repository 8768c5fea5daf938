"""Module boundaries, checked over the source: no module uses another module's private
names, and no two modules import each other.

A private name (one leading underscore, not a dunder) belongs to the module that defines
it: a function, class or constant at its top level, a method or class attribute of one of
its classes, or an attribute its code assigns (``self._x = ...``). Another module that
imports such a name, or reads ``obj._x`` where only some other module defines ``_x``, is
reaching past that module's interface; it should get what it needs through a public name.
Names no kvtier module defines (a third party's, such as ``torch._foreach_copy_``) are not
kvtier's to police here. What it cannot tell: a module that assigns ``_x`` anywhere counts as
defining it, so its reads and writes of another object's ``_x`` pass (the fleet's engines,
subclasses of the simulator, set its ``_due_s``); ``import pkg._mod`` is not looked at; and
only cycles of two modules are. The package's own C extensions are private modules with one
owner each (:data:`EXTENSION_OWNERS`).

Imports in both directions between two modules (at the top, inside a function, or for
type checking alone) mean neither can be read or changed without the other; a package
and its own submodules are exempt (``__init__`` re-exports what its submodules define).
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"kvtier": ROOT / "kvtier", "kvtier_vllm": ROOT / "integrations" / "vllm_ascend" / "kvtier_vllm",
            "kvtier_sglang": ROOT / "integrations" / "sglang" / "kvtier_sglang"}
EXTENSION_OWNERS = {"kvtier.tiers._rq": "kvtier.tiers.rq", "kvtier.tiers._rawread": "kvtier.tiers.codec"}
"""A C extension module -> the one module that wraps it."""


def _modules() -> dict[str, Path]:
    out = {}
    for name, base in PACKAGES.items():
        for path in sorted(base.rglob("*.py")):
            if "_gen" in path.parts:  # generated protobuf code
                continue
            parts = [p for p in path.relative_to(base).with_suffix("").parts if p != "__init__"]
            out[".".join([name, *parts])] = path
    for private in EXTENSION_OWNERS:
        out.setdefault(private, Path())
    return out


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _target(mod: str, path: Path, node: ast.ImportFrom) -> str | None:
    if not node.level:
        return node.module
    base = mod.split(".")
    if path.name != "__init__.py":
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _defined(tree: ast.Module) -> set[str]:
    """Private names ``tree`` defines (see the module doc)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return {n for n in names if _private(n)}


def _scan() -> tuple[list[str], dict[str, set[str]]]:
    mods = _modules()
    trees = {m: ast.parse(p.read_text(encoding="utf-8")) for m, p in mods.items() if p != Path()}
    defined = {m: _defined(t) for m, t in trees.items()}
    anywhere: set[str] = set().union(*defined.values())
    problems: list[str] = []
    imports: dict[str, set[str]] = defaultdict(set)
    for mod, tree in trees.items():
        path = mods[mod]
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                target = _target(mod, path, node)
                for alias in node.names:
                    full = f"{target}.{alias.name}"
                    if full in mods:
                        imports[mod].add(full)
                        if _private(alias.name) and EXTENSION_OWNERS.get(full) != mod:
                            problems.append(f"{mod} imports the private module {full}")
                    elif target in mods:
                        imports[mod].add(target)
                        if _private(alias.name):
                            problems.append(f"{mod} imports {alias.name} from {target}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in mods:
                        imports[mod].add(alias.name)
            elif isinstance(node, ast.Attribute) and _private(node.attr) and node.attr in anywhere:
                owner = node.value
                if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                    continue
                if node.attr not in defined[mod]:
                    problems.append(f"{mod} reads {ast.unparse(owner)}.{node.attr}, private to "
                                    + ", ".join(sorted(m for m, d in defined.items() if node.attr in d)))
        imports[mod].discard(mod)
    return problems, imports


def test_the_scan_reads_every_package() -> None:
    """A wrong path would make both checks pass on nothing."""
    mods = _modules()
    for name in PACKAGES:
        assert sum(m.split(".")[0] == name for m in mods) >= 3, f"no modules of {name} found at {PACKAGES[name]}"


def test_no_module_uses_another_modules_private_names() -> None:
    problems, _ = _scan()
    assert not problems, "\n".join(sorted(set(problems)))


def test_no_two_modules_import_each_other() -> None:
    _, imports = _scan()
    pairs = sorted({tuple(sorted((a, b))) for a, targets in imports.items() for b in targets
                    if a in imports.get(b, ()) and not (a.startswith(b + ".") or b.startswith(a + "."))})
    assert not pairs, "\n".join(f"{a} <-> {b}" for a, b in pairs)


def test_the_check_sees_a_private_read_and_a_cycle(tmp_path: Path, monkeypatch) -> None:
    """The scan itself: a module reading another's private attribute, and two modules that
    import each other, are both reported (a check that could not fail would pass anything)."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n\n\nclass A:\n    def __init__(self):\n        self._secret = 1\n")
    (pkg / "b.py").write_text("def peek(x):\n    from . import a\n    return x._secret\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGES", {"pkg": pkg})
    monkeypatch.setattr(sys.modules[__name__], "EXTENSION_OWNERS", {})
    problems, imports = _scan()
    assert problems == ["pkg.b reads x._secret, private to pkg.a"]
    assert imports["pkg.a"] == {"pkg.b"} and imports["pkg.b"] == {"pkg.a"}
