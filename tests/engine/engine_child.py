"""Run one real vLLM engine scenario in its own process and write the results as JSON.

Usage: ``python engine_child.py SPEC.json OUT.json``, or ``--serve SPEC.json``
to keep the engine up and run one phase per JSON line read from stdin (the
phase's ``out`` names its result file; ``KVTIER-DONE`` is printed after each). The spec names the model
directory, engine options, an optional kvtier ``kv_connector_extra_config``,
vLLM KV events (``kv_events``: ``KVEventsConfig`` fields), optionally vLLM's
``MultiConnector`` (``multi_connector``: its children in order, see
:func:`_multi_connector`), and phases (prompts as
token ids, optionally one ``kv_transfer_params`` dict and one vLLM ``cache_salt``
(``cache_salts``) per prompt, and one vLLM ``kv_hints`` envelope (``kv_hints``, as builtins) per
prompt; ``reset_prefix_cache`` before a phase, and ``sleep``: vLLM's sleep at that level, then its
wake-up, before a phase). The
output has the engine's ``num_gpu_blocks`` and whether its hybrid KV cache
manager is on, and, per phase, each prompt's generated token ids and per-token
logprobs (``outputs``), vLLM's own TTFT and cached-token count per request
(``requests``), the kvtier stats file after the phase, and vLLM's external prefix
cache hit counters (``external_hits`` from kvtier, ``local_hits`` from its own
prefix cache; cumulative), and with ``"rss": true`` in a phase the resident
memory of the process tree at its start, its peak (sampled every 20 ms until
the connector is idle) and its end. A phase with ``"after": [k, wait_s]``
starts ``wait_s`` seconds after phase ``k``'s answers came back (an agent back
from a tool of that length), not at once.
"""

from __future__ import annotations

import json
import os
import sys
import time


def _wait_idle(stats_path: str | None, timeout_s: float = 30.0) -> dict:
    """Stats once the connector has no plan out (stores reported by the workers)."""
    if not stats_path:
        return {}
    deadline = time.monotonic() + timeout_s
    stats: dict = {}
    while time.monotonic() < deadline:
        try:
            with open(stats_path) as f:
                stats = json.load(f)
        except (OSError, ValueError):
            stats = {}
        if stats and stats.get("pending_plans") == 0:
            return stats
        time.sleep(0.05)
    return stats


def _generate_with_hints(llm, prompts: list, sps: list, envelopes: list) -> list:
    """``llm.generate`` for requests that carry vLLM ``kv_hints`` (which ``LLM.generate`` does
    not take): each added through ``LLMEngine.add_request(kv_hints=...)``, the engine stepped
    until all finish; outputs in the prompts' order."""
    import msgspec
    from vllm.v1.kv_hints import KvHintsEnvelope

    engine = llm.llm_engine
    order = {}
    for i, (prompt, sp, env) in enumerate(zip(prompts, sps, envelopes)):
        hints = msgspec.convert(env, KvHintsEnvelope) if env is not None else None
        engine.add_request(f"hinted-{i}", prompt, sp, kv_hints=hints)  # (returns vLLM's internal id)
        order[f"hinted-{i}"] = i  # the outputs carry this one
    outs: list = [None] * len(prompts)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[order[out.request_id]] = out
    return outs


def _tree_cpu_s() -> float:
    """CPU seconds used so far by this process and its children (the engine core and
    workers): unlike wall time, not inflated by other work on a shared machine."""
    import psutil

    me = psutil.Process()
    total = 0.0
    for proc in [me, *me.children(recursive=True)]:
        try:
            t = proc.cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system
    return total


class _RSSSampler:
    """Peak resident memory of this process and its children (the engine core, the
    workers) while a phase runs, sampled every 20 ms by a thread."""

    def __init__(self) -> None:
        import threading

        self.start_mib = self.peak_mib = _tree_rss_mib()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.peak_mib = max(self.peak_mib, _tree_rss_mib())

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        end = _tree_rss_mib()
        return {"start_mib": self.start_mib, "peak_mib": max(self.peak_mib, end), "end_mib": end}


def _tree_rss_mib() -> float:
    import psutil

    me = psutil.Process()
    total = 0
    for proc in [me, *me.children(recursive=True)]:
        try:
            total += proc.memory_info().rss
        except psutil.Error:
            continue
    return total / (1 << 20)


def _metric(llm, name: str) -> float:
    return sum(getattr(m, "value", 0) or 0 for m in llm.get_metrics() if m.name == name)


def _vec_attention() -> None:
    """No AMX on a CPU with AMX tiles: vLLM's CPU backend then chooses its ``vec`` attention
    kernels (it picks AMX ones for bf16), and oneDNN its AVX-512 bf16 matmuls (its AMX ones
    round differently for different numbers of tokens in a step, so an engine that loads a
    prefix and one that computes it can disagree on a token though the KV moved bit for
    bit). A scenario whose assertion depends on either (the vec kernels' key layout, outputs
    identical to a plain engine's) asks for it with ``"cpu_attention": "vec"``. Both go
    together: capping oneDNN alone leaves AMX attention running without the AMX permission
    oneDNN would have asked the kernel for (SIGILL). vLLM's CPU platform spawns the engine's
    processes; ``vec_attention/sitecustomize.py``, put on their ``PYTHONPATH`` here, patches
    the attention choice in each, and the environment carries the oneDNN cap."""
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vec_attention")
    os.environ["KVTIERTEST_CPU_ATTENTION"] = "vec"
    os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    import torch

    torch.cpu._is_amx_tile_supported = lambda: False


def _multi_connector(spec: dict) -> dict:
    """``KVTransferConfig`` fields of a ``MultiConnector`` over ``spec["multi_connector"]``:
    child ``KVTransferConfig`` dicts, in load order; the string ``"kvtier"`` stands for
    kvtier with the spec's ``kvtier`` extra config. ``multi_connector_options`` are
    fields of the outer config (e.g. ``kv_load_failure_policy``)."""
    kvtier = {"kv_connector": "kvtier", "kv_role": "kv_both", "kv_connector_extra_config": spec.get("kvtier") or {}}
    children = [kvtier if child == "kvtier" else child for child in spec["multi_connector"]]
    return {"kv_connector": "MultiConnector", "kv_role": "kv_both",
            **spec.get("multi_connector_options", {}), "kv_connector_extra_config": {"connectors": children}}


def main(spec_path: str, out_path: str | None) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    if spec.get("cpu_attention") == "vec":
        _vec_attention()
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kwargs = dict(spec.get("engine", {}))
    if spec.get("multi_connector") is not None:  # vLLM's MultiConnector over these children, in this order
        kwargs["kv_transfer_config"] = KVTransferConfig(**_multi_connector(spec))
    elif spec.get("kvtier") is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector=spec.get("connector_name", "kvtier"),
            kv_connector_module_path=spec.get("connector_module_path"),
            kv_role="kv_both",
            kv_connector_extra_config=spec["kvtier"],
        )
    if spec.get("kv_events") is not None:  # vLLM's KV event publisher (e.g. ZMQ on loopback)
        from vllm.config import KVEventsConfig

        kwargs["kv_events_config"] = KVEventsConfig(**spec["kv_events"])
    stats_path = (spec.get("kvtier") or {}).get("stats_path")
    t0 = time.perf_counter()
    llm = LLM(model=spec["model"], load_format=spec.get("load_format", "safetensors"), skip_tokenizer_init=True, seed=0,
              disable_log_stats=False, **kwargs)
    config = llm.llm_engine.vllm_config
    result: dict = {"start_s": time.perf_counter() - t0, "phases": [],
                    # the engine's KV capacity, and whether vLLM kept its hybrid KV cache manager on
                    "num_gpu_blocks": config.cache_config.num_gpu_blocks,
                    "hybrid_kv_cache_manager": not config.scheduler_config.disable_hybrid_kv_cache_manager}
    def sampling(kv_transfer_params: dict | None = None) -> SamplingParams:
        return SamplingParams(temperature=0, max_tokens=spec.get("max_tokens", 8), logprobs=spec.get("logprobs", 3),
                              detokenize=False, ignore_eos=True,
                              extra_args={"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None)

    sp = sampling()

    answered: list[float] = []  # when each phase's answers came back (perf_counter)

    def run_phase(llm: LLM, phase: dict) -> dict:
        if phase.get("after") is not None:  # back from a tool: wait_s after phase k's answers
            k, wait_s = phase["after"]
            time.sleep(max(0.0, answered[k] + wait_s - time.perf_counter()))
        if phase.get("reset_prefix_cache"):
            _wait_idle(stats_path)
            result.setdefault("resets", []).append(bool(llm.reset_prefix_cache()))
        if phase.get("sleep") is not None:  # vLLM's sleep mode at that level, then wake_up (the CPU worker's
            try:  # own sleep is a no-op; the engine still resets its caches and the connector's on the way)
                llm.sleep(level=phase["sleep"])
                llm.wake_up()
                result.setdefault("sleeps", []).append("ok")
            except Exception as exc:  # noqa: BLE001 - reported to the test
                result.setdefault("sleeps", []).append(f"{type(exc).__name__}: {exc}")
        t1, cpu1 = time.perf_counter(), _tree_cpu_s()
        rss = _RSSSampler() if phase.get("rss") else None
        params = phase.get("kv_transfer_params")  # one dict (or None) per prompt: the SDK's hints
        sps = [sampling(p) for p in params] if params else sp
        if phase.get("max_tokens"):  # one per prompt
            base = sps if isinstance(sps, list) else [sp] * len(phase["prompts"])
            sps = [s.clone() for s in base]
            for s, n in zip(sps, phase["max_tokens"]):
                s.max_tokens = n
        salts = phase.get("cache_salts") or [None] * len(phase["prompts"])  # vLLM's own, one per prompt
        prompts = [TokensPrompt(prompt_token_ids=p) if salt is None
                   else TokensPrompt(prompt_token_ids=p, cache_salt=salt) for p, salt in zip(phase["prompts"], salts)]
        envelopes = phase.get("kv_hints")  # one vLLM KvHintsEnvelope (as builtins) or None per prompt
        outs = llm.generate(prompts, sps, use_tqdm=False) if not envelopes else \
            _generate_with_hints(llm, prompts, sps if isinstance(sps, list) else [sps] * len(prompts), envelopes)
        answered.append(time.perf_counter())
        gen_s, cpu_s = answered[-1] - t1, _tree_cpu_s() - cpu1
        rows, timings = [], []
        for o in outs:
            c = o.outputs[0]
            metrics = getattr(o, "metrics", None)
            timings.append({
                "ttft_s": getattr(metrics, "first_token_latency", None),  # vLLM's own, per request
                "cached_tokens": getattr(o, "num_cached_tokens", None),  # HBM + connector hits
            })
            rows.append({
                "token_ids": list(c.token_ids),
                "logprobs": [{str(t): lp.logprob for t, lp in step.items()} for step in (c.logprobs or [])],
            })
        stats = _wait_idle(stats_path, phase.get("idle_timeout_s", 30.0))
        return {"outputs": rows, "requests": timings, "gen_s": gen_s, "cpu_s": cpu_s, "stats": stats,
                "external_hits": _metric(llm, "vllm:external_prefix_cache_hits"),
                "local_hits": _metric(llm, "vllm:prefix_cache_hits"),
                "rss": rss.stop() if rss is not None else None}

    if out_path is None:  # serve phases from stdin until it closes
        print("KVTIER-READY", flush=True)
        for line in sys.stdin:
            phase = json.loads(line)
            with open(phase["out"], "w") as f:
                json.dump(run_phase(llm, phase), f)
            print("KVTIER-DONE", flush=True)
    else:
        result["phases"] = [run_phase(llm, phase) for phase in spec["phases"]]
        with open(out_path, "w") as f:
            json.dump(result, f)
    del llm  # shuts the engine's processes down (they hold our stdout)
    os._exit(0)  # skip vLLM's slow teardown; results are written


if __name__ == "__main__":
    if sys.argv[1] == "--serve":
        main(sys.argv[2], None)
    else:
        main(sys.argv[1], sys.argv[2])
