"""Test support for the hint plane: a HintServer on its own event-loop thread,
event builders and a free-port helper. Real gRPC only (no fake channels)."""

from __future__ import annotations

import asyncio
import itertools
import socket
import threading
import time
from typing import Any, Callable

import grpc

from kvtier.hints._gen import hints_pb2 as pb
from kvtier.hints._gen import hints_pb2_grpc as pb_grpc
from kvtier.hints.server import HintServer

_ids = itertools.count(1)


def free_port() -> int:
    """A port that was free a moment ago (bind to port 0, read, release)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def now_us() -> int:
    return time.time_ns() // 1000


def signal(kind: str, event_id: int | None = None, ts: int | None = None, **fields: Any) -> Any:
    """A ``Signal`` with a fresh event id and the current time unless given."""
    return pb.Signal(event_id=next(_ids) if event_id is None else event_id,
                     client_time_unix_us=now_us() if ts is None else ts, **{kind: fields})


def command(kind: str, event_id: int | None = None, ts: int | None = None, **fields: Any) -> Any:
    return pb.Command(event_id=next(_ids) if event_id is None else event_id,
                      client_time_unix_us=now_us() if ts is None else ts, **{kind: fields})


def batch(*events: Any, skip_invalid: bool = False, client_id: str = "test") -> Any:
    req = pb.PublishRequest(client_id=client_id, skip_invalid=skip_invalid)
    for ev in events:
        (req.commands if isinstance(ev, pb.Command) else req.signals).append(ev)
    return req


def keys(*ints: int) -> bytes:
    return b"".join(i.to_bytes(16, "big") for i in ints)


class ServerThread:
    """A :class:`HintServer` serving from a background thread's event loop."""

    def __init__(self, address: str = "127.0.0.1:0", **kwargs: Any) -> None:
        self.server = HintServer(**kwargs)
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._requested = address
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread = threading.Thread(target=self._main, daemon=True)
        self.thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("hint server did not start")
        if self._error is not None:
            raise self._error
        self.address: str = self.server.address  # type: ignore[assignment]

    def _main(self) -> None:
        async def run() -> None:
            self.loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            try:
                await self.server.start(self._requested)
            except BaseException as err:  # surfaced to the constructor
                self._error = err
                self._ready.set()
                return
            self._ready.set()
            await self._stop.wait()
            await self.server.stop(0.2)

        asyncio.run(run())

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the server's loop (safe access to the graph) and return its result."""
        async def wrapper() -> Any:
            return fn()

        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(wrapper(), self.loop).result(10)

    def stop(self) -> None:
        if self.loop is not None and self.thread.is_alive():
            self.loop.call_soon_threadsafe(self._stop.set)
        self.thread.join(10)

    def __enter__(self) -> ServerThread:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def stub(address: str, **channel_kwargs: Any) -> tuple[Any, Any]:
    """``(channel, HintServiceStub)`` over a plain channel."""
    channel = grpc.insecure_channel(address)
    return channel, pb_grpc.HintServiceStub(channel)
