"""The agent-to-engine quickstart's files: ``deploy/compose.yaml`` (and what it mounts),
``deploy/Dockerfile``, and the pass/fail rule of ``examples/agent_to_engine.py`` (the
script itself runs against a real ``vllm serve`` in tests/engine/test_vllm_quickstart.py).

The compose file cannot start here (no GPU, no image registry), so what can be checked
without one is: it parses as compose (``docker compose config``, or ``docker-compose``,
where either is installed), every image is pinned to a version, the Dockerfile's vLLM
image is the release the connector is built for, the connector's settings are ones it
accepts, and the ports and files the services name agree with each other."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kvtier_vllm.settings import EXTRA_KEYS

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"


def _compose() -> dict:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())


def _flag(command: list[str], name: str) -> str:
    values = [c.split("=", 1)[1] for c in command if c.startswith(f"--{name}=")]
    assert len(values) == 1, f"deploy/compose.yaml: vllm's command gives --{name} {len(values)} times"
    return values[0]


def test_images_are_pinned_and_vllm_is_the_connectors_release() -> None:
    services = _compose()["services"]
    for name, svc in services.items():
        image = svc.get("image", "")
        assert re.fullmatch(r"[\w./-]+:v?\d+\.\d+\.\d+", image), f"service {name}: image {image!r} is not pinned"
    base = re.search(r"^ARG VLLM_IMAGE=vllm/vllm-openai:v(\d+)\.(\d+)\.\d+$", (DEPLOY / "Dockerfile").read_text(), re.M)
    assert base, "deploy/Dockerfile: no pinned vllm/vllm-openai base image"
    extra = re.search(r'^vllm = \["vllm>=(\d+)\.(\d+),<(\d+)\.(\d+)"\]', (ROOT / "pyproject.toml").read_text(), re.M)
    assert extra and base.groups() == extra.groups()[:2], "the image's vLLM is not the one pyproject's vllm extra names"


def test_connector_settings_and_ports_agree() -> None:
    services = _compose()["services"]
    command = services["vllm"]["command"]
    kv = json.loads(_flag(command, "kv-transfer-config"))
    assert kv["kv_connector"] == "kvtier"
    extra = kv["kv_connector_extra_config"]
    assert set(extra) <= set(EXTRA_KEYS), sorted(set(extra) - set(EXTRA_KEYS))
    assert extra["hint_server"].startswith("127.0.0.1:"), "a hint server beyond loopback needs a token file"
    assert _flag(command, "middleware") == "kvtier_vllm.middleware.RequestStreamHints"
    port = _flag(command, "port")
    prom = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    assert prom["scrape_configs"][0]["static_configs"][0]["targets"] == [f"127.0.0.1:{port}"]
    listen = _flag(services["prometheus"]["command"], "web.listen-address")
    source = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text())
    assert source["datasources"][0]["url"] == f"http://{listen}"


def test_mounted_files_exist_and_the_dashboard_is_the_generated_one() -> None:
    for name, svc in _compose()["services"].items():
        for vol in svc.get("volumes", []):
            src = vol.split(":", 1)[0]
            if src.startswith("."):
                assert (DEPLOY / src).exists(), f"service {name} mounts {src}, which does not exist"
    from kvtier_vllm.dashboard import dashboard

    assert json.loads((ROOT / "docs/grafana/kvtier-vllm.json").read_text()) == dashboard()


def test_compose_config_validates() -> None:
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        cmd = ["docker", "compose"]
    elif shutil.which("docker-compose"):
        cmd = ["docker-compose"]
    else:
        pytest.skip("neither `docker compose` nor `docker-compose` is installed (apt-get install docker-compose)")
    proc = subprocess.run(cmd + ["-f", str(DEPLOY / "compose.yaml"), "config", "-q"], capture_output=True, text=True,
                          env={"HOME": str(ROOT), "PATH": "/usr/bin:/bin:/usr/local/bin"})
    assert proc.returncode == 0, proc.stderr


def _example():
    spec = importlib.util.spec_from_file_location("agent_to_engine", ROOT / "examples" / "agent_to_engine.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("hit, rc", [(0.0, 1), (96.0, 0)])
def test_example_fails_when_kvtier_served_nothing(hit: float, rc: int, capsys: pytest.CaptureFixture) -> None:
    log = [{"agent": 0, "turn": t, "s": 0.1, "prompt_tokens": 300 + 100 * t} for t in range(3)]
    after = {"kvtier_connector_hit_tokens_total": hit, "vllm:prompt_tokens_total": 900.0}
    assert _example().report({}, after, log) == rc
    assert ("FAIL: kvtier served no prompt tokens" in capsys.readouterr().err) == (rc == 1)


def test_example_help() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "agent_to_engine.py"), "--help"],
                          capture_output=True, text=True)
    assert proc.returncode == 0 and "--url" in proc.stdout and "--sdk" in proc.stdout, proc.stderr


def test_the_sdk_example_runs_standalone() -> None:
    """docs/agents.md's SDK example, as a reader runs it: it starts a local hint server and records the
    sessions it sends as AgentX traces (its pin commands are refused by name: that server has no store)."""
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "agent_loop.py")], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "recorded 2 AgentX trace(s)" in proc.stdout and "0 dropped" in proc.stdout, proc.stdout
    assert "{'no_store': 2}" in proc.stdout and "pin commands were refused" in proc.stdout, proc.stdout
