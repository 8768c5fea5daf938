"""HintRecorder: live hint traffic → AgentX / Weka JSON traces + a hints side file.

Owns: turning the events the hints server *applied* into one AgentX / Weka
trace per session (``DIR/traces/<tenant>/<n>_<session>.json``, the schema of
``../shared/traces/README.md`` that :func:`kvtier.replay.readers.load_trace`
reads) and appending every applied event to ``DIR/hints.jsonl`` (one JSON
object per line: tenant, kind, event id, client and server time, the event's
fields with block keys as hex). Replay it with ``load_trace(DIR / "traces")``.

Must not import grpc, block the event loop for long (it only appends to
buffered files; a trace is written when its session ends, expires or the
recorder closes) or hold unbounded memory: open sessions are bounded by the
graph's session limits and each keeps at most ``max_requests_per_session``
requests (the rest are counted in ``num_requests_dropped``).

Mapping (times are the client's timestamps, so batching delays do not skew
them): a request is ``RequestStart`` → ``RequestEnd`` of one agent:
``t`` = start relative to the agent's base (the session start for the main
agent, the spawn for a sub-agent), ``in`` = ``max(num_prompt_tokens,
len(hash_ids) * block_size)``, ``out``, ``stop`` (``tool_use`` /
``end_turn`` / ``max_tokens`` / ``error`` / ``""``), ``api_time`` and
``think_time`` (since the agent's previous request ended, or its spawn).
Block keys become dense per-session ``hash_ids`` in first-seen order
(``hash_id_scope: local``). A sub-agent becomes a ``subagent`` entry placed
at its spawn among its parent's requests, with ``t`` = its end, ``duration_ms``
and ``status``; a sub-agent still running when the parent's next request
starts is recorded with status ``async`` (nobody joined it); its entry
lists the ``models`` its requests used and an integral ``duration_ms``. Every
request names its ``model`` (the session's when the request gave none). The
trace holds only fields aiperf's ``WekaTrace`` model allows, so aiperf can
replay a recording: tenant and recorder go into ``totals`` (a free-form
summary there) beside the token sums the public traces keep. The first root
agent is the trace's main agent; further root agents become async sub-agents
of it. A session whose main agent made no request is not written
(``num_sessions_empty``).
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from .traces import STOP_END_TURN, STOP_TOOL_USE, safe_name, totals, write_atomic

KEY_BYTES = 16
_STOP = {0: "", 1: STOP_END_TURN, 2: STOP_TOOL_USE, 3: "max_tokens", 4: "error"}
_AGENT_STATUS = {0: "completed", 1: "completed", 2: "failed", 3: "cancelled"}


@dataclass(slots=True)
class _Req:
    start_us: int
    keys: bytes
    num_prompt_tokens: int
    model: str
    end_us: int = 0
    out: int = 0
    stop: str = ""


@dataclass(slots=True)
class _AgentDraft:
    agent_id: str
    parent_id: str | None
    agent_type: str
    spawn_us: int
    end_us: int | None = None
    status: str = "completed"
    open: dict[str, _Req] = field(default_factory=dict)
    done: list[_Req] = field(default_factory=list)


@dataclass(slots=True)
class _SessionDraft:
    tenant: str
    session_id: str
    start_us: int
    model: str
    agents: dict[str, _AgentDraft] = field(default_factory=dict)
    num_requests: int = 0


class HintRecorder:
    """Records applied hint events under ``directory`` (created if missing).

    ``block_size``: tokens per block of the keys the clients send (the
    engine's block size). Thread-safe (one lock), though the server calls it
    from its event loop only.
    """

    def __init__(self, directory: str | Path, *, block_size: int, model: str = "",
                 max_requests_per_session: int = 100_000) -> None:
        if block_size <= 0:
            raise ValueError(f"HintRecorder block_size={block_size!r}: must be > 0")
        self.directory = Path(directory)
        self.traces_dir = self.directory / "traces"
        self.traces_dir.mkdir(parents=True, exist_ok=True)
        self.block_size = block_size
        self.model = model
        self.max_requests_per_session = max_requests_per_session
        self._hints: IO[str] | None = open(self.directory / "hints.jsonl", "a", encoding="utf-8")
        self._open: dict[tuple[str, str], _SessionDraft] = {}
        self._lock = threading.Lock()
        self.num_traces_written = 0
        self.num_sessions_empty = 0
        self.num_requests_dropped = 0
        self.written: list[Path] = []

    # --------------------------------------------------------------- events

    def on_event(self, tenant: str, kind: str, event: Any, now_s: float) -> None:
        """One applied ``Signal`` / ``Command`` (``kind`` names its oneof field)."""
        body = getattr(event, kind)
        ts = event.client_time_unix_us
        with self._lock:
            self._write_hint(tenant, kind, event, body, ts, now_s)
            if kind == "session_start":
                self._open[(tenant, body.session_id)] = _SessionDraft(tenant, body.session_id, ts,
                                                                      body.model or self.model)
                return
            handler = getattr(self, f"_on_{kind}", None)
            draft = None if handler is None else self._open.get((tenant, body.session_id))
            if draft is not None:
                handler(draft, body, ts)  # type: ignore[misc]

    def on_session_gone(self, tenant: str, session_id: str) -> Path | None:
        """The session expired (or was dropped): write what was recorded of it."""
        with self._lock:
            draft = self._open.pop((tenant, session_id), None)
            return None if draft is None else self._write_trace(draft)

    def close(self) -> None:
        """Write every open session (requests still in flight are left out) and close the files."""
        with self._lock:
            for key in list(self._open):
                self._write_trace(self._open.pop(key))
            if self._hints is not None:
                self._hints.close()
                self._hints = None

    def flush(self) -> None:
        with self._lock:
            if self._hints is not None:
                self._hints.flush()

    # --------------------------------------------------------------- hints file

    def _write_hint(self, tenant: str, kind: str, event: Any, body: Any, ts: int, now_s: float) -> None:
        if self._hints is None:
            return
        fields: dict[str, Any] = {}
        for desc, value in body.ListFields():
            if desc.type == desc.TYPE_BYTES:
                value = [value[i : i + KEY_BYTES].hex() for i in range(0, len(value), KEY_BYTES)]
            elif desc.is_repeated:
                value = list(value)
            elif desc.type == desc.TYPE_ENUM:
                names = desc.enum_type.values_by_number
                value = names[value].name if value in names else value
            fields[desc.name] = value
        line = {"tenant": tenant, "kind": kind, "event_id": event.event_id, "client_time_unix_us": ts,
                "server_time_s": round(now_s, 6), "fields": fields}
        self._hints.write(json.dumps(line, separators=(",", ":")) + "\n")

    # --------------------------------------------------------------- drafts

    def _on_session_end(self, draft: _SessionDraft, body: Any, ts: int) -> None:
        self._open.pop((draft.tenant, draft.session_id), None)
        self._write_trace(draft)

    def _on_agent_spawn(self, draft: _SessionDraft, body: Any, ts: int) -> None:
        draft.agents[body.agent_id] = _AgentDraft(body.agent_id, body.parent_agent_id or None, body.agent_type, ts)

    def _on_agent_end(self, draft: _SessionDraft, body: Any, ts: int) -> None:
        agent = draft.agents.get(body.agent_id)
        if agent is not None:
            agent.end_us, agent.status = ts, _AGENT_STATUS.get(body.status, "completed")

    def _on_request_start(self, draft: _SessionDraft, body: Any, ts: int) -> None:
        agent = draft.agents.get(body.agent_id)
        if agent is None:
            return
        if draft.num_requests >= self.max_requests_per_session:
            self.num_requests_dropped += 1
            return
        draft.num_requests += 1
        agent.open[body.request_id] = _Req(ts, body.prompt_block_keys, body.num_prompt_tokens, body.model)

    def _on_request_end(self, draft: _SessionDraft, body: Any, ts: int) -> None:
        agent = draft.agents.get(body.agent_id)
        req = None if agent is None else agent.open.pop(body.request_id, None)
        if req is not None:
            req.end_us, req.out, req.stop = max(ts, req.start_us), body.num_output_tokens, _STOP.get(body.stop, "")
            agent.done.append(req)  # type: ignore[union-attr]

    # --------------------------------------------------------------- trace JSON

    def _write_trace(self, draft: _SessionDraft) -> Path | None:
        roots = sorted((a for a in draft.agents.values() if a.parent_id is None), key=lambda a: a.spawn_us)
        if not roots or not roots[0].done:
            self.num_sessions_empty += 1
            return None
        main = roots[0]
        children: dict[str | None, list[_AgentDraft]] = {}
        for a in draft.agents.values():
            parent = main.agent_id if (a.parent_id is None and a is not main) else a.parent_id
            if a is not main:
                children.setdefault(parent, []).append(a)
        ids: dict[bytes, int] = {}
        models: set[str] = set()
        background = {a.agent_id for a in roots[1:]}
        entries = self._entries(main, draft.start_us, children, ids, models, background, draft.model)
        trace = {
            "id": draft.session_id,
            "models": sorted(models | ({draft.model} if draft.model else set())),
            "block_size": self.block_size,
            "hash_id_scope": "local",
            "requests": entries,
            "totals": {**totals(entries), "tenant": draft.tenant, "recorded_by": "kvtier hints recorder"},
        }
        folder = self.traces_dir / safe_name(draft.tenant, 64)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{self.num_traces_written:06d}_{safe_name(draft.session_id, 64)}.json"
        # no fsync: this runs on the hint server's event loop (a burst of expiring sessions would stall it)
        write_atomic(path, json.dumps(trace, separators=(",", ":")).encode(), sync=False)
        self.num_traces_written += 1
        self.written.append(path)
        return path

    def _entries(self, agent: _AgentDraft, base_us: int, children: dict[str | None, list[_AgentDraft]],
                 ids: dict[bytes, int], models: set[str], forced_async: set[str],
                 default_model: str) -> list[dict[str, Any]]:
        reqs = sorted(agent.done, key=lambda r: r.start_us)
        kids = sorted(children.get(agent.agent_id, []), key=lambda a: a.spawn_us)
        timeline: list[tuple[int, int, Any]] = [(r.start_us, 0, r) for r in reqs] + [(k.spawn_us, 1, k) for k in kids]
        timeline.sort(key=lambda x: (x[0], x[1]))
        out: list[dict[str, Any]] = []
        prev_end_us = agent.spawn_us if agent.parent_id is not None else base_us
        for at_us, what, item in timeline:
            if what == 0:
                out.append(self._request(item, base_us, prev_end_us, ids, models, default_model))
                prev_end_us = item.end_us
                continue
            child: _AgentDraft = item
            end_us = child.end_us or max((r.end_us for r in child.done), default=child.spawn_us)
            next_parent = next((r.start_us for r in reqs if r.start_us >= child.spawn_us), None)
            status = child.status
            if child.agent_id in forced_async or (next_parent is not None and end_us > next_parent):
                status = "async"
            child_models: set[str] = set()
            nested = self._entries(child, child.spawn_us, children, ids, child_models, forced_async, default_model)
            models |= child_models
            out.append({
                "type": "subagent",
                "t": max(0.0, (end_us - base_us) / 1e6),
                "agent_id": child.agent_id,
                "subagent_type": child.agent_type,
                "duration_ms": max(0, round((end_us - child.spawn_us) / 1e3)),
                "status": status,
                "requests": nested,
                "models": sorted(child_models),
            })
        return out

    def _request(self, r: _Req, base_us: int, prev_end_us: int, ids: dict[bytes, int],
                 models: set[str], default_model: str) -> dict[str, Any]:
        hash_ids = []
        for i in range(0, len(r.keys), KEY_BYTES):
            key = r.keys[i : i + KEY_BYTES]
            hid = ids.get(key)
            if hid is None:
                hid = ids[key] = len(ids)
            hash_ids.append(hid)
        model = r.model or default_model
        if model:
            models.add(model)
        entry: dict[str, Any] = {
            "t": max(0.0, (r.start_us - base_us) / 1e6),
            "type": "n",
            "model": model,
            "in": max(r.num_prompt_tokens, len(hash_ids) * self.block_size),
            "out": r.out,
            "hash_ids": hash_ids,
            "stop": r.stop,
            "api_time": (r.end_us - r.start_us) / 1e6,
            "think_time": max(0.0, (r.start_us - prev_end_us) / 1e6),
        }
        return entry

