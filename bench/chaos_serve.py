#!/usr/bin/env python3
"""Faults injected into the real server under load: ``vllm serve`` with kvtier (DRAM, SSD,
Mooncake, a followed hint server) while the soak's agent sessions run, one fault after
another, each with what must hold and how long recovery took.

The server and the load are the soak's (``bench/soak_serve.py``): the tiny float32 chat
model, 48 HBM blocks (contexts spill to kvtier's tiers), 6 concurrent agent sessions with
tool waits, client aborts and abandoned sessions. Here the sessions also announce their
agents and tool calls to a separate hint server (``kvtier serve``) that the engine follows
(``hint_watch``), DRAM is small (32 blocks: reads reach the SSD) and the SSD directory is
on a 512 MiB tmpfs of its own (mounted here; without one the full-disk fault is not injected, and
the row says so).

The faults, in order (``FAULTS``):

* ``mooncake_master``: the master is SIGKILLed, the load runs 15 s without it, and it is
  restarted on the same ports. Recovery: the restart to the first block stored remotely again.
* ``hint_server``: ``kvtier serve`` is SIGKILLed, 12 s, restarted on the same port (the
  SDK clients announce their live sessions again). Recovery: the restart to the engine's
  watcher receiving views again.
* ``ssd_full``: a file fills the SSD's filesystem for 15 s, then is removed. Recovery: its
  removal to the last SSD store that failed after it. (LMDB reuses the pages of values it
  deleted, so stores that fit in those succeed even on a full disk: the SSD tier is sized
  here, 4,096 blocks, to evict nothing during the run, and this fault comes before the
  next, whose rewrite leaves such pages.)
* ``ssd_read_errors``: every value in the SSD tier's LMDB gets a flipped payload byte, from
  another process, while the engine runs, and the 12 earliest sampled prompts are sent again
  (their KV is on the SSD alone by then, whether DRAM is exclusive or written through).
  Seen: a load or a copy up into DRAM that failed its check. Recovery: the flip to the next
  block loaded from the SSD after the first failed load (the bad values are misses,
  recomputed, and deleted).
* ``stalled_loads``: every read from the SSD tier hangs (the engine runs
  ``bench/stall_connector.py``, the kvtier connector with a switch: while a file exists its
  SSD reads wait before reading anything) while 6 earlier sampled prompts, whose KV is on the
  SSD, are sent again one by one; the engine's ``load_deadline_s`` is 2 s. Seen: loads past
  their deadline, recomputed (``load_expired_blocks``); none of those prompts may take more
  than 30 s to answer (``hung``; a prompt's retry can meet the hang again, behind the hung
  reads on the ``ssd-read`` lane, see ``NO_HANG_S``). Recovery: the hang's end to the next prompt
  tokens loaded from the SSD.
* ``preemption_with_holds``: critical agents (criticality 1; the load's agents say 0.5, so
  none of them keeps the critical agents' HBM budget while paused) whose requests say a 20 s tool
  wait leave HBM holds; then 8 requests at once that fit at first and outgrow the pool while
  decoding (vLLM preempts). Recovery: the burst's end to every block free and none held
  (the holds lapse at their TTL).
* ``engine_sigkill``: the load pauses, the engine's whole process group is SIGKILLed and
  ``vllm serve`` restarted over the same SSD directory; earlier prompts are sent again.
  Recovery: the kill to the first request served by the new engine (its start-up, mostly).

What must hold for each (``row_ok``): no request failed in its window, no sampled output
differs from a server without the connector (every second finished request is sampled),
the drain after it finds the free HBM blocks back at their idle count and no block held,
the fault was seen (its counter moved) and recovery came within its limit
(``RECOVERY_LIMIT_S``). The JSON has one row per fault; ``bench/chaos_tables.py`` renders
the README's fault table from it.

Usage (in the vLLM venv, as root for the tmpfs)::

    .venv-vllm/bin/python bench/chaos_serve.py --json bench/out/chaos-serve.json
    .venv/bin/python bench/chaos_serve.py --plot bench/out/chaos-serve.json --png bench/out/chaos-serve.png

``tests/engine/test_vllm_chaos.py`` runs it in CI.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

from soak_serve import (  # noqa: E402
    ROOT,
    Load,
    Server,
    _kvtier_stats,
    _pct,
    add_output_arguments,
    drain,
    plot_only,
    write_outputs,
)

RESENT_PROMPTS = 12  # ssd_read_errors: the earliest sampled prompts sent again after the flip
LOAD_DEADLINE_S = 2.0  # the engine's load_deadline_s
STALLED_PROMPTS = 6  # stalled_loads: the sampled prompts after ssd_read_errors' sent again while the SSD hangs
STALL_GUARD_S = 90.0  # stalled_loads: the hang ends by then whatever happens (a harness that waits must not hang)
# stalled_loads: an answer slower than this waited on the hung SSD. A prompt may meet the hang more than once: its
# retry after an expired load can plan another load that queues behind the hung reads on the worker's ssd-read lane (and
# waits its own deadline); one run here answered in 11 s with a 2 s deadline, while the hang lasted 35 s
NO_HANG_S = 30.0
# kvtier counters sampled into the timeline each second (besides the rows' counter_changes)
TIMELINE_COUNTERS = ("lookups", "load_deferred", "load_deferred_shared", "remote_lookup_deferred",
                     "load_expired_blocks", "load_planned_tokens")
RECOVERY_LIMIT_S = {"mooncake_master": 30.0, "hint_server": 15.0, "ssd_full": 30.0, "ssd_read_errors": 30.0,
                    "stalled_loads": 30.0, "preemption_with_holds": 60.0, "engine_sigkill": 240.0}
"""How long recovery may take, per fault (the engine's restart on this 2-core machine is most of the last)."""
FAULTS = tuple(RECOVERY_LIMIT_S)
STALL_CONNECTOR = ("StallSwitchConnector", "stall_connector")
BURST_TOKENS = 400  # each of the burst's 8 requests: 5-6 blocks of prompt, then 13 more of output


class Chaos:
    """The server, its helpers (master, hint server, tmpfs) and the load, with one method per fault."""

    def __init__(self, work: Path, sessions: int, seed: int) -> None:
        from tests.engine.chat_model import make_chat_model

        from kvtier.benchmarks.remote import LocalMaster, mooncake_problem

        problem = mooncake_problem()
        if problem is not None:
            raise SystemExit(f"chaos: the Mooncake remote tier is needed here: {problem}")
        self.work = work
        self.model = make_chat_model(work / "model")
        self.stats_path = work / "stats.json"
        self.ssd_mount = work / "ssd-fs"
        self.ssd_mount.mkdir()
        got = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512m", "tmpfs", str(self.ssd_mount)],
                             capture_output=True, text=True, check=False)
        self.tmpfs_problem = None if got.returncode == 0 else (got.stderr.strip() or "mount failed")
        self.master = self.hint_proc = self.server = self.hints = self.load = None
        try:  # a failed start leaves no master, hint server, engine or mount behind
            self.master = LocalMaster(work / "master.log").start()
            self._start(work, sessions, seed)
        except BaseException:
            self.close()
            raise
        self.extra_samples: list[dict[str, Any]] = []  # the burst's and the restart's requests, checked too
        self.t0 = time.monotonic()
        self.timeline: list[dict[str, Any]] = []
        self._sampling = threading.Event()
        self._sampler = threading.Thread(target=self._sample, daemon=True)

    def _start(self, work: Path, sessions: int, seed: int) -> None:
        """The hint server, the engine (read idle) and the load, not yet started."""
        from kvtier.benchmarks.remote import free_port
        from kvtier.sdk import HintClient

        self.hint_port = free_port()
        self.hint_log = open(work / "hints.log", "ab")  # noqa: SIM115 - open while the hint server runs
        self.hint_proc = self._start_hints()
        self.kvtier = {"dram_capacity_blocks": 32, "ssd_path": str(self.ssd_mount / "kv"),
                       "ssd_capacity_blocks": 4096, "stats_path": str(self.stats_path), "placement": "kvtier",
                       "remote_master": self.master.master, "remote_metadata_server": self.master.metadata_server,
                       "remote_segment_mib": 64, "hint_watch": f"127.0.0.1:{self.hint_port}",
                       "load_deadline_s": LOAD_DEADLINE_S}
        # the kvtier connector with a switch that hangs its SSD reads (bench/stall_connector.py)
        self.stall_file = work / "stall-ssd-reads"
        os.environ["CHAOS_STALL_SSD_READS_FILE"] = str(self.stall_file)
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parent),
                                                                 os.environ.get("PYTHONPATH")]))
        self.server = Server(work, "chaos", self.model, self.kvtier, connector=STALL_CONNECTOR)
        self.idle = drain(self.server, None, self.stats_path)
        self.hints = HintClient(f"127.0.0.1:{self.hint_port}")
        # The load's agents are not critical (0.5, under the placement's critical_at): a paused agent's reserve
        # keeps its share of the critical agents' HBM budget until it comes back, so a critical load agent paused
        # in a wait could leave preemption_with_holds' agents nothing to hold (seen in CI: the fault not seen)
        self.load = Load(self.server, sessions, seed, hints=self.hints, sample_fraction=0.5, max_samples=600,
                         criticality=0.5)

    # ---------------------------------------------------------------- helpers

    def _start_hints(self) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-m", "kvtier.cli", "serve",
                                 "--listen", f"127.0.0.1:{self.hint_port}"],
                                stdout=self.hint_log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        import socket

        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.hint_port), timeout=0.2).close()
                return proc
            except OSError:
                if proc.poll() is not None:
                    break
                time.sleep(0.1)
        raise SystemExit(f"chaos: kvtier serve did not start (log {self.work / 'hints.log'})")

    def stats(self) -> dict[str, Any]:
        return _kvtier_stats(self.stats_path)

    def counter(self, name: str) -> int:
        return int(self.stats().get("counters", {}).get(name, 0))

    def wait_for(self, probe: Callable[[], bool], limit_s: float) -> float | None:
        """Seconds until ``probe()`` holds (polled every 0.2 s), or ``None`` after ``limit_s``."""
        start = time.monotonic()
        while time.monotonic() - start < limit_s:
            if probe():
                return round(time.monotonic() - start, 2)
            time.sleep(0.2)
        return None

    def now(self) -> float:
        return round(time.monotonic() - self.t0, 1)

    def _sample(self) -> None:
        while not self._sampling.wait(1.0):
            try:
                m = self.server.metrics()
            except OSError:
                m = {}
            s = self.stats()
            ttft, _ = self.load.take_window()
            with self.load.lock:
                counts = dict(self.load.counts)
            self.timeline.append({"t_s": self.now(), "finished": counts["finished"], "failed": counts["failed"],
                                  "ttft_p50_s": _pct(ttft, 0.5), "ttft_p95_s": _pct(ttft, 0.95),
                                  "held_blocks": (s.get("hbm_hold") or {}).get("held_blocks"),
                                  "running": m.get("vllm:num_requests_running"),
                                  "waiting": m.get("vllm:num_requests_waiting"),
                                  "preemptions": m.get("vllm:num_preemptions_total"),
                                  # what tells a stuck engine's cases apart: HBM full, or lookups deferred
                                  "kv_usage": m.get("vllm:kv_cache_usage_perc"),
                                  **{name: (s.get("counters") or {}).get(name) for name in TIMELINE_COUNTERS}})

    def count_own(self, outs: list[dict[str, Any]]) -> None:
        """Requests the harness sent itself (holds, the burst, the restart's): in the load's counts too."""
        with self.load.lock:
            self.load.counts["sent"] += len(outs)
            for got in outs:
                if "error" in got:
                    self.load.counts["failed"] += 1
                    self.load.errors.append(got["error"])
                else:
                    self.load.counts["finished"] += 1

    def window(self, name: str, what: str, fault: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """Run one fault under the load: its row, with the failed requests of its window and the drain after it."""
        with self.load.lock:
            failed0, sent0 = self.load.counts["failed"], self.load.counts["sent"]
        counters0 = self.stats().get("counters") or {}
        log_path = self.server.log_path  # (engine_sigkill replaces the server: the killed one's log)
        start = self.now()
        print(f"[{start:6.1f} s] fault {name}: {what}", flush=True)
        row = {"fault": name, "injected": what, "start_s": start, **fault()}
        with self.load.lock:
            row["failed"] = self.load.counts["failed"] - failed0
            row["requests"] = self.load.counts["sent"] - sent0
        # what kvtier counted in the window (a restarted engine counts from 0), and for a window with a failed
        # or hung request the server log's end: what an intermittent failure needs to be read afterwards
        counters = self.stats().get("counters") or {}
        row["counter_changes"] = {k: v - counters0.get(k, 0) for k, v in sorted(counters.items())
                                  if isinstance(v, (int, float)) and v != counters0.get(k, 0)}
        if row["failed"] or row.get("hung"):
            lines = log_path.read_text(errors="replace").splitlines() if log_path.exists() else []
            row["server_log_tail"] = lines[-80:]
        d = drain(self.server, self.load, self.stats_path)
        row.update(end_s=self.now(), drain_free_blocks=d["free_blocks"], drain_held_blocks=d["held_blocks"],
                   recovery_limit_s=RECOVERY_LIMIT_S[name])
        print(f"[{row['end_s']:6.1f} s] {name}: recovery {row.get('recovery_s')} s, failed {row['failed']}, "
              f"drain free {d['free_blocks']} held {d['held_blocks']}; {row.get('evidence')}", flush=True)
        return row

    # ---------------------------------------------------------------- the faults

    def mooncake_master(self) -> dict[str, Any]:
        failed0 = self.counter("store_failed_blocks_remote")
        skipped0 = self.counter("remote_lookup_skipped_down")
        calls0 = self.counter("remote_client_down_skips")
        self.master.stop()  # SIGKILL
        time.sleep(15)
        failed = self.counter("store_failed_blocks_remote") - failed0
        skipped = self.counter("remote_lookup_skipped_down") - skipped0
        calls = self.counter("remote_client_down_skips") - calls0
        stored = self.counter("stored_blocks_remote")
        t_restart = time.monotonic()
        self.master.start()
        back = self.wait_for(lambda: self.counter("stored_blocks_remote") > stored, RECOVERY_LIMIT_S["mooncake_master"])
        rec = None if back is None else round(time.monotonic() - t_restart, 2)
        time.sleep(5)
        return {"seen": failed + skipped > 0, "recovery_s": rec,
                "recovered": "the first block stored remotely, from the restart (the master's start included)",
                "evidence": f"{failed} remote stores failed, {calls} calls of the workers' store client failed at "
                            f"once and {skipped} of the scheduler's lookups were misses at once (the store marked "
                            "down) while it was down"}

    def hint_server(self) -> dict[str, Any]:
        drops0 = sum(self.hints.drops.values())
        before = self.stats().get("hint_watch") or {}
        self.hint_proc.kill()
        self.hint_proc.wait()
        time.sleep(12)
        watch = self.stats().get("hint_watch") or {}
        views = watch.get("views", 0)
        broke = watch.get("last_error") if watch.get("reconnects", 0) > before.get("reconnects", 0) else None
        t_restart = time.monotonic()
        self.hint_proc = self._start_hints()
        back = self.wait_for(lambda: (self.stats().get("hint_watch") or {}).get("views", 0) > views,
                             RECOVERY_LIMIT_S["hint_server"])
        rec = None if back is None else round(time.monotonic() - t_restart, 2)
        time.sleep(5)
        drops = sum(self.hints.drops.values()) - drops0
        return {"seen": broke is not None, "recovery_s": rec,
                "recovered": "the engine's watcher receiving views again, from the restart (the server's start "
                             "included)",
                "evidence": f"the engine's watch stream broke ({(broke or '').split(':')[0]}); {drops} SDK events "
                            "dropped while it was down"}

    def ssd_read_errors(self) -> dict[str, Any]:
        import lmdb

        from kvtier.tiers.codec import HEADER_BYTES

        def failed_blocks() -> int:  # loads into HBM, and copies up into DRAM (prefetch, staging)
            return self.counter("load_failed_blocks") + self.counter("promote_failed_blocks")

        failed0, load_failed0 = failed_blocks(), self.counter("load_failed_blocks")
        path = Path(self.kvtier["ssd_path"]) / "tp0-of-1"  # (rank 0's directory)
        env = lmdb.open(str(path), subdir=True, create=False, map_size=lmdb_map_size(path / "data.mdb"),
                        max_readers=256)
        flipped = 0
        with env.begin(write=True) as txn:
            for key, value in list(txn.cursor()):
                if len(value) > HEADER_BYTES + 64:
                    b = bytearray(value)
                    b[HEADER_BYTES + 17] ^= 0x5A
                    txn.put(key, bytes(b))
                    flipped += 1
        env.close()
        t_flip = time.monotonic()
        # the earliest prompts again: their KV left HBM and DRAM long ago and is on the flipped SSD alone, so their
        # loads (or copies up into DRAM) meet the flipped bytes whatever DRAM keeps (exclusive or written through)
        old = self.load.samples[:RESENT_PROMPTS]
        outs = [self.server.complete(smp["prompt"], smp["max_tokens"]) for smp in old]
        self.count_own(outs)
        self.extra_samples += [{"prompt": smp["prompt"], "max_tokens": smp["max_tokens"], "text": o.get("text"),
                                "t": time.monotonic()} for smp, o in zip(old, outs) if "text" in o]
        differing = sum(o.get("text") != smp["text"] for smp, o in zip(old, outs))
        seen = self.wait_for(lambda: failed_blocks() > failed0, 30)
        ssd_hits = self.counter("hit_tokens_ssd")
        back = self.wait_for(lambda: self.counter("hit_tokens_ssd") > ssd_hits, RECOVERY_LIMIT_S["ssd_read_errors"])
        rec = None if back is None else round(time.monotonic() - t_flip, 2)
        failed = self.counter("load_failed_blocks") - load_failed0
        promoted = failed_blocks() - failed0 - failed
        return {"seen": seen is not None, "recovery_s": rec,
                "recovered": "from the flip to prompt tokens loaded from the SSD after the first failed load",
                "evidence": f"{flipped} values flipped; {failed} blocks failed their load and were recomputed, "
                            f"{promoted} failed their copy up into DRAM; {len(old)} earliest prompts sent again, "
                            f"{differing} answered differently than the first time"}

    def stalled_loads(self) -> dict[str, Any]:
        expired0 = self.counter("load_expired_blocks")
        guard = threading.Timer(STALL_GUARD_S, lambda: self.stall_file.unlink(missing_ok=True))
        self.stall_file.write_text("SSD reads hang while this file exists\n")
        guard.start()
        try:
            # earlier prompts whose KV is on the SSD by now (not the ones ssd_read_errors sent again: their loads
            # dropped the flipped values; the hang comes before any read, so flipped or not makes no difference)
            old = self.load.samples[RESENT_PROMPTS:RESENT_PROMPTS + STALLED_PROMPTS]
            outs, took = [], []
            for smp in old:
                t = time.monotonic()
                outs.append(self.server.complete(smp["prompt"], smp["max_tokens"]))
                took.append(time.monotonic() - t)
            seen = self.wait_for(lambda: self.counter("load_expired_blocks") > expired0, 10)
        finally:
            self.stall_file.unlink(missing_ok=True)
            guard.cancel()
        t_clear = time.monotonic()
        self.count_own(outs)
        self.extra_samples += [{"prompt": smp["prompt"], "max_tokens": smp["max_tokens"], "text": o.get("text"),
                                "t": time.monotonic()} for smp, o in zip(old, outs) if "text" in o]
        differing = sum(o.get("text") != smp["text"] for smp, o in zip(old, outs))
        ssd_hits = self.counter("hit_tokens_ssd")
        back = self.wait_for(lambda: self.counter("hit_tokens_ssd") > ssd_hits, RECOVERY_LIMIT_S["stalled_loads"])
        rec = None if back is None else round(time.monotonic() - t_clear, 2)
        slowest = round(max(took), 2) if took else None
        expired = self.counter("load_expired_blocks") - expired0
        return {"seen": seen is not None, "recovery_s": rec, "resent_differing": differing,
                "hung": sum(t > NO_HANG_S for t in took),
                "recovered": "from the SSD's hang ending to prompt tokens loaded from the SSD again",
                "evidence": f"{expired} blocks of loads past the {LOAD_DEADLINE_S:g} s deadline recomputed; "
                            f"{len(old)} earlier prompts sent during the hang, the slowest answered in {slowest} s, "
                            f"{differing} answered differently than the first time"}

    def ssd_full(self) -> dict[str, Any]:
        if self.tmpfs_problem is not None:
            return {"seen": None, "recovery_s": None, "recovered": "",
                    "evidence": f"not injected: no tmpfs could be mounted ({self.tmpfs_problem})"}
        failed0 = self.counter("store_failed_blocks_ssd")
        filler = self.ssd_mount / "filler"
        chunk = b"\0" * (1 << 20)
        fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            while os.write(fd, chunk) > 0:
                pass
        except OSError:
            pass  # ENOSPC: the filesystem is full
        finally:
            os.close(fd)
        time.sleep(15)
        fails = self.counter("store_failed_blocks_ssd")
        failed = fails - failed0
        stored = self.counter("stored_blocks_ssd")
        filler.unlink()
        # LMDB reuses the pages of deleted values, so some stores succeed even on the full disk: recovery is
        # when stores stop failing (the last failure counted after the space came back), with stores going on
        t_back, last_fail = time.monotonic(), 0.0
        while time.monotonic() - t_back < RECOVERY_LIMIT_S["ssd_full"] / 2:
            now = self.counter("store_failed_blocks_ssd")
            if now > fails:
                fails, last_fail = now, time.monotonic() - t_back
            time.sleep(0.2)
        stored_after = self.counter("stored_blocks_ssd") - stored
        return {"seen": failed > 0, "recovery_s": round(last_fail, 2) if stored_after > 0 else None,
                "recovered": "the last SSD store failure after space came back (15 s watched; stores went on)",
                "evidence": f"{failed} SSD stores failed and were counted while the disk was full; "
                            f"{stored_after} stored in the 15 s after"}

    def preemption_with_holds(self) -> dict[str, Any]:
        import random

        rng = random.Random(7)
        self.load.pause()
        for i in range(4):  # critical agents now waiting on a long tool: their (2-block) contexts are held
            prompt = [rng.randrange(3, 259) for _ in range(70)]
            self.count_own([self.server.complete(prompt, 4, {
                "kvtier_session_id": f"hold-{i}", "kvtier_agent_id": "a", "kvtier_tool_wait_s": 20.0,
                "kvtier_criticality": 1.0})])
        def held_now() -> int:  # a probe steps the engine, whose next step rewrites the stats file
            self.server.complete([5, 6, 7], 1)
            time.sleep(0.3)
            return (self.stats().get("hbm_hold") or {}).get("held_blocks") or 0

        self.wait_for(lambda: held_now() > 0, 5.0)
        held = held_now()
        pre0 = self.server.metrics().get("vllm:num_preemptions_total", 0)
        # 8 requests that all fit at first (5-6 blocks each) and then outgrow the pool while decoding
        prompts = [[rng.randrange(3, 259) for _ in range(rng.randrange(150, 190))] for _ in range(8)]
        outs: list[dict[str, Any]] = [{} for _ in prompts]

        def one(i: int) -> None:
            outs[i] = self.server.complete(prompts[i], BURST_TOKENS, stream=True)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        self.load.go.set()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        t_end = time.monotonic()
        self.count_own(outs)
        self.extra_samples += [{"prompt": p, "max_tokens": BURST_TOKENS, "text": o.get("text"), "t": t_end}
                               for p, o in zip(prompts, outs) if "text" in o]
        self.load.pause()

        def back() -> bool:  # a probe steps the engine (holds lapse on its steps), then the pool is read
            self.server.complete([5, 6, 7], 1)
            time.sleep(0.3)
            s = self.stats()
            return s.get("hbm_free_blocks") == self.idle["free_blocks"] and (s.get("hbm_hold") or {}).get(
                "held_blocks") == 0

        self.wait_for(back, RECOVERY_LIMIT_S["preemption_with_holds"])
        rec = round(time.monotonic() - t_end, 2) if back() else None
        preempted = self.server.metrics().get("vllm:num_preemptions_total", 0) - pre0  # read after the engine settled
        self.load.go.set()
        return {"seen": held > 0 and preempted > 0, "recovery_s": rec,
                "recovered": "every HBM block free and none held (a drain after the burst)",
                "evidence": f"{held} blocks held when 8 requests came that outgrow the pool; "
                            f"{int(preempted)} preemptions"}

    def engine_sigkill(self) -> dict[str, Any]:
        self.load.pause()
        again = self.load.samples[-12:]
        self.wait_for(lambda: self.stats().get("pending_plans", 1) == 0, 30)
        ssd0 = self.counter("stored_blocks_ssd")
        t_kill = time.monotonic()
        os.killpg(self.server.proc.pid, signal.SIGKILL)
        self.server.proc.wait()
        self.server.log.close()
        self.server = Server(self.work, "chaos-restarted", self.model, self.kvtier, connector=STALL_CONNECTOR)
        self.load.server = self.server
        first = None
        wrong = 0
        for smp in again:
            got = self.server.complete(smp["prompt"], smp["max_tokens"])
            self.count_own([got])
            if first is None and "text" in got:
                first = round(time.monotonic() - t_kill, 2)
            wrong += got.get("text") != smp["text"]
        hits = self.counter("hit_tokens_ssd")
        self.load.go.set()
        time.sleep(10)
        return {"seen": True, "recovery_s": first, "recovered": "the first request served by the restarted engine",
                "warm_ssd_tokens": hits, "resent_differing": wrong,
                "evidence": f"{ssd0} blocks on the SSD before the kill; {hits} prompt tokens of {len(again)} earlier "
                            f"prompts loaded from it after the restart; {wrong} of them answered differently"}

    # ---------------------------------------------------------------- the run

    def run(self, warmup_s: float) -> dict[str, Any]:
        self.load.start()
        self._sampler.start()
        time.sleep(warmup_s)
        rows = []
        whats = {"mooncake_master": "mooncake_master SIGKILLed for 15 s, restarted on its ports",
                 "hint_server": "the followed hint server (kvtier serve) SIGKILLed for 12 s, restarted",
                 "ssd_read_errors": "a payload byte flipped in every SSD value, by another process",
                 "ssd_full": "the SSD's filesystem filled for 15 s",
                 "stalled_loads": f"every SSD read hangs while {STALLED_PROMPTS} earlier prompts are sent again",
                 "preemption_with_holds": "8 requests at once that outgrow HBM while agents' blocks are held",
                 "engine_sigkill": "the engine's process group SIGKILLed, restarted over its SSD directory"}
        for name in FAULTS:
            rows.append(self.window(name, whats[name], getattr(self, name)))
        self.load.stop.set()
        self.load.go.set()
        for t in self.load.threads:
            t.join(timeout=150)
        self._sampling.set()
        self._sampler.join()
        for row in rows:  # the median of the per-second TTFT p50s in its window (and before any fault)
            row["ttft_p50_s"] = _median_ttft(self.timeline, row["start_s"], row["end_s"])
        self.idle["ttft_p50_s"] = _median_ttft(self.timeline, 0.0, rows[0]["start_s"])
        return {"rows": rows, "idle": self.idle, "client": dict(self.load.counts), "client_errors": self.load.errors,
                "kvtier_counters": self.stats().get("counters", {}), "timeline": self.timeline}

    def close(self) -> None:
        """Stop whatever was started (also after a start that failed part way)."""
        if self.load is not None:
            self.load.stop.set()
            self.load.go.set()
        if self.server is not None:
            self.server.stop()
        if self.hints is not None:
            self.hints.close(timeout_s=1)
        if self.hint_proc is not None:
            if self.hint_proc.poll() is None:
                self.hint_proc.kill()
            self.hint_log.close()
        if self.master is not None:
            self.master.stop()
        if self.tmpfs_problem is None:
            subprocess.run(["umount", "-l", str(self.ssd_mount)], check=False)


def _median_ttft(timeline: list[dict[str, Any]], start: float, end: float) -> float | None:
    import statistics

    got = [x["ttft_p50_s"] for x in timeline if start <= x["t_s"] <= end and x["ttft_p50_s"] is not None]
    return round(statistics.median(got), 4) if got else None


def lmdb_map_size(data_mdb: Path) -> int:
    """The map size an LMDB file's writer set (its two meta pages: magic, version, address, map size after
    the 16-byte page header). Another process writing to it must map the same: a smaller map is full at
    once (each rewritten value takes new pages), a larger one would be recorded for the engine too."""
    import struct

    raw = data_mdb.read_bytes()[:8192]
    sizes = [struct.unpack_from("<IIQQ", raw, off + 16) for off in (0, 4096)]
    return max(size for magic, _, _, size in sizes if magic == 0xBEEFC0DE)


def check_outputs(work: Path, model: Path, rows: list[dict[str, Any]], samples: list[dict[str, Any]],
                  t0: float) -> int:
    """Send every sampled prompt to a server without the connector; count, per fault window, the differing ones."""
    ref = Server(work, "reference", model, None)
    differing = 0
    try:
        for smp in samples:
            got = ref.complete(smp["prompt"], smp["max_tokens"])
            bad = got.get("text") != smp["text"]
            differing += bad
            t = smp["t"] - t0
            for row in rows:
                if row["start_s"] <= t <= row["end_s"]:
                    row["checked"] = row.get("checked", 0) + 1
                    row["wrong"] = row.get("wrong", 0) + bad
    finally:
        ref.stop()
    return differing


def row_ok(row: dict[str, Any], idle_free: int) -> bool:
    if row["seen"] is None:  # not injected here (said in the row)
        return True
    rec = row["recovery_s"]
    return bool(row["seen"] and row["failed"] == 0 and row.get("wrong", 0) == 0 and row.get("resent_differing", 0) == 0
                and row.get("hung", 0) == 0
                and row["drain_free_blocks"] == idle_free and row["drain_held_blocks"] == 0
                and rec is not None and rec <= row["recovery_limit_s"] and row.get("warm_ssd_tokens", 1) > 0)


def run(args: argparse.Namespace) -> dict[str, Any]:
    sys.path.insert(0, str(ROOT))
    from kvtier.provenance import provenance

    work = Path(args.workdir or tempfile.mkdtemp(prefix="kvtier-chaos-"))
    work.mkdir(parents=True, exist_ok=True)
    chaos = Chaos(work, args.sessions, args.seed)
    try:
        result = chaos.run(args.warmup_s)
    finally:
        chaos.close()
    samples = chaos.load.samples + chaos.extra_samples
    result["outputs_checked"] = len(samples)
    result["outputs_differing"] = check_outputs(work, chaos.model, result["rows"], samples, chaos.t0)
    for row in result["rows"]:
        row["ok"] = row_ok(row, chaos.idle["free_blocks"])
    result.update(provenance(("kvtier", "integrations", "bench/chaos_serve.py", "bench/soak_serve.py"),
                             dirty_key="code_dirty"))
    result.update(sessions=args.sessions, hbm_blocks=48, ok=all(r["ok"] for r in result["rows"])
                  and result["outputs_differing"] == 0 and result["client"]["failed"] == 0)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return result


def plot(result: dict[str, Any], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tl = result["timeline"]
    t = [x["t_s"] for x in tl]
    fig, axes = plt.subplots(3, 1, figsize=(11, 8), sharex=True)
    rate = [0.0] + [b["finished"] - a["finished"] for a, b in zip(tl, tl[1:])]
    axes[0].plot(t, rate)
    axes[0].set_title("requests finished per second")
    for key, label in (("ttft_p50_s", "TTFT p50"), ("ttft_p95_s", "TTFT p95")):
        axes[1].plot(t, [x[key] for x in tl], label=label)
    axes[1].set_title("TTFT (s)")
    axes[1].legend()
    for key, label in (("held_blocks", "held HBM blocks"), ("running", "running"), ("waiting", "waiting")):
        axes[2].plot(t, [x[key] for x in tl], label=label)
    axes[2].set_title("holds and queues")
    axes[2].legend()
    axes[2].set_xlabel("seconds")
    top = axes[0].get_ylim()[1]
    for i, row in enumerate(result["rows"]):
        for ax in axes:
            ax.axvspan(row["start_s"], row["end_s"], color="tab:red" if not row["ok"] else "tab:orange", alpha=0.12)
        axes[0].text(row["start_s"], top * (0.92 - 0.12 * (i % 2)), row["fault"], fontsize=7)
    ok = sum(r["ok"] for r in result["rows"])
    fig.suptitle(f"kvtier under faults: vllm serve, {result['sessions']} sessions; {ok}/{len(result['rows'])} "
                 f"faults survived; outputs differing {result['outputs_differing']}/{result['outputs_checked']}")
    fig.tight_layout()
    fig.savefig(png, dpi=90)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sessions", type=int, default=6, help="agent sessions at once, one client thread each")
    p.add_argument("--warmup-s", type=float, default=30.0, help="load before the first fault (default 30)")
    p.add_argument("--seed", type=int, default=0)
    add_output_arguments(p)
    args = p.parse_args(argv)
    if plot_only(p, args, plot):
        return 0
    if args.sessions < 1 or args.warmup_s < 0:
        p.error("--sessions must be >= 1 and --warmup-s >= 0")
    result = run(args)
    write_outputs(args, result, plot)
    for row in result["rows"]:
        print(f"{row['fault']:24s} {'ok' if row['ok'] else 'FAILED':6s} recovery {row['recovery_s']} s; "
              f"{row['evidence']}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
