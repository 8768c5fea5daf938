"""``kvtier bench hints``: hint-plane throughput and SDK ``emit()`` latency.

Owns: the measurement only. Three figures, each with its baseline measured
in the same run:

* **Aggregate events/s** from 1, 4 and 16 client *processes* over loopback,
  against (a) the kvtier hints server (validation, dedupe, AgentGraph) and
  (b) a raw gRPC echo servicer that parses the same ``PublishRequest`` and
  answers with its size — the floor cost of gRPC + protobuf in Python. Both
  servers run in their own process; the clients send the same pre-serialised
  batches (a realistic event mix: sessions, agents, requests with 32 block
  keys, tool calls, dependencies, pins) with two RPCs in flight each, so the
  servers, not the clients, are measured.
* **``emit()`` latency** on the caller thread of a live :class:`HintClient`
  sending to the kvtier server: ``paced`` (an emit every 100 us, sleeping in
  between — a busy agent is far slower) and ``burst`` (back to back, where
  the caller competes for the GIL with the client's own sender thread). The
  baseline is the floor of any Python call on this machine: a function that
  only appends its arguments to a deque, timed and paced the same way (after
  a sleep, caches are cold on a shared machine and even that call is slow).

Must not import torch (it runs many short processes) and must not leave
processes behind: every child is joined or terminated.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import secrets
import statistics
import sys
import time
from collections import deque
from typing import Any, Callable

TARGETS = {"min_events_per_s": 100_000, "max_emit_p99_us": 20.0, "min_ratio_vs_echo": 0.7}
_PUBLISH = "/kvtier.v1.HintService/Publish"


# ------------------------------------------------------------------ servers


def _serve(kind: str, conn: Any) -> None:
    """Child process: run the kvtier server or the echo server until terminated."""

    async def main() -> None:
        import grpc

        if kind == "kvtier":
            from ..agents.graph import GraphLimits
            from ..hints.server import HintServer, tune_gc_for_serving

            # with a store, as `kvtier serve --store` runs: the clients' pin commands are applied (a server
            # without one refuses block-key commands); a small DRAM-only store whose pins name absent blocks
            server = HintServer(graph_limits=GraphLimits(max_sessions_per_client=10_000), store=_bench_store())
            tune_gc_for_serving()  # as `kvtier serve` does
            address = await server.start("127.0.0.1:0")
        else:
            from ..hints._gen import hints_pb2 as pb

            async def echo(data: bytes, context: Any) -> bytes:
                req = pb.PublishRequest.FromString(data)
                n = len(req.signals) + len(req.commands)
                return pb.PublishResponse(num_accepted=n).SerializeToString()

            raw = grpc.aio.server(options=[("grpc.max_receive_message_length", 16 << 20)])
            raw.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
                "kvtier.v1.HintService", {"Publish": grpc.unary_unary_rpc_method_handler(echo)})])
            port = raw.add_insecure_port("127.0.0.1:0")
            await raw.start()
            address = f"127.0.0.1:{port}"
        conn.send(address)
        await asyncio.Event().wait()

    asyncio.run(main())


def _bench_store() -> Any:
    from ..config import load_config
    from ..store import TieredStore

    cfg = load_config(env={}, overrides={
        "layout": {"num_layers": 1, "num_kv_heads": 1, "head_dim": 8, "block_size": 4},
        "tiers": {"hbm": {"enabled": False}, "dram": {"capacity_blocks": 64}}, "put_tier": "dram",
        "pin_budget_blocks": 1 << 20})
    return TieredStore(cfg)


class _ServerProcess:
    def __init__(self, ctx: Any, kind: str) -> None:
        parent, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(kind, child), daemon=True, name=f"bench-{kind}-server")
        self.proc.start()
        if not parent.poll(60):
            self.stop()
            raise RuntimeError(f"{kind} benchmark server did not start within 60 s")
        self.address: str = parent.recv()

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()


# ------------------------------------------------------------------ workload


def _session_events(sid: str, now_us: int) -> list[tuple[str, dict[str, Any]]]:
    """One agent session's events: a root and a sub-agent, 4 request/tool rounds each."""
    keys = secrets.token_bytes(16 * 32)
    ev: list[tuple[str, dict[str, Any]]] = [("session_start", {"session_id": sid, "model": "m"}),
                                            ("agent_spawn", {"session_id": sid, "agent_id": "root",
                                                             "agent_type": "planner", "expected_num_requests": 8})]

    def rounds(aid: str) -> None:
        for r in range(4):
            ev.append(("request_start", {"session_id": sid, "agent_id": aid, "request_id": f"{aid}-{r}",
                                         "prompt_block_keys": keys, "num_prompt_tokens": 2048}))
            ev.append(("request_end", {"session_id": sid, "agent_id": aid, "request_id": f"{aid}-{r}",
                                       "num_output_tokens": 200, "stop": 2}))
            ev.append(("tool_call_start", {"session_id": sid, "agent_id": aid, "tool_call_id": f"{aid}-t{r}",
                                           "tool_name": "bash", "expected_duration_s": 2.0}))
            ev.append(("tool_call_end", {"session_id": sid, "agent_id": aid, "tool_call_id": f"{aid}-t{r}",
                                         "status": 1}))

    rounds("root")
    ev.append(("agent_spawn", {"session_id": sid, "agent_id": "sub", "parent_agent_id": "root",
                               "agent_type": "coder"}))
    ev.append(("dependency", {"session_id": sid, "from_agent_id": "sub", "to_agent_id": "root"}))
    rounds("sub")
    ev.append(("pin", {"session_id": sid, "block_keys": keys[:256], "ttl_s": 30.0}))
    ev.append(("agent_end", {"session_id": sid, "agent_id": "sub", "status": 1}))
    ev.append(("session_end", {"session_id": sid}))
    return ev


def build_batches(num_events: int, batch_events: int, client_id: str) -> list[bytes]:
    """Serialised ``PublishRequest`` batches holding ``>= num_events`` valid events."""
    from ..hints._gen import hints_pb2 as pb

    commands = {f.name for f in pb.Command.DESCRIPTOR.oneofs_by_name["kind"].fields}
    now_us = time.time_ns() // 1000
    next_id = secrets.randbits(62) + 1
    events: list[tuple[str, dict[str, Any]]] = []
    n = 0
    while len(events) < num_events:
        events.extend(_session_events(f"{client_id}-s{n}", now_us))
        n += 1
    batches = []
    for start in range(0, len(events), batch_events):
        req = pb.PublishRequest(client_id=client_id)
        for kind, fields in events[start : start + batch_events]:
            holder = req.commands if kind in commands else req.signals
            holder.add(event_id=next_id, client_time_unix_us=now_us, **{kind: fields})
            next_id += 1
        batches.append(req.SerializeToString())
    return batches


# ------------------------------------------------------------------ clients


def _client(conn: Any, num_events: int, batch_events: int, window: int) -> None:
    """Child process: build batches, report ready, then send them to each address it is given."""
    batches = build_batches(num_events, batch_events, f"bench-{os.getpid()}-{secrets.token_hex(3)}")
    conn.send(("ready", None))
    while True:
        msg = conn.recv()
        if msg is None:
            return
        try:
            conn.send(("done", _send_all(msg[0], msg[1], batches, window)))
        except Exception as err:  # report, do not die silently: the parent names the failure
            conn.send(("error", f"{type(err).__name__}: {err}"))


def _send_all(address: str, go_at: float, batches: list[bytes], window: int) -> tuple[int, float, float]:
    import grpc

    from ..hints._gen import hints_pb2 as pb

    with grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 16 << 20)]) as channel:
        call = channel.unary_unary(_PUBLISH)
        grpc.channel_ready_future(channel).result(timeout=30)
        while time.time() < go_at:
            time.sleep(0.0005)
        start = time.perf_counter()
        acked = 0
        pending: list[Any] = []
        for data in batches:
            pending.append(call.future(data, timeout=120))
            if len(pending) >= window:
                acked += pb.PublishResponse.FromString(pending.pop(0).result()).num_accepted
        for fut in pending:
            acked += pb.PublishResponse.FromString(fut.result()).num_accepted
        end = time.perf_counter()
    return acked, end - start, time.time()


def _throughput(ctx: Any, servers: dict[str, _ServerProcess], num_clients: int, total_events: int,
                batch_events: int, window: int) -> dict[str, Any]:
    pipes, procs = [], []
    for _ in range(num_clients):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_client, args=(child, total_events // num_clients, batch_events, window), daemon=True)
        p.start()
        pipes.append(parent)
        procs.append(p)
    try:
        for pipe in pipes:
            if not pipe.poll(300):
                raise RuntimeError("a benchmark client did not get ready within 300 s")
            pipe.recv()
        row: dict[str, Any] = {"clients": num_clients, "batch_events": batch_events}
        for name, server in servers.items():
            go_at = time.time() + 1.0
            for pipe in pipes:
                pipe.send((server.address, go_at))
            replies = [pipe.recv() for pipe in pipes]
            errors = [detail for status, detail in replies if status != "done"]
            if errors:
                raise RuntimeError(f"{len(errors)} benchmark client(s) failed against {name}: {errors[0]}")
            results = [detail for _, detail in replies]
            acked = sum(r[0] for r in results)
            wall_s = max(r[2] for r in results) - go_at
            row[f"{name}_events"] = acked
            row[f"{name}_events_per_s"] = acked / wall_s if wall_s > 0 else float("inf")
        row["kvtier_vs_echo"] = row["kvtier_events_per_s"] / row["echo_events_per_s"]
        for pipe in pipes:
            pipe.send(None)
        return row
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.terminate()
                p.join()


# ------------------------------------------------------------------ emit latency


def _percentile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def _call_floor(num_calls: int, paced_interval_s: float | None) -> list[int]:
    """Nanoseconds of the cheapest possible Python "emit": a function appending its
    arguments to a deque, timed and paced exactly like :func:`emit_latency`."""
    sink: deque[Any] = deque(maxlen=1024)

    def floor(kind: str, **fields: Any) -> bool:
        sink.append((kind, fields))
        return True

    clock, samples = time.perf_counter_ns, []
    for i in range(num_calls):
        t0 = clock()
        floor("tool_call_start", session_id="s", agent_id="a", tool_call_id="t", tool_name="bash")
        samples.append(clock() - t0)
        if paced_interval_s:
            time.sleep(paced_interval_s)
    return samples


def emit_latency(address: str, num_emits: int, *, paced_interval_s: float | None) -> dict[str, Any]:
    """p50 / p99 / max of ``HintClient.emit`` on this thread, in microseconds, next to
    the same figures of a bare Python call (the floor this machine allows)."""
    from ..sdk import HintClient

    client = HintClient(address, max_queue_events=1 << 20)
    samples: list[float] = []
    clock = time.perf_counter_ns
    emit = client.emit
    sid = f"emit-{secrets.token_hex(4)}"
    emit("session_start", session_id=sid)
    emit("agent_spawn", session_id=sid, agent_id="a")
    call_ids = [f"t{i}" for i in range(num_emits // 2)]
    try:
        for call_id in call_ids:  # a start and an end per tool call: every event is valid
            t0 = clock()
            emit("tool_call_start", session_id=sid, agent_id="a", tool_call_id=call_id, tool_name="bash")
            t1 = clock()
            if paced_interval_s:
                time.sleep(paced_interval_s)
            t2 = clock()
            emit("tool_call_end", session_id=sid, agent_id="a", tool_call_id=call_id, status="ok")
            samples.append(t1 - t0)
            samples.append(clock() - t2)
            if paced_interval_s:
                time.sleep(paced_interval_s)
        client.flush(30)
    finally:
        emit("session_end", session_id=sid)
        client.close(10)
    stats = client.stats()
    samples.sort()
    floor = sorted(_call_floor(len(samples), paced_interval_s))
    mode = f"paced {paced_interval_s * 1e6:.0f}us" if paced_interval_s else "burst"
    return {"mode": mode, "emits": len(samples),
            "p50_us": _percentile(samples, 0.50) / 1e3, "p99_us": _percentile(samples, 0.99) / 1e3,
            "max_us": samples[-1] / 1e3, "mean_us": statistics.fmean(samples) / 1e3,
            "floor_p50_us": _percentile(floor, 0.50) / 1e3, "floor_p99_us": _percentile(floor, 0.99) / 1e3,
            "server_accepted": stats.accepted, "server_rejected": stats.rejected, "dropped": stats.num_dropped}


# ------------------------------------------------------------------ driver


def run(*, total_events: int = 200_000, batch_events: int = 1024, client_counts: tuple[int, ...] = (1, 4, 16),
        window: int = 2, emit_samples: int = 20_000, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run every measurement; return the report (also what ``--json`` writes)."""
    say = progress or (lambda _m: None)
    ctx = mp.get_context("spawn")
    servers: dict[str, _ServerProcess] = {}
    try:
        for kind in ("echo", "kvtier"):
            servers[kind] = _ServerProcess(ctx, kind)
        rows = []
        for n in client_counts:
            say(f"throughput: {n} client process(es), {total_events} events, batches of {batch_events}")
            rows.append(_throughput(ctx, servers, n, total_events, batch_events, window))
        say(f"emit latency: {emit_samples} paced and {emit_samples} burst emits")
        emits = [emit_latency(servers["kvtier"].address, emit_samples, paced_interval_s=1e-4),
                 emit_latency(servers["kvtier"].address, emit_samples, paced_interval_s=None)]
    finally:
        for server in servers.values():
            server.stop()
    best = max(r["kvtier_events_per_s"] for r in rows)
    paced = emits[0]
    return {
        "throughput": rows,
        "emit_latency": emits,
        "targets": TARGETS,
        "targets_met": {
            "events_per_s": best >= TARGETS["min_events_per_s"],
            "emit_p99_paced": paced["p99_us"] <= TARGETS["max_emit_p99_us"],
            "ratio_vs_echo": min(r["kvtier_vs_echo"] for r in rows) >= TARGETS["min_ratio_vs_echo"],
        },
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
    }


def print_report(report: dict[str, Any], out: Any = sys.stdout) -> None:
    """The two tables and the target verdicts."""
    cols = ["clients", "batch_events", "echo_events_per_s", "kvtier_events_per_s", "kvtier_vs_echo"]
    _table(report["throughput"], cols, out)
    print(file=out)
    _table(report["emit_latency"], ["mode", "emits", "p50_us", "p99_us", "max_us", "floor_p50_us", "floor_p99_us",
                                    "dropped"], out)
    t = report["targets"]
    print(f"\ntargets: >= {t['min_events_per_s']:,} events/s aggregate, emit p99 <= {t['max_emit_p99_us']} us "
          f"(paced), kvtier >= {t['min_ratio_vs_echo']}x echo", file=out)
    print("targets met: " + ", ".join(f"{k}={'yes' if v else 'NO'}" for k, v in report["targets_met"].items()),
          file=out)


def _table(rows: list[dict[str, Any]], cols: list[str], out: Any) -> None:
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.2f}"
        return str(v)

    cells = [[fmt(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    print("  ".join(c.rjust(w) for c, w in zip(cols, widths)), file=out)
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)), file=out)
