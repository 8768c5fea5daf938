"""Publish KV events in vLLM's wire format: ZMQ PUB plus a ROUTER replay socket.

Owns: the sockets, the sequence numbers, a bounded buffer of recent payloads
and the thread that sends them. Must not decide what happened to a block (the
TierManager's events say so) and must not block the caller on the network:
``publish`` only enqueues.

Protocol (same as vLLM's ``ZmqEventPublisher``):

* PUB frames ``(topic, seq 8-byte big-endian, payload)``, ``seq`` from 0;
* ROUTER replay: a client (DEALER) sends ``(b"", start_seq 8 bytes)``; the
  reply is ``(b"", topic, seq, payload)`` for every buffered batch with
  ``seq >= start_seq``, then ``(b"", b"", END_SEQ, b"")``.

>>> pub = KVEventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", block_size=16)  # doctest: +SKIP
>>> pub.publish_events(store.take_events())  # a store built with kv_events: true  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..events import Event
from ..keys import BlockKey, key_to_bytes
from .wire import (
    END_SEQ,
    TIER_TO_MEDIUM,
    ExternalBlockHash,
    KVAllBlocksCleared,
    KVEventBatch,
    encode_batch,
    to_wire,
)

logger = logging.getLogger(__name__)


def load_zmq() -> Any:
    try:
        import zmq
    except ModuleNotFoundError:
        from ..errors import MissingExtraError

        raise MissingExtraError("kvtier.kvevents (engine KV events)", "events", "zmq") from None
    return zmq


class KVEventPublisher:
    """Publishes batches of KV events; one background thread owns the sockets.

    ``endpoint`` / ``replay_endpoint`` are bound (``tcp://127.0.0.1:0`` picks a
    free port; read the bound address from :attr:`endpoint`). ``buffer_steps``
    batches are kept for replay. The kvtier-event conversion settings are those
    of :func:`~kvtier.kvevents.wire.to_wire`.
    """

    POLL_S = 0.02

    def __init__(
        self,
        endpoint: str = "tcp://*:5557",
        replay_endpoint: str | None = None,
        *,
        block_size: int,
        topic: str = "",
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        max_queue_batches: int = 100_000,
        data_parallel_rank: int | None = 0,
        tiers: Sequence[str] | None = None,
        medium_of_tier: Mapping[str, str] = TIER_TO_MEDIUM,
        external_id: Callable[[BlockKey], ExternalBlockHash] = key_to_bytes,
        token_ids_of: Callable[[BlockKey], Sequence[int]] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if buffer_steps < 1:
            raise ValueError(f"buffer_steps={buffer_steps!r}: must be >= 1")
        zmq = load_zmq()
        self._wire_args: dict[str, Any] = {"block_size": block_size, "tiers": tiers, "medium_of_tier": medium_of_tier,
                                           "external_id": external_id, "token_ids_of": token_ids_of}
        self._rank = data_parallel_rank
        self._clock = clock
        self._topic = topic.encode()
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self.endpoint = self._bind(self._pub, endpoint)
        self._replay = None
        self.replay_endpoint: str | None = None
        if replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self.replay_endpoint = self._bind(self._replay, replay_endpoint)
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(maxsize=max_queue_batches)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._next_seq = 0
        self._done = threading.Condition()
        self._num_enqueued = 0  # under _done
        self._num_sent = 0  # under _done
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvtier-kv-events", daemon=True)
        self._thread.start()

    @staticmethod
    def _bind(sock: Any, endpoint: str) -> str:
        sock.bind(endpoint)
        return sock.getsockopt_string(load_zmq().LAST_ENDPOINT)

    # ------------------------------------------------------------ API

    def publish_events(self, events: Sequence[Event]) -> bool:
        """Convert kvtier events (e.g. ``TieredStore.take_events()``) and enqueue
        them as one batch. Returns ``False`` when none of them is an engine
        event (nothing is sent). Any thread; blocks only while the queue is full."""
        wire = to_wire(events, **self._wire_args)
        if not wire:
            return False
        self.publish(KVEventBatch(self._clock(), tuple(wire), self._rank))
        return True

    def publish_cleared(self) -> None:
        """Enqueue an ``AllBlocksCleared`` batch (e.g. after dropping every tier)."""
        self.publish(KVEventBatch(self._clock(), (KVAllBlocksCleared(),), self._rank))

    def publish(self, batch: KVEventBatch) -> None:
        """Enqueue ``batch``; it gets the next sequence number when sent."""
        if self._closed:
            raise RuntimeError("KVEventPublisher is closed")
        with self._done:
            self._num_enqueued += 1
        self._queue.put(batch)

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every enqueued batch was sent; ``False`` on timeout."""
        with self._done:
            target = self._num_enqueued
            return self._done.wait_for(lambda: self._num_sent >= target, timeout_s)

    @property
    def next_seq(self) -> int:
        """Sequence number the next sent batch will get."""
        return self._next_seq

    def close(self) -> None:
        """Send what is queued, stop the thread, close the sockets. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join(timeout=5.0)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def __enter__(self) -> KVEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ thread

    def _run(self) -> None:
        while True:
            if self._replay is not None:
                while self._replay.poll(0):
                    self._serve_replay()
            try:
                batch = self._queue.get(timeout=self.POLL_S)
            except queue.Empty:
                continue
            if batch is None:
                return
            seq, self._next_seq = self._next_seq, self._next_seq + 1
            payload = encode_batch(batch)
            self._buffer.append((seq, payload))
            self._send_live(seq, payload)
            with self._done:
                self._num_sent += 1
                self._done.notify_all()

    def _send_live(self, seq: int, payload: bytes) -> None:
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("kvtier KV events: ignoring a malformed replay request of %d frames", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))
