"""RequestRecorder: the requests an engine serves → AgentX traces that ``kvtier replay`` reads (issue 25).

Owns: turning the requests an engine serves (arrival, prompt blocks, output
length, finish, session / agent tags, tool waits) into AgentX / Weka JSON
trace files in a directory, written by a background thread. Must not keep
prompt text or token ids: a prompt is recorded as its length and its full
blocks' keys, each mapped through a keyed digest (the key is a random salt
kept in the directory) to an anonymous integer id; equal blocks get equal ids
across the whole recording, including engine restarts into the same
directory. Must not slow the engine: :meth:`RequestRecorder.arrived` and
:meth:`RequestRecorder.finished` only append to a bounded queue (when it is
full, requests are dropped and counted). Must not import an engine.

Files. One trace per (session, agent) of tagged requests, and one for the
untagged requests of a recorder run (their order is the engine's order), with
``hash_id_scope`` ``"global"`` so that every trace of the recording shares
block ids. A request is ``{"t", "type": "n", "in", "out", "hash_ids",
"out_hash_ids", "stop", "api_time", "think_time"}``: ``t`` counts from the trace's first
arrival, ``think_time`` from the end of the same trace's previous request,
``out_hash_ids`` are the ids of the full blocks the answer filled after the
prompt's (the engine cached them; a next turn whose prompt re-renders the
answer, as a chat template does a tool call, does not hit them),
``stop`` is ``tool_use`` when the request announced a tool wait. Every
``flush_s`` the writer rewrites the file of each trace that got requests,
through a temporary file and a rename, so a crash leaves whole files (the
last ``flush_s`` of requests is lost). A trace that reaches
``max_requests_per_file`` requests is closed and continues in a new file
(parts ``-p0000``, ``-p0001``, ...); a trace idle for ``idle_close_s`` is closed and
forgotten. Recording stops (counted) once the directory holds
``max_bytes`` of trace files.

>>> import tempfile, pathlib
>>> d = tempfile.mkdtemp()
>>> rec = RequestRecorder(d, block_size=32, model="m")
>>> rec.arrived("r1", None, None, 70, [11, 12], now=100.0)
>>> rec.finished("r1", 5, tool_wait=False, now=101.5)
>>> rec.close()
>>> from kvtier.replay import load_trace
>>> w = load_trace(d)
>>> r = w.sessions[0].root.requests[0]
>>> (w.block_size, r.input_tokens, r.output_tokens, len(r.block_ids))
(32, 70, 5, 2)
"""

from __future__ import annotations

import json
import logging
import os
import queue
import secrets
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from hashlib import blake2b
from pathlib import Path
from typing import Any, Sequence

from .traces import STOP_END_TURN, STOP_TOOL_USE, safe_name, write_atomic

log = logging.getLogger(__name__)

SALT_FILE = ".kvtier-record-salt"
UNTAGGED = "untagged"
_ID_BITS = 52  # hash ids stay exact in JSON readers that use doubles


@dataclass(slots=True)
class _Trace:
    """One trace being recorded: its requests so far and where they go."""

    trace_id: str
    path: Path
    first_arrival: float
    requests: list[dict[str, Any]] = field(default_factory=list)
    last_end: float | None = None  # finish of the latest request, for the next think_time
    last_seen: float = 0.0
    dirty: bool = False
    part: int = 0
    last_keys: list[int] = field(default_factory=list)  # the latest request's block keys and their ids:
    last_ids: list[int] = field(default_factory=list)  # the next turn repeats most of them
    written: int = 0  # leading requests already serialized into ``chunks``
    chunks: list[str] = field(default_factory=list)  # JSON of each finished request, in order


class RequestRecorder:
    """Records requests into AgentX trace files under ``path`` (see the module doc)."""

    def __init__(self, path: str | os.PathLike[str], block_size: int, model: str = "", *, flush_s: float = 10.0,
                 max_requests_per_file: int = 1000, idle_close_s: float = 3600.0, max_bytes: int = 1 << 30,
                 max_queue: int = 100_000, max_open_traces: int = 10_000) -> None:
        self.path = Path(path).expanduser()
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"record_path={str(path)!r}: cannot create the recording directory: {exc}") from exc
        if not os.access(self.path, os.W_OK):
            raise ValueError(f"record_path={str(path)!r}: the recording directory is not writable")
        self.block_size = block_size
        self.model = model
        self.flush_s = flush_s
        self.max_requests_per_file = max_requests_per_file
        self.idle_close_s = idle_close_s
        self.max_bytes = max_bytes
        self.max_open_traces = max_open_traces
        self.counters: Counter[str] = Counter()
        self._salt = _load_salt(self.path)
        self._run = f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{secrets.token_hex(3)}"
        self._queue: queue.Queue[tuple[Any, ...]] = queue.Queue(max_queue)
        self._pending: dict[str, tuple[str, dict[str, Any]]] = {}  # writer thread only: req id -> (trace, request)
        self._traces: dict[str, _Trace] = {}  # writer thread only
        self._bytes = sum(f.stat().st_size for f in self.path.glob("*.json") if f.is_file())
        self._stopped = self._bytes >= max_bytes
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kvtier-record", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ engine side (cheap)

    def arrived(self, req_id: str, session_id: str | None, agent_id: str | None, prompt_tokens: int,
                block_keys: Sequence[int], now: float | None = None) -> None:
        """A request arrived: ``block_keys`` are the keys of its prompt's full blocks
        (a list is kept as given: the caller must not change it afterwards)."""
        full = int(prompt_tokens) // self.block_size  # engines key full blocks only
        self._put(("arrived", req_id, session_id, agent_id, int(prompt_tokens), list(block_keys[:full])
                   if not isinstance(block_keys, list) or len(block_keys) > full else block_keys,
                   time.time() if now is None else now))

    def finished(self, req_id: str, output_tokens: int, tool_wait: bool, now: float | None = None,
                 answer_keys: Sequence[int] | None = None) -> None:
        """A request finished with ``output_tokens``; ``tool_wait``: it announced a tool call;
        ``answer_keys``: the keys of the full blocks its answer filled after the prompt's full blocks that the
        engine computed and cached (the next turn hits them only if its prompt holds the answer as generated);
        ``None``: not known, and the file leaves ``out_hash_ids`` out."""
        self._put(("finished", req_id, int(output_tokens), bool(tool_wait), time.time() if now is None else now,
                   None if answer_keys is None else list(answer_keys)))

    def close(self) -> None:
        """Write every trace and stop the writer (idempotent)."""
        if not self._closed.is_set():
            self._closed.set()
            self._thread.join()

    def _put(self, item: tuple[Any, ...]) -> None:
        if self._closed.is_set():
            return
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self.counters["record_dropped"] += 1

    # ------------------------------------------------------------ writer thread

    def _loop(self) -> None:
        next_flush = time.monotonic() + self.flush_s
        while True:
            closing = self._closed.is_set()
            try:
                item = self._queue.get(timeout=min(0.2, max(0.0, next_flush - time.monotonic())))
            except queue.Empty:
                item = None
            if item is not None:
                try:
                    self._apply(item)
                except Exception:  # a bad event must not stop the recording of the rest
                    log.exception("kvtier: recording failed for one request")
                    self.counters["record_errors"] += 1
                continue
            if closing or time.monotonic() >= next_flush:
                self._flush(final=closing)
                next_flush = time.monotonic() + self.flush_s
                if closing:
                    return

    def _apply(self, item: tuple[Any, ...]) -> None:
        if item[0] == "arrived":
            _, req_id, session_id, agent_id, prompt_tokens, keys, now = item
            trace = self._trace(session_id, agent_id, now)
            think = None if trace.last_end is None else max(0.0, now - trace.last_end)
            request = {"t": round(now - trace.first_arrival, 6), "type": "n", "model": self.model,
                       "in": prompt_tokens, "out": 0, "hash_ids": self._ids(trace, keys),
                       "stop": "", "api_time": None, "think_time": None if think is None else round(think, 6),
                       "_arrival": now}
            trace.requests.append(request)
            trace.last_seen = now
            self._pending[req_id] = (trace.trace_id, request)
            self.counters["recorded_requests"] += 1
            return
        _, req_id, output_tokens, tool_wait, now, answer_keys = item
        pending = self._pending.pop(req_id, None)
        if pending is None:
            return
        trace_id, request = pending
        request["out"] = output_tokens
        if answer_keys is not None:
            request["out_hash_ids"] = [self._anon(k) for k in answer_keys]
        request["stop"] = STOP_TOOL_USE if tool_wait else STOP_END_TURN
        request["api_time"] = round(max(0.0, now - request["_arrival"]), 6)
        trace = self._traces.get(trace_id)
        if trace is not None:
            trace.last_end = now
            trace.last_seen = now
            trace.dirty = True

    def _trace(self, session_id: str | None, agent_id: str | None, now: float) -> _Trace:
        trace_id = UNTAGGED if session_id is None else f"{session_id}:{agent_id or 'main'}"
        trace = self._traces.get(trace_id)
        if (trace is not None and len(trace.requests) >= self.max_requests_per_file
                and all(r["api_time"] is not None for r in trace.requests[trace.written:])):  # none in flight
            self._write(trace)
            del self._traces[trace_id]
            trace = _Trace(trace_id, self._file(trace_id, trace.part + 1), now, last_end=trace.last_end,
                           part=trace.part + 1)
            self._traces[trace_id] = trace
        elif trace is None:
            if len(self._traces) >= self.max_open_traces:
                oldest = min(self._traces.values(), key=lambda t: t.last_seen)
                self._write(oldest)
                del self._traces[oldest.trace_id]
            trace = self._traces[trace_id] = _Trace(trace_id, self._file(trace_id, 0), now)
        return trace

    def _file(self, trace_id: str, part: int) -> Path:
        safe = safe_name(trace_id, 80)
        digest = blake2b(trace_id.encode(), digest_size=4).hexdigest()
        return self.path / f"trace-{self._run}-{safe}-{digest}-p{part:04d}.json"

    def _ids(self, trace: _Trace, keys: list[int]) -> list[int]:
        """Anonymous ids of ``keys``, reusing those of the trace's previous request for
        the prefix they share. Keys are chained (a key fixes every key before it), so
        the shared prefix is found by a binary search on single keys."""
        last = trace.last_keys
        lo, hi = 0, min(len(keys), len(last))  # keys[:lo] == last[:lo]; find the largest such lo
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if keys[mid - 1] == last[mid - 1]:
                lo = mid
            else:
                hi = mid - 1
        ids = trace.last_ids[:lo] + [self._anon(k) for k in keys[lo:]]
        trace.last_keys, trace.last_ids = keys, ids
        return ids

    def _anon(self, key: int) -> int:
        digest = blake2b(int(key).to_bytes(16, "big"), key=self._salt, digest_size=8).digest()
        return int.from_bytes(digest, "big") >> (64 - _ID_BITS)

    def _flush(self, final: bool) -> None:
        now = time.time()
        for trace_id, trace in list(self._traces.items()):
            if trace.dirty or final:
                self._write(trace, final)
            if final or now - trace.last_seen > self.idle_close_s:
                del self._traces[trace_id]

    def _write(self, trace: _Trace, final: bool = False) -> None:
        """Rewrite ``trace``'s file (finished requests only) through a rename;
        ``final``: requests still in flight are dropped (the engine stops)."""
        trace.dirty = False
        if final:
            trace.requests[trace.written:] = [r for r in trace.requests[trace.written:] if r["api_time"] is not None]
        # requests are serialized once, in order, as soon as they and every one before them finished
        while trace.written < len(trace.requests) and trace.requests[trace.written]["api_time"] is not None:
            r = trace.requests[trace.written]
            trace.chunks.append(json.dumps({k: v for k, v in r.items() if k != "_arrival"}, separators=(",", ":")))
            trace.requests[trace.written] = {"api_time": r["api_time"]}  # the ids now live in the chunk only
            trace.written += 1
        if not trace.chunks or self._stopped:
            if self._stopped and trace.chunks:
                self.counters["record_skipped_full"] += 1
            return
        head = {"id": trace.trace_id, "models": [self.model], "block_size": self.block_size,
                "hash_id_scope": "global", "tool_tokens": 0, "system_tokens": 0,
                "start_unix_s": round(trace.first_arrival, 6),
                "kvtier_recording": {"run": self._run, "part": trace.part}}
        data = (json.dumps(head, separators=(",", ":"))[:-1] + ',"requests":[' + ",".join(trace.chunks)
                + "]}").encode()
        old = trace.path.stat().st_size if trace.path.exists() else 0
        if self._bytes - old + len(data) > self.max_bytes:
            self._stopped = True
            self.counters["record_skipped_full"] += 1
            log.warning("kvtier: recording stopped: %s holds record_max_mib of traces", self.path)
            return
        try:
            write_atomic(trace.path, data)
        except OSError as exc:
            self.counters["record_errors"] += 1
            log.warning("kvtier: recording could not write %s: %s", trace.path, exc)
            return
        self._bytes += len(data) - old
        self.counters["record_files_written"] += 1


def _load_salt(path: Path) -> bytes:
    """The recording's digest key: read from ``path``, or made once (mode 0600)."""
    salt_path = path / SALT_FILE
    try:
        salt = salt_path.read_bytes()
        if len(salt) == 32:
            return salt
    except FileNotFoundError:
        pass
    salt = secrets.token_bytes(32)
    tmp = salt_path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(salt)
    os.replace(tmp, salt_path)
    return salt
