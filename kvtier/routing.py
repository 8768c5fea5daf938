"""KV-aware routing: which engine of a fleet holds the longest prefix of a request.

Owns: :class:`RoutingIndex`, an index of the blocks each engine holds, per
tier, built from the engines' KV cache events in vLLM's wire format (the
events vLLM publishes for its prefix cache, medium ``GPU``, and the kvtier
connector for its DRAM, SSD and remote tiers); :class:`Router`, which keeps
one :class:`~kvtier.kvevents.subscriber.KVEventSubscriber` per engine and
feeds the index; and :func:`serve_http`, a small JSON service a proxy can
ask (``kvtier route``).

Blocks are indexed by their tokens, not by an engine's block hashes (those
depend on each engine's hash seed and algorithm): an event's block gets the
index key ``digest(parent's index key, its token ids)``, the same chain the
router computes from a request's token ids. A block stored with locality
``REMOTE`` (kvtier's remote tier, one store shared by the engines) counts for
every engine, since any of them can load it.

A request's score on an engine is the sum, over the longest run of its
leading blocks that the engine can serve, of the weight of the best tier
holding each block (``GPU`` 1.0, ``CPU`` 0.8, ``STORAGE`` 0.5, remote 0.3 by
default: roughly what a hit there saves of the prefill). The engine with the
highest score wins; ties go to the engine given first.

Must not forward requests or talk to engines beyond subscribing to their
events, and must not import an engine. Blocks of LoRA adapters, multimodal
inputs or cache salts carry extra hash inputs the events give separately;
this index ignores them (one model, no salts), so route such fleets by
session instead.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigError
from .kvevents.wire import KVAllBlocksCleared, KVBlockRemoved, KVBlockStored, KVEventBatch

REMOTE = "REMOTE"
DEFAULT_WEIGHTS: Mapping[str, float] = {"GPU": 1.0, "CPU": 0.8, "STORAGE": 0.5, REMOTE: 0.3}
"""Tier weights by vLLM medium, and ``REMOTE`` for a store shared by the engines."""


def chain_keys(token_ids: Sequence[int], block_size: int, parent: int = 0) -> list[int]:
    """Index keys of the full blocks of ``token_ids``: each a 64-bit digest of the
    previous key and the block's tokens (``parent`` before the first; 0 for a
    prompt's start). Partial blocks have none.

    >>> a = chain_keys(list(range(10)), 4)
    >>> len(a), a == chain_keys(list(range(8)), 4), a[1] == chain_keys(list(range(4, 8)), 4, a[0])[0]
    (2, True, True)
    """
    keys = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        h = hashlib.blake2b(parent.to_bytes(8, "little"), digest_size=8)
        h.update(b"".join(int(t).to_bytes(4, "little", signed=True) for t in token_ids[start:start + block_size]))
        parent = int.from_bytes(h.digest(), "little")
        keys.append(parent)
    return keys


@dataclass
class _Engine:
    """What one engine holds: index key -> media, and its own block hash -> index key."""

    where: dict[int, set[str]] = field(default_factory=dict)
    by_hash: dict[Any, int] = field(default_factory=dict)


class RoutingIndex:
    """Blocks per engine and tier, fed by :meth:`apply`; asked by :meth:`scores` / :meth:`choose`.

    >>> ix = RoutingIndex(["a", "b"], block_size=2)
    >>> ix.apply("a", KVEventBatch(0.0, (KVBlockStored((11, 12), None, (1, 2, 3, 4), 2, None, "GPU", None),)))
    >>> ix.apply("b", KVEventBatch(0.0, (KVBlockStored((7,), None, (1, 2), 2, None, "CPU", None),)))
    >>> ix.scores([1, 2, 3, 4, 5])
    {'a': 2.0, 'b': 0.8}
    >>> ix.choose([1, 2, 3, 4, 5]), ix.choose([9, 9])
    ('a', 'a')
    """

    def __init__(self, engines: Iterable[str], block_size: int, weights: Mapping[str, float] | None = None) -> None:
        self.engines: dict[str, _Engine] = {name: _Engine() for name in engines}
        if not self.engines:
            raise ConfigError("engines", [], "give at least one engine")
        if type(block_size) is not int or block_size <= 0:
            raise ConfigError("block_size", block_size, "must be a positive number of tokens")
        self.block_size = block_size
        self.weights = dict(DEFAULT_WEIGHTS if weights is None else weights)
        for medium, w in self.weights.items():
            if isinstance(w, bool) or not isinstance(w, (int, float)) or w < 0:
                raise ConfigError(f"weights.{medium}", w, "must be a number >= 0")
        self.remote = _Engine()  # blocks in the shared store (locality REMOTE), any engine's
        self.counters: Counter[str] = Counter()
        self._lock = threading.Lock()

    # ------------------------------------------------------------ feeding

    def apply(self, engine: str, batch: KVEventBatch) -> None:
        """Apply one published batch of ``engine``'s events."""
        mine = self.engines.get(engine)
        if mine is None:
            raise KeyError(f"unknown engine {engine!r}; known: {', '.join(self.engines)}")
        with self._lock:
            for event in batch.events:
                if isinstance(event, KVBlockStored):
                    self._stored(mine, event)
                elif isinstance(event, KVBlockRemoved):
                    self._removed(self.remote if event.locality == REMOTE else mine, event)
                elif isinstance(event, KVAllBlocksCleared):  # vLLM's prefix cache (GPU) was reset
                    self._drop_medium(mine, "GPU")
                    self.counters["cleared"] += 1
                else:
                    self.counters["unknown_events"] += 1

    def _stored(self, mine: _Engine, event: KVBlockStored) -> None:
        if event.block_size != self.block_size or len(event.token_ids) != len(event.block_hashes) * self.block_size:
            self.counters["skipped_block_size"] += 1  # another block size: not comparable with this index
            return
        target = self.remote if event.locality == REMOTE else mine
        medium = REMOTE if event.locality == REMOTE else (event.medium or "GPU")
        parent = 0
        if event.parent_block_hash is not None:
            known = target.by_hash.get(event.parent_block_hash, mine.by_hash.get(event.parent_block_hash))
            if known is None:  # a parent this index never saw: the chain cannot be placed
                self.counters["orphan_blocks"] += len(event.block_hashes)
                return
            parent = known
        for h, key in zip(event.block_hashes, chain_keys(event.token_ids, self.block_size, parent)):
            target.by_hash[h] = key
            target.where.setdefault(key, set()).add(medium)
            self.counters["stored_blocks"] += 1

    def _removed(self, target: _Engine, event: KVBlockRemoved) -> None:
        medium = REMOTE if event.locality == REMOTE else (event.medium or "GPU")
        for h in event.block_hashes:
            key = target.by_hash.get(h)
            media = target.where.get(key) if key is not None else None
            if media is None:
                continue
            media.discard(medium)
            self.counters["removed_blocks"] += 1
            if not media:
                del target.where[key]
                del target.by_hash[h]

    def _drop_medium(self, target: _Engine, medium: str) -> None:
        for key in [k for k, m in target.where.items() if medium in m]:
            target.where[key].discard(medium)
            if not target.where[key]:
                del target.where[key]
        live = set(target.where)
        target.by_hash = {h: k for h, k in target.by_hash.items() if k in live}

    # ------------------------------------------------------------ asking

    def scores(self, token_ids: Sequence[int]) -> dict[str, float]:
        """Each engine's score for a request of ``token_ids`` (see the module docstring)."""
        keys = chain_keys(token_ids, self.block_size)
        w = self.weights
        out = {}
        with self._lock:
            for name, eng in self.engines.items():
                total = 0.0
                for key in keys:
                    media = self._media(eng, key)
                    if not media:
                        break
                    total += max(w.get(m, 0.0) for m in media)
                out[name] = round(total, 6)
        return out

    def prefix_blocks(self, token_ids: Sequence[int]) -> dict[str, dict[str, int]]:
        """Per engine, how many leading blocks of the request each medium holds (as a
        leading run of its own), for operators and tests."""
        keys = chain_keys(token_ids, self.block_size)
        out: dict[str, dict[str, int]] = {}
        with self._lock:
            for name, eng in self.engines.items():
                media = [self._media(eng, k) for k in keys]
                runs: dict[str, int] = {}
                for medium in sorted(set().union(*media)):
                    n = 0
                    while n < len(keys) and medium in media[n]:
                        n += 1
                    runs[medium] = n
                out[name] = runs
        return out

    def _media(self, eng: _Engine, key: int) -> set[str]:
        """Where ``eng`` can get block ``key``: its own media, and the shared store's."""
        return eng.where.get(key, set()) | self.remote.where.get(key, set())

    def choose(self, token_ids: Sequence[int]) -> str:
        """The engine with the highest score (the first given on a tie)."""
        scores = self.scores(token_ids)
        best = max(scores.values())
        return next(name for name, s in scores.items() if s == best)


class Router:
    """A :class:`RoutingIndex` fed by subscriptions to each engine's KV event
    publisher (``endpoints``: name -> ``tcp://host:port`` or
    ``(endpoint, replay endpoint)``). :meth:`poll` drains what arrived;
    :meth:`start` does so on a thread."""

    def __init__(self, endpoints: Mapping[str, str | tuple[str, str | None]], block_size: int,
                 weights: Mapping[str, float] | None = None, *, start_seq: int | None = 0) -> None:
        from .kvevents.subscriber import KVEventSubscriber

        self.index = RoutingIndex(endpoints, block_size, weights)
        self._subs = {}
        for name, ep in endpoints.items():
            live, replay = (ep, None) if isinstance(ep, str) else ep
            self._subs[name] = KVEventSubscriber(live, replay, start_seq=start_seq if replay else None)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._poll_lock = threading.Lock()
        self._caught_up = False

    def poll(self, timeout_s: float = 0.0) -> int:
        """Apply every batch that has arrived (waiting up to ``timeout_s`` per engine); how many."""
        n = 0
        with self._poll_lock:
            for name, sub in self._subs.items():
                # first: what each engine published before this router subscribed (its replay buffer)
                for _, batch in ([] if self._caught_up else sub.catch_up()) + sub.poll(timeout_s):
                    self.index.apply(name, batch)
                    n += 1
            self._caught_up = True
        return n

    def start(self, interval_s: float = 0.05) -> Router:
        """Poll on a background thread until :meth:`close`."""
        def run() -> None:
            while not self._stop.is_set():
                self.poll(interval_s)

        self._thread = threading.Thread(target=run, name="kvtier-router", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        for sub in self._subs.values():
            sub.close()

    def __enter__(self) -> Router:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve_http(router: Router, host: str, port: int) -> Any:
    """A JSON service on ``host:port`` (returned, started on a thread; ``shutdown()`` stops it):

    * ``POST /route`` with ``{"token_ids": [...]}`` -> ``{"engine": name, "scores": {...},
      "prefix_blocks": {...}}``;
    * ``GET /stats`` -> the index's counters and blocks per engine.
    """
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    index = router.index

    class Handler(BaseHTTPRequestHandler):
        def _reply(self, code: int, body: Mapping[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            if self.path != "/route":
                return self._reply(404, {"error": f"no such path {self.path!r}; POST /route, GET /stats"})
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                tokens = body["token_ids"]
                if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
                    raise TypeError
            except (ValueError, KeyError, TypeError):
                return self._reply(400, {"error": 'body must be {"token_ids": [int, ...]}'})
            scores = index.scores(tokens)
            best = max(scores.values())
            self._reply(200, {"engine": next(n for n, s in scores.items() if s == best), "scores": scores,
                              "prefix_blocks": index.prefix_blocks(tokens)})

        def do_GET(self) -> None:  # noqa: N802
            if self.path != "/stats":
                return self._reply(404, {"error": f"no such path {self.path!r}; POST /route, GET /stats"})
            with index._lock:
                blocks = {n: len(e.where) for n, e in index.engines.items()}
                blocks["(remote)"] = len(index.remote.where)
            self._reply(200, {"counters": dict(index.counters), "blocks": blocks})

        def log_message(self, *args: Any) -> None:  # quiet: a proxy asks per request
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    threading.Thread(target=server.serve_forever, name="kvtier-route-http", daemon=True).start()
    return server


DESCRIPTION = ("Subscribe to the KV cache events of N engines (vLLM's ZMQ publisher, --kv-events-config; the kvtier "
               "connector adds its DRAM, SSD and remote tiers to them), index the blocks each engine holds per "
               "tier, and answer POST /route {\"token_ids\": [...]} with the engine whose cached prefix scores "
               "highest (tier weights: GPU 1.0, CPU 0.8, STORAGE 0.5, REMOTE 0.3) and GET /stats. A library too: "
               "kvtier.routing.")


def add_arguments(o: Any) -> None:
    """``kvtier route``'s flags (argparse only)."""
    from .cliargs import positive_int

    o.add_argument("--engine", action="append", required=True, metavar="NAME=tcp://HOST:PORT[,tcp://HOST:REPLAY]",
                   help="an engine's KV event publisher (and its replay socket, to fill gaps); repeat per engine")
    o.add_argument("--block-size", type=positive_int, required=True, metavar="TOKENS",
                   help="the engines' KV block size in tokens (events of another size are skipped and counted)")
    o.add_argument("--weight", action="append", metavar="MEDIUM=NUMBER",
                   help="a tier's weight per cached block (GPU, CPU, STORAGE or REMOTE); repeatable")
    o.add_argument("--listen", default="127.0.0.1:8790", metavar="HOST:PORT",
                   help="where the JSON service listens (default 127.0.0.1:8790)")


def parse_engines(specs: Sequence[str]) -> dict[str, tuple[str, str | None]]:
    """``NAME=tcp://HOST:PORT[,tcp://HOST:REPLAY_PORT]`` per engine -> endpoints; a
    ``ConfigError`` naming ``--engine`` otherwise."""
    endpoints: dict[str, tuple[str, str | None]] = {}
    for spec in specs:
        name, sep, rest = spec.partition("=")
        live, _, replay = rest.partition(",")
        if not sep or not name or not live.startswith(("tcp://", "ipc://")) or (
                replay and not replay.startswith(("tcp://", "ipc://"))):
            raise ConfigError("--engine", spec, "expected NAME=tcp://HOST:PORT[,tcp://HOST:REPLAY_PORT]")
        if name in endpoints:
            raise ConfigError("--engine", spec, f"engine {name!r} given twice")
        endpoints[name] = (live, replay or None)
    return endpoints


def parse_weights(specs: Sequence[str]) -> dict[str, float]:
    """``MEDIUM=NUMBER`` overrides of :data:`DEFAULT_WEIGHTS`; a ``ConfigError`` naming ``--weight`` otherwise."""
    weights = dict(DEFAULT_WEIGHTS)
    for spec in specs:
        medium, sep, value = spec.partition("=")
        try:
            w = float(value)
        except ValueError:
            w = -1.0
        if not sep or medium not in DEFAULT_WEIGHTS or not w >= 0:
            raise ConfigError("--weight", spec, "expected MEDIUM=NUMBER >= 0, MEDIUM one of GPU, CPU, STORAGE, REMOTE")
        weights[medium] = w
    return weights


def command(args: Any) -> int:
    """``kvtier route``: serve until interrupted."""
    import time

    endpoints = parse_engines(args.engine)
    weights = parse_weights(args.weight or ())
    host, _, port = args.listen.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError("--listen", args.listen, "expected HOST:PORT")
    router = Router(endpoints, args.block_size, weights).start()
    try:
        server = serve_http(router, host, int(port))
    except OSError as e:
        router.close()
        raise ConfigError("--listen", args.listen, f"cannot listen there ({e})") from None
    print(f"kvtier route: {len(endpoints)} engines ({', '.join(endpoints)}), block size {args.block_size}; "
          f"POST http://{host}:{server.server_address[1]}/route, GET /stats", flush=True)
    try:
        while True:
            time.sleep(3600)
    finally:
        server.shutdown()
        router.close()
