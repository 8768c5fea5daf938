"""Issue 43's size bounds, held by scripts/class_sizes.py: no new class over 550
lines or function over 30 branches, and the known offenders only shrink."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "class_sizes.py"


def _script():
    spec = importlib.util.spec_from_file_location("class_sizes", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_no_class_or_function_over_the_limits_and_known_ones_do_not_grow(capsys) -> None:
    cs = _script()
    rc = cs.main(["--top", "12"])
    out = capsys.readouterr().out
    print(out)  # the table is the CI log's record of the largest
    assert rc == 0, out


def test_the_known_lists_hold_only_classes_and_functions_still_over_the_limits() -> None:
    """A split offender leaves the list (else the list would let it grow back)."""
    cs = _script()
    classes, functions = cs.measure()
    for name, recorded in cs.KNOWN_CLASSES.items():
        assert name in classes, f"{name} is gone: remove it from KNOWN_CLASSES"
        assert classes[name] > cs.CLASS_LIMIT, f"{name} is {classes[name]} lines now: remove it from KNOWN_CLASSES"
        assert classes[name] == recorded, f"{name} shrank to {classes[name]} lines: record that in KNOWN_CLASSES"
    for name, recorded in cs.KNOWN_FUNCTIONS.items():
        assert name in functions, f"{name} is gone: remove it from KNOWN_FUNCTIONS"
        assert functions[name] > cs.BRANCH_LIMIT, f"{name} is within the limit now: remove it from KNOWN_FUNCTIONS"
        assert functions[name] == recorded, f"{name} has {functions[name]} branches now: record that"


def test_a_new_large_class_or_branchy_function_is_caught(tmp_path: Path) -> None:
    cs = _script()
    (tmp_path / "kvtier").mkdir()
    (tmp_path / "integrations").mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(cs.CLASS_LIMIT + 5))
    ifs = "\n".join(f"    if a == {i}:\n        return {i}" for i in range(cs.BRANCH_LIMIT + 1))
    (tmp_path / "kvtier" / "big.py").write_text(f"class Big:\n{body}\n\ndef f(a):\n{ifs}\n")
    classes, functions = cs.measure(tmp_path)
    bad = cs.problems(classes, functions)
    assert any("kvtier/big.py:Big" in b for b in bad) and any("kvtier/big.py:f" in b for b in bad), bad
    assert cs.problems({"kvtier/manager.py:TierManager": 5000}, {}) == []  # exempt
