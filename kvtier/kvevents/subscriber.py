"""Consume an engine's KV events (vLLM wire format) with gap recovery.

Owns: the SUB and replay (DEALER) sockets, the expected sequence number, and
filling gaps from the publisher's replay buffer. Must not interpret events
(see :class:`~kvtier.kvevents.hbm_view.HBMView`). Not thread-safe: one owner
calls :meth:`KVEventSubscriber.poll`.

Delivery: :meth:`poll` returns batches in sequence order, each once. When a
live message skips numbers, the missing ones are requested from the replay
socket (``(b"", start_seq)``; replies end with ``END_SEQ``) and delivered
first; numbers the publisher no longer buffers are counted in
``stats["lost_batches"]`` and skipped.
"""

from __future__ import annotations

import time
from collections import Counter

from .publisher import load_zmq
from .wire import END_SEQ, KVEventBatch, decode_batch


class KVEventSubscriber:
    """Subscribes to ``endpoint`` (the engine's PUB) and, for gaps, asks
    ``replay_endpoint`` (its ROUTER). ``start_seq`` (e.g. 0) makes the first
    poll catch up from that sequence number through the replay socket;
    ``None`` starts at whatever arrives first."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, *, topic: str = "",
                 start_seq: int | None = None, replay_timeout_s: float = 2.0) -> None:
        zmq = load_zmq()
        self._zmq = zmq
        self._ctx = zmq.Context.instance()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sub.connect(endpoint)
        self._replay = None
        if replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.DEALER)
            self._replay.connect(replay_endpoint)
        self._expected = start_seq
        self._replay_timeout_s = replay_timeout_s
        self.stats: Counter[str] = Counter()

    @property
    def expected_seq(self) -> int | None:
        """The next sequence number to deliver (``None`` before the first)."""
        return self._expected

    def poll(self, timeout_s: float = 0.0) -> list[tuple[int, KVEventBatch]]:
        """Receive what has arrived (waiting up to ``timeout_s`` for the first
        message) and return ``(seq, batch)`` in order, gaps filled where the
        replay buffer allows."""
        out: list[tuple[int, KVEventBatch]] = []
        wait_ms = int(timeout_s * 1000)
        while self._sub.poll(wait_ms):
            wait_ms = 0
            frames = self._sub.recv_multipart()
            if len(frames) != 3 or len(frames[1]) != 8:
                self.stats["malformed"] += 1
                continue
            self._receive(int.from_bytes(frames[1], "big"), frames[2], out)
        return out

    def _receive(self, seq: int, payload: bytes, out: list[tuple[int, KVEventBatch]]) -> None:
        self.stats["received"] += 1
        if self._expected is None:
            self._expected = seq
        if seq > self._expected:
            self.stats["gaps"] += 1
            self._fill(seq, out)
        if seq < self._expected:
            self.stats["duplicates"] += 1
            return
        out.append((seq, decode_batch(payload)))
        self._expected = seq + 1

    def catch_up(self) -> list[tuple[int, KVEventBatch]]:
        """Batches the publisher still buffers from the expected sequence number on,
        through the replay socket, in order: what a subscriber that joins late
        missed (live messages it already has are not delivered twice). Nothing
        without a replay socket or a ``start_seq``."""
        out: list[tuple[int, KVEventBatch]] = []
        if self._replay is not None and self._expected is not None:
            self._fill(None, out)
        return out

    def _fill(self, upto: int | None, out: list[tuple[int, KVEventBatch]]) -> None:
        """Deliver ``[expected, upto)`` (everything buffered for ``None``) from the
        replay socket; skip what it lacks."""
        if self._replay is not None:
            for seq, payload in self._request_replay(self._expected):
                if seq < self._expected or (upto is not None and seq >= upto):
                    continue  # already delivered, or will arrive live
                if seq > self._expected:
                    self.stats["lost_batches"] += seq - self._expected
                out.append((seq, decode_batch(payload)))
                self._expected = seq + 1
                self.stats["replayed"] += 1
        if upto is not None and self._expected < upto:
            self.stats["lost_batches"] += upto - self._expected
            self._expected = upto

    def _request_replay(self, start_seq: int) -> list[tuple[int, bytes]]:
        self._replay.send_multipart((b"", start_seq.to_bytes(8, "big")))
        got: list[tuple[int, bytes]] = []
        deadline = time.monotonic() + self._replay_timeout_s
        while True:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0 or not self._replay.poll(left_ms):
                self.stats["replay_timeouts"] += 1
                return got
            frames = self._replay.recv_multipart()
            if len(frames) != 4:
                self.stats["malformed"] += 1
                continue
            _, _, seq_bytes, payload = frames
            if seq_bytes == END_SEQ:
                return got
            got.append((int.from_bytes(seq_bytes, "big"), payload))

    def close(self) -> None:
        """Close both sockets. Idempotent."""
        self._sub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def __enter__(self) -> KVEventSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
