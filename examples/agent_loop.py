"""An agent loop that tells kvtier what it is doing, through the kvtier SDK.

A planner agent talks to a (simulated) LLM, runs tools between turns and
fans out to two coder sub-agents that share the planner's context. Every
step emits hints: requests with their prompt block keys, tool calls with an
expected duration, sub-agent spawns with a dependency edge back to the
planner, a shared round, and a pin of the shared prefix. The request bodies
are tagged with ``kv_transfer_params`` so an engine connector can match
engine requests to agents.

Run it against a server::

    kvtier serve --record /tmp/kvtier-rec &        # in one shell
    python examples/agent_loop.py --target 127.0.0.1:50051

or alone (it starts a local server on a free port and records into a temp
directory, then prints where the AgentX trace went)::

    python examples/agent_loop.py
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import threading
import time
from typing import Any

from kvtier.keys import Namespace, chain_keys
from kvtier.sdk import HintClient

NS = Namespace(model="demo-model", dtype="bfloat16", layout="fused", block_size=16)


def fake_llm(body: dict[str, Any], prompt_tokens: list[int]) -> tuple[list[int], str]:
    """Stands in for an OpenAI-compatible call: returns output tokens and a stop reason."""
    time.sleep(0.01)
    out = [random.randrange(32_000) for _ in range(random.randint(20, 60))]
    return out, random.choice(["tool_use", "tool_use", "end_turn"])


def run_agent(client: HintClient, agent: Any, context: list[int], turns: int) -> list[int]:
    """One agent's loop: LLM request → tool call → LLM request ..."""
    for turn in range(turns):
        keys = chain_keys(NS, context)  # what the engine will look up
        body = agent.tag({"model": NS.model, "messages": [{"role": "user", "content": "..."}]})
        with agent.request(prompt_block_keys=keys, num_prompt_tokens=len(context), model=NS.model) as req:
            out, stop = fake_llm(body, context)
            req.num_output_tokens, req.stop = len(out), stop
        context = context + out
        if stop == "tool_use":
            with agent.tool_call("bash", expected_s=0.02):
                time.sleep(random.uniform(0.01, 0.03))  # the tool runs
            context = context + [random.randrange(32_000) for _ in range(40)]  # tool result
    return context


def agent_session(client: HintClient, session_id: str) -> None:
    system_prompt = list(range(256))  # shared by every agent
    with client.session(session_id, model=NS.model):
        with client.agent("planner", expected_num_requests=4) as planner:
            context = run_agent(client, planner, system_prompt, turns=2)
            shared = chain_keys(NS, context)
            planner.pin(shared, ttl_s=30.0)  # a command: keep the shared prefix resident
            coders = [planner.agent("coder", expected_num_requests=3) for _ in range(2)]
            for coder in coders:
                coder.start()
                planner.depends_on(coder)  # the planner waits for its coders
            client.emit("shared_round_start", session_id=session_id, round_id="fanout",
                        agent_ids=[c.agent_id for c in coders], shared_block_keys=shared)
            threads = [threading.Thread(target=run_agent, args=(client, c, context, 3)) for c in coders]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            for coder in coders:
                coder.end()
            client.emit("shared_round_end", session_id=session_id, round_id="fanout")
            run_agent(client, planner, context, turns=1)  # the join turn


def start_local_server(record_dir: str) -> tuple[str, Any]:
    """A HintServer on a free loopback port, in a background thread."""
    from kvtier.recording.hints import HintRecorder
    from kvtier.hints.server import HintServer

    ready, box = threading.Event(), {}

    def serve() -> None:
        async def main() -> None:
            box["recorder"] = HintRecorder(record_dir, block_size=NS.block_size, model=NS.model)
            server = box["server"] = HintServer(recorder=box["recorder"])
            box["address"] = await server.start("127.0.0.1:0")
            box["loop"], box["stop"] = asyncio.get_running_loop(), asyncio.Event()
            ready.set()
            await box["stop"].wait()
            await server.stop()
            box["recorder"].close()

        asyncio.run(main())

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    ready.wait(30)

    def stop() -> None:
        box["loop"].call_soon_threadsafe(box["stop"].set)
        thread.join(10)

    return box["address"], (box, stop)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", help="host:port or unix:PATH of a running `kvtier serve` (default: start one)")
    p.add_argument("--token", help="bearer token, when the server requires one")
    p.add_argument("--sessions", type=int, default=2)
    args = p.parse_args()
    local = None
    record_dir = tempfile.mkdtemp(prefix="kvtier-example-")
    target = args.target
    if target is None:
        target, local = start_local_server(record_dir)
        print(f"started a local hints server on {target}, recording into {record_dir}")
    with HintClient(target, token=args.token) as client:
        for i in range(args.sessions):
            agent_session(client, f"demo-{i}")
        client.flush()
        stats = client.stats()
    print(f"sent {stats.emitted} hint events: {stats.accepted} accepted, {stats.rejected} rejected "
          f"{dict(stats.rejected_by_reason or {})}, {stats.num_dropped} dropped "
          f"{dict((k, v) for k, v in stats.dropped.items() if v)}")
    if (stats.rejected_by_reason or {}).get("no_store"):
        print("(the pin commands were refused: a server without a store cannot pin blocks; `kvtier serve --store` "
              "or the vLLM connector's hint_server can)")
    if local is not None:
        box, stop = local
        stop()
        print(f"recorded {box['recorder'].num_traces_written} AgentX trace(s): {record_dir}/traces "
              f"(+ {record_dir}/hints.jsonl)")


if __name__ == "__main__":
    main()
