"""Hints from the request stream, in ``vllm serve``: one setting turns them on.

    python -m vllm.entrypoints.openai.api_server ... \\
        --kv-transfer-config '{"kv_connector": "kvtier", "kv_role": "kv_both",
                               "kv_connector_extra_config": {"placement": "kvtier", "hint_server": "127.0.0.1:50071"}}' \\
        --middleware kvtier_vllm.middleware.RequestStreamHints

An ASGI middleware (vLLM's ``--middleware`` takes one by import path). For each
``POST /v1/chat/completions`` and ``/v1/messages`` (Anthropic) it lets
:class:`kvtier.hints.stream.StreamHints` derive the session, the agent and its
tool waits from what the client sent, writes the session and agent into the
request's ``kv_transfer_params`` (as :func:`kvtier.sdk.tag_request` would; a
request that already carries them is left alone: an SDK hint wins), and the
tool wait of a request that forces a tool call (``kvtier_tool_wait_s``, unless
the client set it), reads the
tool calls the response ends in, and sends the hint events to the connector's
hint server (``hint_server``, or the server it follows with ``hint_watch``,
taken from the engine's own ``--kv-transfer-config``), whose history predicts
each wait. Counters go to vLLM's ``/metrics`` as ``kvtier_stream_hints_*``.

Owns: rewriting request bodies, watching response bodies, the hint client of
the API server process.
Must not: change a response, fail a request (any error here passes the request
through untouched, counted and logged once), or block the event loop (events
are queued; a thread sends them).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from kvtier.hints.stream import ResponseCalls, StreamHints

log = logging.getLogger("kvtier.middleware")

PATHS = {"/v1/chat/completions": "openai", "/v1/messages": "anthropic"}
MAX_BODY_BYTES = 32 << 20  # larger request bodies pass through untouched


class RequestStreamHints:
    """The ASGI middleware; see the module docstring."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.hints = StreamHints()
        self._client: Any = None
        self._client_tried = False
        self._metrics: Any = None
        self._exported: dict[str, int] = {}  # StreamHints counters as last sent to Prometheus
        self._logged: set[str] = set()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        api = None
        if scope.get("type") == "http" and scope.get("method") == "POST":
            path, root = scope.get("path", ""), scope.get("root_path", "")
            api = PATHS.get(path[len(root):] if root and path.startswith(root) else path)
        if api is None:
            await self.app(scope, receive, send)
            return
        chunks, size, more = [], 0, True
        while more:
            msg = await receive()
            if msg["type"] != "http.request":  # the client went away
                await self.app(scope, _replay([msg], receive), send)
                return
            chunks.append(msg.get("body", b""))
            size += len(chunks[-1])
            more = msg.get("more_body", False)
        raw = b"".join(chunks)
        derived, body = None, raw
        try:
            derived, body = self._on_request(api, scope, raw, size)
        except Exception as exc:  # never fail a request for a hint
            self._trouble("request", exc)
        if body is not raw:
            scope = dict(scope)
            scope["headers"] = [(k, v) for k, v in scope["headers"] if k != b"content-length"] + [
                (b"content-length", str(len(body)).encode())]
        if derived is None:
            await self.app(scope, _replay([{"type": "http.request", "body": body, "more_body": False}], receive), send)
            return
        watcher: list[ResponseCalls] = []  # made when the response starts: streaming or not, by its content type

        async def watch(msg: dict) -> None:
            try:
                if msg["type"] == "http.response.start" and int(msg.get("status", 0)) == 200:
                    ctype = dict(msg.get("headers") or ()).get(b"content-type", b"")
                    watcher.append(ResponseCalls(streaming=ctype.startswith(b"text/event-stream")))
                elif msg["type"] == "http.response.body" and watcher:
                    watcher[0].feed(msg.get("body", b""))
                    if not msg.get("more_body", False):
                        self._emit(self.hints.response(derived, watcher.pop().calls(), time.monotonic()))
                        self._export()
            except Exception as exc:
                self._trouble("response", exc)
            await send(msg)

        await self.app(scope, _replay([{"type": "http.request", "body": body, "more_body": False}], receive), watch)

    def _on_request(self, api: str, scope: dict, raw: bytes, size: int) -> tuple[Any, bytes]:
        if size > MAX_BODY_BYTES:
            self._count("requests_too_large")
            return None, raw
        try:
            body = json.loads(raw)
        except ValueError:
            self._count("requests_unparsed")
            return None, raw
        params = body.get("kv_transfer_params") if isinstance(body, dict) else None
        if params is not None and not isinstance(params, dict):  # vLLM judges that body, unchanged
            self._count("requests_odd_kv_transfer_params")
            return None, raw
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}
        self._hint_client(scope)  # (made on the first request: the address is in the app's vLLM config)
        derived = self.hints.request(api, headers, body, time.monotonic())
        self._export()
        if derived is None:
            return None, raw
        body["kv_transfer_params"] = {**derived.params, **(params or {})}  # the client's own kvtier_tool_wait_s wins
        self._emit(derived.events)
        return derived, json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()

    def _export(self) -> None:
        """StreamHints' counters that moved since the last call, to Prometheus."""
        for k, v in list(self.hints.counters.items()):
            if v != self._exported.get(k, 0):
                self._count(k, v - self._exported.get(k, 0))
                self._exported[k] = v

    # ------------------------------------------------------------ hint events

    def _emit(self, events: list[tuple[str, dict[str, Any]]]) -> None:
        if not events:
            return
        client = self._client
        for kind, fields in events:
            self._count(f"events_{kind}")
            if client is not None and not client.emit(kind, **fields):
                self._count("events_dropped")

    def _hint_client(self, scope: dict | None) -> Any:
        if self._client is not None or self._client_tried or scope is None:
            return self._client
        self._client_tried = True
        target = _hint_target(scope)
        if target is None:
            log.error("kvtier: --middleware %s.RequestStreamHints needs the kvtier connector with hint_server "
                      "(a fixed host:port or unix:PATH) or hint_watch in --kv-transfer-config; "
                      "requests are tagged, but no tool wait reaches the connector", __name__)
            return None
        from kvtier.sdk import HintClient

        self._client = HintClient(target[0], token=target[1])
        self._client.start()
        log.info("kvtier: request-stream hints go to the hint server at %s", target[0])
        return self._client

    # ------------------------------------------------------------ accounting

    def _count(self, name: str, n: int = 1) -> None:
        metrics = self._metrics
        if metrics is None:
            from prometheus_client import REGISTRY, Counter

            existing = getattr(REGISTRY, "_names_to_collectors", {}).get("kvtier_stream_hints")
            metrics = self._metrics = existing or Counter(
                "kvtier_stream_hints", "kvtier request-stream hints: requests, sessions, agents, tool calls, "
                "refused ids and hint events, by kind", ["kind"])
        metrics.labels(kind=name).inc(n)

    def _trouble(self, where: str, exc: Exception) -> None:
        try:
            self._count(f"errors_{where}")
            if where not in self._logged:
                self._logged.add(where)
                log.exception("kvtier: request-stream hints failed on a %s (passed through; logged once): %s",
                              where, exc)
        except Exception:  # never let accounting break a response
            pass


def _hint_target(scope: dict) -> tuple[str, str | None] | None:
    """(address, token) of the hint server the engine's kvtier connector uses, from the app's vLLM config."""
    app = scope.get("app")
    config = getattr(getattr(app, "state", None), "vllm_config", None)
    kv = getattr(config, "kv_transfer_config", None)
    extra = getattr(kv, "kv_connector_extra_config", None) or {}
    address = extra.get("hint_server")
    if isinstance(address, str) and address and not address.endswith(":0"):
        token_file = extra.get("hint_server_token_file")
        if isinstance(token_file, str) and token_file:  # (the connector has read it already: it starts first)
            from kvtier.hints.server import load_tokens

            return address, next(iter(load_tokens(token_file)), None)
        return address, None
    watch = extra.get("hint_watch")
    if isinstance(watch, str) and watch:
        return watch, extra.get("hint_watch_token")
    return None


def _replay(messages: list[dict], receive: Any) -> Any:
    """A ``receive`` that gives ``messages`` (the request, read already), then the connection's own
    (a client that goes away is seen, and vLLM aborts its request)."""
    queue = list(messages)

    async def replayed() -> dict:
        if queue:
            return queue.pop(0)
        return await receive()

    return replayed
