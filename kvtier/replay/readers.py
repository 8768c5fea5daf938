"""Trace readers: AgentX / Weka JSON and Mooncake JSONL into a :class:`Workload`.

Owns: finding trace files (a file, a directory, a tarball), parsing and
validating them, and turning them into the model of :mod:`kvtier.replay.model`.
Bad input raises :class:`TraceError` naming the file (``tarball:member`` for
archive members), the JSON path of the offending request and what is wrong;
with ``skip_bad=True`` the trace is skipped and counted in a :class:`LoadReport`.

AgentX / Weka (one JSON object per trace, closed loop):

* ``n`` / ``s`` entries are requests of the agent whose list holds them; a
  ``subagent`` entry is a child agent whose nested ``requests`` are read the
  same way (recursively). The first parent request after a run of sub-agent
  entries waits for them (``depends_on``), except background agents whose
  ``status`` starts with ``async``, which nobody waits for.
* Timing, as measured on the public traces: a request's ``think_time`` is the
  time the client waited *before sending it*, counted from the end of the
  previous request of the same agent (``t[i] - t[i-1] - api_time[i-1]``
  matches ``think_time[i]`` to p50 0.3 s, and ``think_time[i-1]`` only to
  p50 7 s), so it becomes ``gap_s`` of the request itself; when missing, the
  same difference of ``t`` is used. ``gap_cause`` is ``tool`` when the
  previous request stopped with ``tool_use``, else ``user``.
* A ``subagent`` entry's ``t`` is when it *returned* (``t - duration_ms``
  lands 0.1-1 s after the spawning request ended); an entry without
  ``duration_ms`` or whose ``t - duration`` falls before the spawning request
  is taken as starting at ``t``. Nested request ``t`` values are relative to
  the sub-agent's start (the documented form) or absolute: they are taken as
  absolute when the start is over 1 s and the first nested ``t`` is not below
  it. A join request's ``gap_s`` counts from the last joined sub-agent's
  return.
* ``hash_id_scope`` ``"local"`` (the default, and the only scope aiperf
  accepts): ids are private to the trace and its sub-agents; ``"global"``
  (a kvtier extension that older generator output used): ids are shared by
  every global-scope trace of the same load. Either way ids are remapped to
  dense ints in first-seen order, traces in sorted name order, so a load is
  deterministic.
* Shared prefix across traces (``shared_prefix="declared"``; the default
  ``"none"`` shares nothing, as the ``local`` scope says and as aiperf
  replays it: aiperf derives each trace's token content from (trace,
  hash id), so no two trace files share KV there). A trace declares the
  size of its tools and system prompt in ``tool_tokens`` /
  ``system_tokens`` (a sub-agent entry its own); those lead the prompt of the
  agent's first request. With ``"declared"``, those leading full blocks are
  keyed across traces by agent kind and declared sizes (see
  ``_WekaTrace._share_prefix``), so sessions that declare the same tools and
  system prompt share their KV. The generator's sessions declare one
  prefix, which is how its synthetic workload models the system prompt every
  session of a deployment sends.

Mooncake (JSONL, open loop): each line is a one-request session sent at
``timestamp`` ms; ``hash_ids`` are 512-token blocks shared by every line of
the file. A bad line is one trace: ``skip_bad`` skips the line.

``block_ids`` hold full blocks only (see :mod:`kvtier.replay.model`): the
Weka traces list ``in // 64`` ids, Mooncake lists ``ceil(in / 512)`` and the
id of the trailing partial block is dropped. More ids than
``ceil(in / block_size)`` is an error.
"""

from __future__ import annotations

import json
import math
import re
import tarfile
import time
import lzma
import zlib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

from ..errors import ConfigError, KVTierError
from .model import ROOT_AGENT_ID, Agent, BlockId, Request, Session, Workload, reblock

MOONCAKE_BLOCK_SIZE = 512
DEFAULT_WEKA_BLOCK_SIZE = 64
_TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.xz", ".txz", ".tar.bz2", ".tbz2")
_TRACE_SUFFIXES = (".json", ".jsonl")
_REQUEST_TYPES = ("n", "s", "subagent")
_SCOPES = ("local", "global")
SHARED_PREFIX_MODES = ("none", "declared")
_TIME_TOL_S = 1.0
_RECENT = 4  # previous requests of an agent whose ids a new request may extend


class TraceError(KVTierError, ValueError):
    """A trace cannot be read. ``source`` is the file (``tarball:member``),
    ``location`` the JSON path (``requests[12].requests[3].in``) or line,
    ``kind`` one of ``malformed``, ``missing``, ``type``, ``value``,
    ``format``, ``archive``."""

    def __init__(self, source: str, location: str, problem: str, kind: str = "value") -> None:
        self.source = source
        self.location = location
        self.problem = problem
        self.kind = kind
        where = f"{source}: {location}" if location else source
        super().__init__(f"{where}: {problem}")


@dataclass(frozen=True, slots=True)
class SkippedTrace:
    """A trace (a file, a tar member or a Mooncake line) left out by ``skip_bad``."""

    source: str
    kind: str
    message: str


@dataclass(frozen=True, slots=True)
class LoadReport:
    """What a load read: ``num_loaded`` traces (a Mooncake line counts as one),
    the skipped ones with their reasons, and the wall time in seconds."""

    path: str
    num_loaded: int
    skipped: tuple[SkippedTrace, ...]
    load_s: float

    @property
    def num_skipped(self) -> int:
        return len(self.skipped)

    def describe_skipped(self, limit: int = 5) -> str:
        """The skipped traces as ``source: message`` lines (the first ``limit``, then a count)."""
        lines = [f"  {t.message}" if t.message.startswith(t.source) else f"  {t.source}: {t.message}"
                 for t in self.skipped[:limit]]
        if len(self.skipped) > limit:
            lines.append(f"  ... and {len(self.skipped) - limit} more")
        return "\n".join(lines)

    def skipped_by_kind(self) -> dict[str, int]:
        """Number of skipped traces per ``TraceError.kind``."""
        out: dict[str, int] = {}
        for s in self.skipped:
            out[s.kind] = out.get(s.kind, 0) + 1
        return out


def load_trace(
    path: str | Path, *, skip_bad: bool = False, block_size: int | None = None, shared_prefix: str = "none"
) -> Workload:
    """Load a trace file, a directory of trace files or a tarball of them.

    ``path``: an AgentX / Weka ``.json`` (one trace), a Mooncake ``.jsonl``,
    a directory (every ``.json`` / ``.jsonl`` below it) or a ``.tar``,
    ``.tar.gz`` / ``.tgz``, ``.tar.xz`` / ``.txz``, ``.tar.bz2`` of them.
    Files are read in sorted name order; a tarball is decompressed once, as a
    stream. ``block_size``: re-block every trace to it (default: the block
    size of the first trace). ``skip_bad``: skip and count bad traces instead
    of raising :class:`TraceError`. ``shared_prefix``: ``"none"`` (ids of a
    ``local`` trace are its own, as the format and aiperf read them) or
    ``"declared"`` (the tools + system prefix each agent declares is shared
    across traces; see the module docstring). Raises ``FileNotFoundError``
    for a missing path. See :func:`load_trace_with_report` for the counts.
    """
    return load_trace_with_report(path, skip_bad=skip_bad, block_size=block_size, shared_prefix=shared_prefix)[0]


def load_trace_with_report(
    path: str | Path, *, skip_bad: bool = False, block_size: int | None = None, shared_prefix: str = "none"
) -> tuple[Workload, LoadReport]:
    """:func:`load_trace` plus the :class:`LoadReport` of what was skipped and how long it took."""
    started = time.perf_counter()
    path = Path(path)
    if not path.exists():
        from .tracefetch import missing_hint

        raise FileNotFoundError(f"trace path {str(path)!r} does not exist{missing_hint(path)}")
    loader = _Loader(skip_bad=skip_bad, block_size=block_size, shared_prefix=shared_prefix)
    loader.load_blobs(_iter_blobs(path, loader))
    return loader.finish(_workload_name(path), str(path), started)


def load_trace_objects(
    traces: Sequence[Mapping[str, Any]],
    *,
    name: str = "traces",
    skip_bad: bool = False,
    block_size: int | None = None,
    shared_prefix: str = "none",
) -> Workload:
    """Load already-parsed AgentX / Weka trace objects (the generator's output).

    The same validation and conversion as :func:`load_trace`; trace ``i`` is
    reported as ``name[i]``.
    """
    started = time.perf_counter()
    loader = _Loader(skip_bad=skip_bad, block_size=block_size, shared_prefix=shared_prefix)
    for i, obj in enumerate(traces):
        loader.load_weka_object(f"{name}[{i}]", obj, [])
    return loader.finish(name, name, started)[0]


def _workload_name(path: Path) -> str:
    name = path.name
    for suffix in _TAR_SUFFIXES + _TRACE_SUFFIXES:
        if name.endswith(suffix) and len(name) > len(suffix):
            return name[: -len(suffix)]
    return name


# ---------------------------------------------------------------------------
# Finding trace files


def _is_tarball(path: Path) -> bool:
    return path.name.endswith(_TAR_SUFFIXES)


def _wanted_member(name: str) -> bool:
    base = name.rsplit("/", 1)[-1]
    return base.endswith(_TRACE_SUFFIXES) and not base.startswith(".")


def _iter_blobs(path: Path, loader: _Loader) -> Iterator[tuple[str, bytes]]:
    """``(source name, bytes)`` of every trace file under ``path``, sorted by name."""
    if path.is_dir():  # trace files and tarballs of them, anywhere below
        files = sorted(
            (p for p in path.rglob("*") if p.is_file() and (_wanted_member(p.name) or _is_tarball(p))),
            key=lambda p: p.relative_to(path).as_posix(),
        )
        if not files:
            raise TraceError(str(path), "", "no .json, .jsonl or tarball trace files in this directory",
                             kind="format")
        for p in files:
            if _is_tarball(p):
                yield from _iter_tar(p, loader)
            else:
                yield str(p), p.read_bytes()
    elif _is_tarball(path):
        yield from _iter_tar(path, loader)
    else:
        yield str(path), path.read_bytes()


def _iter_tar(path: Path, loader: _Loader) -> Iterator[tuple[str, bytes]]:
    """Stream the archive once (no seeks: xz cannot seek back cheaply), then yield members sorted."""
    members: dict[str, bytes] = {}
    try:
        with tarfile.open(path, mode="r|*") as tar:
            for member in tar:
                name = member.name.removeprefix("./")
                if member.isfile() and _wanted_member(name):
                    handle = tar.extractfile(member)
                    if handle is not None:
                        members[name] = handle.read()
    except (tarfile.TarError, EOFError, OSError, lzma.LZMAError, zlib.error, ValueError) as e:
        # OSError covers gzip.BadGzipFile; ValueError covers bz2 data errors.
        loader.fail(TraceError(str(path), "", f"corrupt or truncated archive: {e}", kind="archive"))
    if not members and not loader.report_skipped:
        raise TraceError(str(path), "", "no .json or .jsonl trace files in this archive", kind="format")
    for name in sorted(members):
        yield f"{path}:{name}", members.pop(name)


# ---------------------------------------------------------------------------
# JSON parsing (fast path for hash_ids)

_HASH_IDS_RE = re.compile(rb'"hash_ids"\s*:\s*\[([^\[\]]*)\]')
_MARK = "\x00#"
_MARK_JSON = b"\\u0000#"
_TOKEN_RE = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}:,]')


def _parse_json_trace(data: bytes, source: str) -> tuple[Any, list[bytes]]:
    """Parse one trace, lifting every ``hash_ids`` array out as raw text.

    Consecutive requests repeat their predecessor's ids plus a few new ones;
    keeping the arrays as text lets :class:`_IdMapper` parse only the new
    tail. Any surprise falls back to a plain parse of the original bytes.
    """
    arrays: list[bytes] = []
    if _MARK_JSON not in data:

        def lift(m: re.Match[bytes]) -> bytes:
            arrays.append(m.group(1))
            return b'"hash_ids":"' + _MARK_JSON + str(len(arrays) - 1).encode() + b'"'

        try:
            return json.loads(_HASH_IDS_RE.sub(lift, data)), arrays
        except (ValueError, RecursionError):
            arrays = []
    try:
        return json.loads(data), arrays
    except json.JSONDecodeError as e:
        text = e.doc if isinstance(e.doc, str) else data.decode("utf-8", "replace")
        where = _json_path_at(text, e.pos)
        raise TraceError(
            source, where, f"malformed JSON ({e.msg} at line {e.lineno} column {e.colno}; truncated file?)", "malformed"
        ) from None
    except (ValueError, RecursionError) as e:
        raise TraceError(source, "", f"malformed JSON ({type(e).__name__}: {e})", "malformed") from None


def _json_path_at(text: str, pos: int) -> str:
    """Best-effort JSON path (``requests[4].hash_ids``) of the value open at ``pos``."""
    stack: list[list[Any]] = []
    last_string: str | None = None
    for m in _TOKEN_RE.finditer(text, 0, pos):
        tok = m.group()
        if tok == "{":
            stack.append(["{", None])
        elif tok == "[":
            stack.append(["[", 0])
        elif tok in "}]":
            if stack:
                stack.pop()
        elif tok == ",":
            if stack and stack[-1][0] == "[":
                stack[-1][1] += 1
            elif stack:
                stack[-1][1] = None
        elif tok == ":":
            if stack and stack[-1][0] == "{":
                stack[-1][1] = last_string
        else:
            try:
                last_string = json.loads(tok)
            except ValueError:
                last_string = tok
    parts: list[str] = []
    for kind, val in stack:
        if kind == "[":
            parts.append(f"[{val}]")
        elif val is not None:
            parts.append(f".{val}")
    return "".join(parts).lstrip(".") or "top level"


# ---------------------------------------------------------------------------
# Field validation


def _fail(source: str, loc: str, problem: str, kind: str) -> TraceError:
    return TraceError(source, loc, problem, kind)


def _describe(value: Any) -> str:
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{text} ({type(value).__name__})"


class _Fields:
    """Typed access to one JSON object, raising :class:`TraceError` at ``loc``."""

    __slots__ = ("source", "obj", "loc")

    def __init__(self, source: str, obj: Any, loc: str) -> None:
        if not isinstance(obj, dict):
            raise _fail(source, loc, f"expected a JSON object, got {_describe(obj)}", "type")
        self.source, self.obj, self.loc = source, obj, loc

    def get(self, key: str, required: bool) -> Any:
        if key in self.obj:
            return self.obj[key]
        if required:
            raise _fail(self.source, self.loc, f"missing field {key!r}", "missing")
        return None

    def _at(self, key: str) -> str:
        return f"{self.loc}.{key}" if self.loc else key

    def count(self, key: str, *, required: bool = True, positive: bool = False) -> int | None:
        v = self.get(key, required)
        if v is None and not required:
            return None
        if type(v) is not int:
            raise _fail(self.source, self._at(key), f"expected an int, got {_describe(v)}", "type")
        if v < 0 or (positive and v == 0):
            need = "a positive" if positive else "a non-negative"
            raise _fail(self.source, self._at(key), f"expected {need} int, got {v}", "value")
        return v

    def seconds(self, key: str, *, required: bool = True) -> float | None:
        """A finite number >= 0; ``None`` when absent (or null) and not required."""
        v = self.get(key, required)
        if v is None:
            if required:
                raise _fail(self.source, self._at(key), "expected a number, got null", "type")
            return None
        if type(v) not in (int, float):
            raise _fail(self.source, self._at(key), f"expected a number, got {_describe(v)}", "type")
        try:
            seconds = float(v)
        except OverflowError:
            seconds = math.inf
        if not math.isfinite(seconds) or seconds < 0:
            raise _fail(self.source, self._at(key), f"expected a finite number >= 0, got {_describe(v)}", "value")
        return seconds

    def text(self, key: str, *, required: bool = False, default: str = "") -> str:
        v = self.get(key, required)
        if v is None and not required:
            return default
        if not isinstance(v, str):
            raise _fail(self.source, self._at(key), f"expected a string, got {_describe(v)}", "type")
        return v

    def array(self, key: str) -> list[Any]:
        v = self.get(key, True)
        if not isinstance(v, list):
            raise _fail(self.source, self._at(key), f"expected an array, got {_describe(v)}", "type")
        return v


# ---------------------------------------------------------------------------
# Block ids


class _IdMapper:
    """Maps one agent's trace ids to dense global ids, reusing shared prefixes.

    A request whose ids extend one of the agent's last few requests reuses
    that request's mapped tuple and maps only the tail, so the common prefix
    costs one C-level compare instead of a Python loop.
    """

    __slots__ = ("namespace", "counter", "arrays", "recent")

    def __init__(self, namespace: dict[int, BlockId], counter: list[int], arrays: list[bytes]) -> None:
        self.namespace, self.counter, self.arrays = namespace, counter, arrays
        self.recent: list[tuple[bytes | None, list[Any] | None, tuple[BlockId, ...]]] = []

    def map(self, value: Any, source: str, loc: str) -> tuple[BlockId, ...]:
        if isinstance(value, str) and value.startswith(_MARK) and self.arrays:
            text = self._array_text(value, source, loc)
            mapped = self._map_text(text, source, loc)
            self._remember((text, None, mapped))
        elif isinstance(value, list):
            mapped = self._map_list(value, source, loc)
            self._remember((None, value, mapped))
        else:
            raise _fail(source, loc, f"expected an array of ints, got {_describe(value)}", "type")
        return mapped

    def _remember(self, entry: tuple[bytes | None, list[Any] | None, tuple[BlockId, ...]]) -> None:
        self.recent.append(entry)
        if len(self.recent) > _RECENT:
            del self.recent[0]

    def _array_text(self, value: str, source: str, loc: str) -> bytes:
        try:
            return self.arrays[int(value[len(_MARK) :])]
        except (ValueError, IndexError):
            raise _fail(source, loc, f"expected an array of ints, got {_describe(value)}", "type") from None

    def _map_text(self, text: bytes, source: str, loc: str) -> tuple[BlockId, ...]:
        base: tuple[BlockId, ...] = ()
        tail: bytes | None = text  # None: ``text`` is exactly a known array
        for prev_text, _, prev_mapped in self.recent:
            if prev_text is None or len(prev_mapped) <= len(base) or not text.startswith(prev_text):
                continue
            rest = text[len(prev_text) :].lstrip()
            if not rest:
                base, tail = prev_mapped, None
            elif rest[:1] == b",":
                base, tail = prev_mapped, rest[1:]
        if tail is None:
            return base
        if base and not tail.strip():
            raise _fail(source, loc, "malformed hash_ids array (trailing comma)", "malformed")
        try:
            raw = json.loads(b"[" + tail + b"]")
        except (ValueError, RecursionError) as e:
            raise _fail(source, loc, f"malformed hash_ids array ({e})", "malformed") from None
        return base + self._map_new(raw, source, loc, len(base))

    def _map_list(self, value: list[Any], source: str, loc: str) -> tuple[BlockId, ...]:
        for _, prev_raw, prev_mapped in reversed(self.recent):
            n = len(prev_mapped)
            if prev_raw is not None and 0 < n <= len(value) and value[:n] == prev_raw:
                return prev_mapped + self._map_new(value[n:], source, loc, n)
        return self._map_new(value, source, loc, 0)

    def _map_new(self, raw: list[Any], source: str, loc: str, offset: int) -> tuple[BlockId, ...]:
        ns, counter = self.namespace, self.counter
        out: list[BlockId] = []
        for i, h in enumerate(raw):
            g = ns.get(h) if type(h) is int else None
            if g is None:
                if type(h) is not int:
                    raise _fail(source, f"{loc}[{offset + i}]", f"expected an int block id, got {_describe(h)}", "type")
                g = ns[h] = BlockId(counter[0])
                counter[0] += 1
            out.append(g)
        return tuple(out)


def _full_blocks(
    ids: tuple[BlockId, ...], input_tokens: int, block_size: int, source: str, loc: str
) -> tuple[tuple[BlockId, ...], BlockId | None]:
    """The ids of full blocks and the id listed for a trailing partial block (or ``None``); reject too many ids."""
    full = input_tokens // block_size
    if len(ids) <= full:
        return ids, None
    if len(ids) > -(-input_tokens // block_size):
        raise _fail(
            source,
            f"{loc}.hash_ids",
            f"{len(ids)} block ids but {input_tokens} input tokens fill at most "
            f"{-(-input_tokens // block_size)} blocks of {block_size}",
            "value",
        )
    return ids[:full], ids[full]


def _leading_raw_ids(value: Any, arrays: list[bytes], count: int) -> list[Any]:
    """The first ``count`` raw entries of a ``hash_ids`` value (a list or a lifted array), for prefix keying.

    Malformed input yields what could be read; the mapper reports it later.
    """
    if isinstance(value, list):
        return value[:count]
    if isinstance(value, str) and value.startswith(_MARK) and arrays:
        try:
            text = arrays[int(value[len(_MARK) :])]
            return json.loads(b"[" + b",".join(text.split(b",", count)[:count]) + b"]")
        except (ValueError, IndexError, RecursionError):
            return []
    return []


# ---------------------------------------------------------------------------
# AgentX / Weka conversion


class _AgentDraft:
    __slots__ = ("agent_id", "parent_id", "agent_type", "requests", "spawn_after", "join_before", "status")

    def __init__(self, agent_id: str, parent_id: str | None, agent_type: str, spawn_after: int | None, status: str):
        self.agent_id, self.parent_id, self.agent_type = agent_id, parent_id, agent_type
        self.requests: list[Request] = []
        self.spawn_after, self.join_before, self.status = spawn_after, None, status

    def freeze(self) -> Agent:
        return Agent(
            self.agent_id,
            self.parent_id,
            self.agent_type,
            tuple(self.requests),
            self.spawn_after,
            self.join_before,
            self.status,
        )


class _WekaTrace:
    """Converts one validated AgentX / Weka trace object into a :class:`Session`."""

    def __init__(self, source: str, obj: Any, arrays: list[bytes], namespace: dict[int, BlockId], counter: list[int],
                 shared: _SharedPrefix | None = None):
        top = _Fields(source, obj, "")
        self.source = source
        self.block_size = top.count("block_size", required=False, positive=True) or DEFAULT_WEKA_BLOCK_SIZE
        scope = top.text("hash_id_scope", default="local")
        if scope not in _SCOPES:
            raise _fail(source, "hash_id_scope", f"unknown scope {scope!r}; valid: {list(_SCOPES)}", "value")
        self.scope = scope
        raw_id = obj.get("id")
        if raw_id is not None and (not isinstance(raw_id, (str, int)) or isinstance(raw_id, bool)):
            raise _fail(source, "id", f"expected a string, got {_describe(raw_id)}", "type")
        self.trace_id = str(raw_id) if raw_id is not None else Path(source.rsplit(":", 1)[-1]).stem
        self.requests_value = top.array("requests")
        self.arrays, self.namespace, self.counter = arrays, namespace, counter
        self.shared = shared if scope == "local" else None
        self.root_prefix = self._declared(top, "main")
        started = obj.get("start_unix_s")  # written by kvtier's recorder; used to order a recording by time
        self.recorded_at_s = float(started) if type(started) in (int, float) else None
        self.drafts: list[_AgentDraft] = []

    def _declared(self, f: _Fields, kind: str) -> tuple[str, int, int] | None:
        """``(kind, tool_tokens, system_tokens)`` of an agent's declared prefix, when prefixes are shared."""
        if self.shared is None:
            return None
        tools = f.count("tool_tokens", required=False) or 0
        system = f.count("system_tokens", required=False) or 0
        return (kind, tools, system) if tools + system >= self.block_size else None

    def session(self) -> Session:
        root = _AgentDraft(ROOT_AGENT_ID, None, "main", None, "")
        self._agent(self.requests_value, "requests", root, 0.0, 0.0, self.root_prefix)
        if not self.drafts[0].requests:
            raise _fail(self.source, "requests", "the trace has no API requests (type 'n' or 's')", "value")
        # A sub-agent without API requests does no work: drop it and its subtree.
        kept: set[str] = set()
        agents: list[Agent] = []
        for d in self.drafts:
            if d.requests and (d.parent_id is None or d.parent_id in kept):
                kept.add(d.agent_id)
                agents.append(d.freeze())
        return Session(self.trace_id, tuple(agents), 0.0, self.source, self.recorded_at_s)

    def _agent(self, entries: list[Any], loc: str, draft: _AgentDraft, t_offset: float, ready_s: float,
               prefix: tuple[str, int, int] | None) -> float:
        """Fill ``draft`` (and its sub-agents) from ``entries``; return the absolute end time.

        ``t_offset``: absolute time of the entries' ``t = 0``; ``ready_s``:
        absolute time the agent's dependency finished (its spawn);
        ``prefix``: the agent's declared shared prefix (see :meth:`_share_prefix`).
        """
        self.drafts.append(draft)
        ids = _IdMapper(self.namespace, self.counter, self.arrays)
        pending: list[tuple[_AgentDraft, float]] = []
        prev_end, prev_sent, prev_stop = ready_s, ready_s, ""
        for i, entry in enumerate(entries):
            at = f"{loc}[{i}]"
            f = _Fields(self.source, entry, at)
            kind = f.text("type", required=True)
            if kind == "subagent":
                child, end_s = self._subagent(f, draft, prev_end, prev_sent, t_offset)
                if child.status.startswith("async") or not child.requests:
                    continue
                pending.append((child, end_s))
                continue
            if kind not in _REQUEST_TYPES:
                problem = f"unknown request type {kind!r}; valid: {list(_REQUEST_TYPES)}"
                raise _fail(self.source, f"{at}.type", problem, "value")
            sent = t_offset + f.seconds("t")
            input_tokens = f.count("in")
            output_tokens = f.count("out")
            raw_ids = f.get("hash_ids", True)
            if prefix is not None and not draft.requests:
                self._share_prefix(raw_ids, input_tokens, prefix)
            block_ids, partial = _full_blocks(ids.map(raw_ids, self.source, f"{at}.hash_ids"),
                                              input_tokens, self.block_size, self.source, at)
            raw_answer = f.get("out_hash_ids", False)
            answer = None if raw_answer is None else ids.map(raw_answer, self.source, f"{at}.out_hash_ids")
            stop = f.text("stop")
            think = f.seconds("think_time", required=False)
            api = f.seconds("api_time", required=False)
            index = len(draft.requests)
            if pending:
                last_return = max(end for _, end in pending)
                gap, cause = max(0.0, sent - last_return), "subagent_join"
                for child, _ in pending:
                    child.join_before = index
                depends = tuple(child.agent_id for child, _ in pending)
                pending = []
            elif index == 0:
                gap, cause, depends = max(0.0, sent - ready_s), "start", ()
            else:
                gap = think if think is not None else max(0.0, sent - prev_end)
                cause, depends = ("tool" if prev_stop == "tool_use" else "user"), ()
            draft.requests.append(
                Request(index, input_tokens, output_tokens, block_ids, gap, cause, stop, sent, depends,
                        f.text("model"), kind, api, partial, answer)
            )
            prev_sent, prev_end, prev_stop = sent, sent + (api or 0.0), stop
        return prev_end

    def _share_prefix(self, raw_ids: Any, input_tokens: int, prefix: tuple[str, int, int]) -> None:
        """Key an agent's declared tools + system blocks across traces (``shared_prefix="declared"``).

        The first full blocks of the agent's first request that lie inside
        its declared ``tool_tokens`` + ``system_tokens`` get ids shared by
        every trace of the load whose agent of the same kind declares the
        same counts: a block wholly inside the tools is keyed by ``(kind,
        tool_tokens, index)``, one reaching into the system prompt by
        ``(kind, tool_tokens, system_tokens, index)`` (tools come first in the
        prompt, so equal tools with different system prompts share only the
        tools). ``kind`` is ``main`` for the root agent and
        ``subagent:<subagent_type>`` for a sub-agent. Raw ids already seen in
        this trace keep their mapping.
        """
        kind, tools, system = prefix
        bs = self.block_size
        count = min((tools + system) // bs, input_tokens // bs)
        assert self.shared is not None
        ns = self.namespace
        for i, h in enumerate(_leading_raw_ids(raw_ids, self.arrays, count)):
            if type(h) is int and h not in ns:
                key = (kind, tools, i) if i < tools // bs else (kind, tools, system, i)
                ns[h] = self.shared.block(key, self.counter)

    def _subagent(
        self, f: _Fields, parent: _AgentDraft, parent_end: float, parent_sent: float, t_offset: float
    ) -> tuple[_AgentDraft, float]:
        t_abs = t_offset + f.seconds("t")
        duration_ms = f.seconds("duration_ms", required=False)
        entries = f.array("requests")
        agent_id = f.text("agent_id", default=f"{parent.agent_id}.{len(self.drafts)}")
        if any(d.agent_id == agent_id for d in self.drafts):
            raise _fail(self.source, f"{f.loc}.agent_id", f"duplicate agent_id {agent_id!r}", "value")
        start = t_abs
        if duration_ms is not None and t_abs - duration_ms / 1000.0 >= parent_sent - _TIME_TOL_S:
            start = t_abs - duration_ms / 1000.0
        first_t = entries[0].get("t") if entries and isinstance(entries[0], dict) else None
        absolute = start > _TIME_TOL_S and type(first_t) in (int, float) and first_t >= start - _TIME_TOL_S
        spawn_after = len(parent.requests) - 1 if parent.requests else None
        agent_type = f.text("subagent_type")
        child = _AgentDraft(agent_id, parent.agent_id, agent_type, spawn_after, f.text("status"))
        prefix = self._declared(f, f"subagent:{agent_type}")
        end = self._agent(entries, f"{f.loc}.requests", child, 0.0 if absolute else start, parent_end, prefix)
        if duration_ms is not None and start + duration_ms / 1000.0 >= end:
            end = start + duration_ms / 1000.0
        return child, end


# ---------------------------------------------------------------------------
# Mooncake conversion


def _mooncake_line(source: str, lineno: int, obj: Any, mapper: _IdMapper, name: str) -> Session:
    loc = f"line {lineno}"
    f = _Fields(source, obj, loc)
    arrival = f.seconds("timestamp") / 1000.0
    input_tokens = f.count("input_length")
    output_tokens = f.count("output_length")
    raw = f.get("hash_ids", True)
    if not isinstance(raw, list):
        raise _fail(source, f"{loc}.hash_ids", f"expected an array of ints, got {_describe(raw)}", "type")
    ids, partial = _full_blocks(mapper.map(raw, source, f"{loc}.hash_ids"), input_tokens, MOONCAKE_BLOCK_SIZE,
                                source, loc)
    request = Request(0, input_tokens, output_tokens, ids, 0.0, "start", "", arrival, partial_block=partial)
    return Session(f"{name}:{lineno}", (Agent(ROOT_AGENT_ID, None, "request", (request,)),), arrival, source)


# ---------------------------------------------------------------------------
# The loader


class _SharedPrefix:
    """Block ids of declared prefixes shared across the traces of one load, keyed as :meth:`_WekaTrace._share_prefix` says."""

    __slots__ = ("ids", "added")

    def __init__(self) -> None:
        self.ids: dict[tuple[Any, ...], BlockId] = {}
        self.added: list[tuple[Any, ...]] = []  # keys added by the trace being loaded, for a rollback

    def block(self, key: tuple[Any, ...], counter: list[int]) -> BlockId:
        g = self.ids.get(key)
        if g is None:
            g = self.ids[key] = BlockId(counter[0])
            counter[0] += 1
            self.added.append(key)
        return g

    def rollback(self) -> None:
        for key in self.added:
            del self.ids[key]
        self.added.clear()


class _Loader:
    """Accumulates sessions from many traces; owns id namespaces and the skip report."""

    def __init__(self, *, skip_bad: bool, block_size: int | None, shared_prefix: str = "none") -> None:
        if block_size is not None and (type(block_size) is not int or block_size <= 0):
            raise ConfigError("block_size", block_size, "must be a positive int or None")
        if shared_prefix not in SHARED_PREFIX_MODES:
            raise ConfigError("shared_prefix", shared_prefix, f"must be one of {list(SHARED_PREFIX_MODES)}")
        self.skip_bad = skip_bad
        self.block_size = block_size
        self.shared = _SharedPrefix() if shared_prefix == "declared" else None
        self.counter = [0]
        self.global_ns: dict[int, BlockId] = {}
        self.sessions: list[tuple[int, Session]] = []  # (native block size, session)
        self.session_ids: set[str] = set()
        self.open_loop: bool | None = None
        self.skipped: list[SkippedTrace] = []
        self.num_loaded = 0

    @property
    def report_skipped(self) -> bool:
        return bool(self.skipped)

    def fail(self, err: TraceError) -> None:
        if not self.skip_bad:
            raise err
        self.skipped.append(SkippedTrace(err.source, err.kind, str(err)))

    def load_blobs(self, blobs: Iterable[tuple[str, bytes]]) -> None:
        for source, data in blobs:
            if _is_jsonl(source, data):
                self._load_jsonl(source, data)
                continue
            try:
                obj, arrays = _parse_json_trace(data, source)
            except TraceError as e:
                self.fail(e)
                continue
            self.load_weka_object(source, obj, arrays)

    def load_weka_object(self, source: str, obj: Any, arrays: list[bytes]) -> None:
        try:
            self._check_loop(source, open_loop=False)
            scope_ns = self.global_ns if isinstance(obj, dict) and obj.get("hash_id_scope") == "global" else {}
            counter_before = self.counter[0]
            if self.shared is not None:
                self.shared.added.clear()
            try:
                trace = _WekaTrace(source, obj, arrays, scope_ns, self.counter, self.shared)
                session = trace.session()
            except TraceError:
                if scope_ns is not self.global_ns:
                    if self.shared is not None:
                        self.shared.rollback()
                    self.counter[0] = counter_before
                raise
        except TraceError as e:
            self.fail(e)
            return
        self._add(trace.block_size, self._unique(session))
        self.open_loop = False

    def _load_jsonl(self, source: str, data: bytes) -> None:
        try:
            self._check_loop(source, open_loop=True)
        except TraceError as e:
            self.fail(e)
            return
        name = _workload_name(Path(source.rsplit(":", 1)[-1]))
        mapper = _IdMapper({}, self.counter, [])
        for lineno, line in enumerate(data.splitlines(), 1):
            if not line.strip():
                continue
            try:
                try:
                    obj = json.loads(line)
                except (ValueError, RecursionError) as e:
                    problem = f"malformed JSON ({e}; truncated file?)"
                    raise TraceError(source, f"line {lineno}", problem, "malformed") from None
                session = _mooncake_line(source, lineno, obj, mapper, name)
            except TraceError as e:
                self.fail(e)
                continue
            self._add(MOONCAKE_BLOCK_SIZE, self._unique(session))
        self.open_loop = True

    def _check_loop(self, source: str, *, open_loop: bool) -> None:
        if self.open_loop is not None and self.open_loop != open_loop:
            have = "open-loop (Mooncake)" if self.open_loop else "closed-loop (AgentX/Weka)"
            raise TraceError(source, "", f"cannot mix this trace into a workload of {have} traces", "format")

    def _unique(self, session: Session) -> Session:
        sid, n = session.session_id, 1
        while sid in self.session_ids:
            n += 1
            sid = f"{session.session_id}~{n}"
        self.session_ids.add(sid)
        return session if sid == session.session_id else replace(session, session_id=sid)

    def _add(self, native_block_size: int, session: Session) -> None:
        self.sessions.append((native_block_size, session))
        self.num_loaded += 1

    def finish(self, name: str, path: str, started: float) -> tuple[Workload, LoadReport]:
        target = self.block_size or (self.sessions[0][0] if self.sessions else DEFAULT_WEKA_BLOCK_SIZE)
        by_size: dict[int, list[int]] = {}
        for i, (bs, _) in enumerate(self.sessions):
            by_size.setdefault(bs, []).append(i)
        out = [s for _, s in self.sessions]
        for bs, idxs in by_size.items():
            if bs == target:
                continue
            group = Workload(name, bs, tuple(out[i] for i in idxs), bool(self.open_loop))
            try:
                moved = reblock(group, target).sessions
            except ValueError as e:
                raise TraceError(out[idxs[0]].source, "block_size", str(e), "value") from None
            for i, s in zip(idxs, moved):
                out[i] = s
        workload = Workload(name, target, tuple(out), bool(self.open_loop))
        report = LoadReport(path, self.num_loaded, tuple(self.skipped), time.perf_counter() - started)
        return workload, report


def _is_jsonl(source: str, data: bytes) -> bool:
    name = source.rsplit(":", 1)[-1]
    if name.endswith(".jsonl"):
        return True
    if name.endswith(".json"):
        return False
    first = data.lstrip().split(b"\n", 1)[0]
    try:
        obj = json.loads(first)
    except (ValueError, RecursionError):
        return False
    return isinstance(obj, dict) and "requests" not in obj and ("timestamp" in obj or "input_length" in obj)
