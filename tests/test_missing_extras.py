"""Missing optional dependencies: each path that needs an extra says which one in one line
(``pip install 'kvtier[EXTRA]'``); the CLI exits 2, never "internal error". The modules are
made unimportable in a child interpreter (``sys.modules[name] = None``), as on a machine
without the extra."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(code: str, *blocked: str) -> subprocess.CompletedProcess:
    prelude = "import sys\n" + "".join(f"sys.modules[{m!r}] = None\n" for m in blocked)
    return subprocess.run([sys.executable, "-c", prelude + code], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)


@pytest.mark.parametrize("module,blocked", [("openai_agents", ("agents",)),
                                            ("langgraph", ("langchain_core", "langchain_core.callbacks"))])
def test_an_adapter_without_its_framework_names_the_agents_extra(module: str, blocked: tuple[str, ...]) -> None:
    proc = _run(f"""
try:
    import kvtier.adapters.{module}
except ImportError as e:
    from kvtier.errors import MissingExtraError
    assert isinstance(e, MissingExtraError), type(e)
    print(e)
""", *blocked)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1 and "pip install 'kvtier[agents]'" in lines[0] and module in lines[0], proc.stdout


def test_kvtier_route_without_the_events_extra_is_one_line_and_rc_2() -> None:
    proc = _run("from kvtier.cli import main\nsys.exit(main(['route', '--engine', 'a=tcp://127.0.0.1:5557', "
                "'--block-size', '16', '--listen', '127.0.0.1:0']))", "zmq", "msgpack")
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and "pip install 'kvtier[events]'" in err[0] and err[0].startswith("kvtier route: error:"), \
        proc.stderr
    assert "internal error" not in proc.stderr and "Traceback" not in proc.stderr


def test_the_refusal_without_a_store_names_a_command_that_exists() -> None:
    """The hint server's refusal of pin / prefetch commands tells the user to start ``kvtier serve --store``:
    that command line must parse."""
    import re

    from kvtier.cli import build_parser
    from kvtier.hints.apply import NO_STORE

    cmd = re.search(r"`kvtier ([^`]+)`", NO_STORE)
    assert cmd, NO_STORE
    args = build_parser().parse_args(cmd.group(1).split())
    assert args.command == "serve" and args.store is True
