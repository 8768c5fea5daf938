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
request that already carries them is left alone: an SDK hint wins), reads the
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
        self._logged: set[str] = set()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        api = PATHS.get(scope.get("path", "")) if scope.get("type") == "http" and scope.get("method") == "POST" \
            else None
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
        derived, body, streaming = None, raw, False
        try:
            derived, body, streaming = self._on_request(api, scope, raw, size)
        except Exception as exc:  # never fail a request for a hint
            self._trouble("request", exc)
        if body is not raw:
            scope = dict(scope)
            scope["headers"] = [(k, v) for k, v in scope["headers"] if k != b"content-length"] + [
                (b"content-length", str(len(body)).encode())]
        if derived is None:
            await self.app(scope, _replay([{"type": "http.request", "body": body, "more_body": False}], receive), send)
            return
        watcher = ResponseCalls(streaming)
        status: list[int] = [0]

        async def watch(msg: dict) -> None:
            try:
                if msg["type"] == "http.response.start":
                    status[0] = int(msg.get("status", 0))
                elif msg["type"] == "http.response.body" and status[0] == 200:
                    watcher.feed(msg.get("body", b""))
                    if not msg.get("more_body", False):
                        self._emit(self.hints.response(derived, watcher.calls(), time.monotonic()))
            except Exception as exc:
                self._trouble("response", exc)
            await send(msg)

        await self.app(scope, _replay([{"type": "http.request", "body": body, "more_body": False}], receive), watch)

    def _on_request(self, api: str, scope: dict, raw: bytes, size: int) -> tuple[Any, bytes, bool]:
        if size > MAX_BODY_BYTES:
            self._count("requests_too_large")
            return None, raw, False
        try:
            body = json.loads(raw)
        except ValueError:
            self._count("requests_unparsed")
            return None, raw, False
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}
        before = dict(self.hints.counters)
        derived = self.hints.request(api, headers, body, time.monotonic())
        for k, v in self.hints.counters.items():
            if v != before.get(k, 0):
                self._count(k, v - before.get(k, 0))
        if derived is None:
            return None, raw, False
        params = body.get("kv_transfer_params") if isinstance(body.get("kv_transfer_params"), dict) else {}
        body["kv_transfer_params"] = {**params, **derived.params}
        self._emit(derived.events, scope)
        return derived, json.dumps(body).encode(), bool(body.get("stream"))

    # ------------------------------------------------------------ hint events

    def _emit(self, events: list[tuple[str, dict[str, Any]]], scope: dict | None = None) -> None:
        if not events:
            return
        client = self._hint_client(scope)
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
        self._count(f"errors_{where}")
        if where not in self._logged:
            self._logged.add(where)
            log.exception("kvtier: request-stream hints failed on a %s (passed through; logged once): %s", where, exc)


def _hint_target(scope: dict) -> tuple[str, str | None] | None:
    """(address, token) of the hint server the engine's kvtier connector uses, from the app's vLLM config."""
    app = scope.get("app")
    config = getattr(getattr(app, "state", None), "vllm_config", None)
    kv = getattr(config, "kv_transfer_config", None)
    extra = getattr(kv, "kv_connector_extra_config", None) or {}
    address = extra.get("hint_server")
    if isinstance(address, str) and address and not address.endswith(":0"):
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
