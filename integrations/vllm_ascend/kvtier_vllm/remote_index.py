"""What the scheduler knows of the remote tier (a Mooncake Store shared by engines).

Owns: the store's client (shared with rank 0's worker in one process), the
lookup thread and the questions in flight on it (which of a request's blocks
past the local hits the store holds), the keys known to be in the store (not
written again; at most ``REMOTE_KNOWN_MAX``), the keys whose remote load failed
(not offered again for ``REMOTE_FAILED_TTL_S``: vLLM reschedules a failed load,
and the store would answer "present" again), the remote writes in flight (plan
ids below 0, apart from the manager's) and their outcome, and whether the store
is down: after a lookup that failed or went unanswered for
``REMOTE_LOOKUP_GIVE_UP_S``, every request's lookup is a miss at once
(``remote_lookup_skipped_down``) while one small probe at a time asks the store
again; the first probe answered in time brings lookups back (``remote_up_again``).
Without that, a dead master held every request ``REMOTE_LOOKUP_GIVE_UP_S``
(TTFT 2 s instead of 50 ms in ``bench/chaos_serve.py``). Must not wait on the
store on the scheduler's step for longer than ``remote_lookup_wait_ms`` per
new lookup, nor ``STEP_LOOKUP_WAITS`` times that in all in one step (a lookup
storm: thousands of new requests at once, each waiting in turn, held one step
for seconds; past the budget a new question is asked without waiting, and vLLM
asks again next step), move bytes (the workers do), or import vLLM.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

from kvtier.keys import BlockKey, Namespace
from kvtier.tiers.lossy import LossyCopies

from . import remoteshare
from .kv_events import TierEvents
from .settings import ConnectorSettings

log = logging.getLogger(__name__)

REMOTE_LOOKUP_GIVE_UP_S = 2.0  # a store that has not answered by then counts as a miss (remote_lookup_timeouts)
REMOTE_KNOWN_MAX = 1 << 20  # keys remembered as in the remote store (not written again)
REMOTE_FAILED_TTL_S = 60.0  # a key whose remote load failed is not offered again for this long
REMOTE_FAILED_MAX = 1 << 16
REMOTE_PROBE_EVERY_S = 0.5  # while the store is down: at most one probe started this often
STEP_LOOKUP_WAITS = 4  # a step waits for the store at most this many remote_lookup_wait_ms in all

RemotePlan = tuple[int, str, Sequence[BlockKey], Sequence[int]]
"""(plan id, tier, keys, slots) of a write, as the scheduler's store plans are."""


@dataclass(slots=True)
class _Lookup:
    """A question to the remote store in flight: which of blocks ``lo:hi`` it holds."""

    lo: int
    hi: int
    future: Future[list[bool]]
    started_s: float
    keys: tuple[BlockKey, ...] = ()


class RemoteIndex:
    """The remote tier as the scheduler sees it (see the module doc); built only with ``settings.remote``."""

    def __init__(self, settings: ConnectorSettings, namespace: Namespace, counters: Counter[str], block_size: int,
                 lossy: LossyCopies, events: TierEvents) -> None:
        assert settings.remote is not None
        self.settings = settings.remote
        self.counters = counters
        self.block_size = block_size
        self.lossy = lossy
        self.events = events
        self._lookups: dict[str, _Lookup] = {}
        self.known: OrderedDict[BlockKey, None] = OrderedDict()  # in the store: not written again
        self._failed: OrderedDict[BlockKey, float] = OrderedDict()  # key whose load failed -> until when not offered
        self.writes: dict[int, tuple[list[BlockKey], list[Any]]] = {}  # plan id -> (keys, their KV-event metadata)
        self._ids = itertools.count(-1, -1)
        self.client: Any = remoteshare.acquire(settings.remote, namespace, settings.config.layout.to_layout())
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvtier-remote-lookup")
        self._down_s: float | None = None  # since when the store counts as down (None: up)
        self._probe: tuple[float, Future[float]] | None = None  # (started, future of its answer time) while down
        self._step_wait_left_s = 0.0  # what this step may still wait for answers (step_started)
        self.step_started()

    def step_started(self) -> None:
        """A new scheduling step: its lookups may wait for the store again (``STEP_LOOKUP_WAITS``)."""
        self._step_wait_left_s = STEP_LOOKUP_WAITS * self.settings.lookup_wait_s

    def next_id(self) -> int:
        """A plan id of the remote tier (below 0: apart from the manager's)."""
        return next(self._ids)

    @property
    def open(self) -> bool:
        """Until :meth:`close`: the store is asked and written (writes in flight still complete)."""
        return self.client is not None

    def close(self) -> None:
        """Stop the lookup thread and give the store's client back."""
        self._pool.shutdown(wait=True)
        remoteshare.release(self.client)
        self.client = None

    def hit(self, req_id: str, keys: list[BlockKey], lo: int, hi: int) -> int | None:
        """How many of blocks ``lo:hi`` the remote store holds, as a leading run;
        ``None`` while its answer is still out. The question goes to the lookup
        thread; this step waits at most ``remote_lookup_wait_ms`` for it (nothing once the step
        has waited ``STEP_LOOKUP_WAITS`` times that). While the store is down: 0 at once (see
        the module doc)."""
        if self._down_s is not None and self._still_down(keys[lo:hi]):
            self._lookups.pop(req_id, None)
            self.counters["remote_lookup_skipped_down"] += 1
            return 0
        q = self._lookups.get(req_id)
        wait = 0.0
        if q is None or (q.lo, q.hi, q.keys) != (lo, hi, tuple(keys[lo:hi])):  # (approximate keys can change)
            q = self._lookups[req_id] = _Lookup(
                lo, hi, self._pool.submit(self.client.contains_many, keys[lo:hi]), time.monotonic(), tuple(keys[lo:hi]))
            self.counters["remote_lookups"] += 1
            wait = max(0.0, min(self.settings.lookup_wait_s, self._step_wait_left_s))
            if wait < self.settings.lookup_wait_s:
                self.counters["remote_lookup_unwaited"] += 1  # past the step's budget: answered next step
        waited = time.monotonic()
        try:
            found = q.future.result(timeout=wait)
        except FutureTimeout:
            if time.monotonic() - q.started_s < REMOTE_LOOKUP_GIVE_UP_S:
                self.counters["remote_lookup_deferred"] += 1
                return None
            self.counters["remote_lookup_timeouts"] += 1
            self._went_down("no answer in %.1f s" % REMOTE_LOOKUP_GIVE_UP_S)
            found = []
        except Exception as exc:  # the store's client failing is a miss, never a failed step
            log.warning("kvtier: remote lookup failed: %s", exc)
            self.counters["remote_errors"] += 1
            self._went_down(str(exc))
            found = []
        finally:
            self._step_wait_left_s -= time.monotonic() - waited
        self._lookups.pop(req_id, None)  # (gone already when this lookup took the store down)
        n = found.index(False) if False in found else len(found)
        if self._failed:
            now = time.monotonic()
            for i, key in enumerate(keys[lo : lo + n]):
                until = self._failed.get(key)
                if until is not None and until > now:
                    n = i
                    self.counters["remote_lookup_failed_skips"] += 1
                    break
        for key in keys[lo + n : lo + len(found)]:  # gone from the store (evicted, or the master restarted)
            self.known.pop(key, None)
        return n

    def _went_down(self, why: str) -> None:
        if self._down_s is None:
            self._down_s = time.monotonic()
            self.counters["remote_down"] += 1
            for q in self._lookups.values():  # questions queued behind the unanswered one are not asked
                q.future.cancel()
            self._lookups.clear()
            log.warning("kvtier: remote store down (%s): its lookups are misses until a probe is answered", why)

    def _still_down(self, keys: Sequence[BlockKey]) -> bool:
        """Whether the store still counts as down; starts a probe (of one of ``keys``) when none is out."""
        now = time.monotonic()
        if self._probe is not None and self._probe[1].done():
            started, probe = self._probe
            self._probe = None
            if probe.exception() is None and probe.result() < REMOTE_LOOKUP_GIVE_UP_S:
                log.warning("kvtier: remote store answering again after %.1f s", now - (self._down_s or now))
                self._down_s = None
                self.counters["remote_up_again"] += 1
                return False
            self._probe = (started, probe) if now - started < REMOTE_PROBE_EVERY_S else None
        if self._probe is None and keys:
            self._probe = (now, self._pool.submit(self._timed_contains, keys[:1]))
        return True

    def _timed_contains(self, keys: Sequence[BlockKey]) -> float:
        """A probe on the lookup thread: seconds the store took to answer."""
        start = time.monotonic()
        self.client.contains_many(keys)
        if getattr(self.client, "down", False):  # the client skipped the call, or it failed: not an answer
            raise ConnectionError("the store's client counts the store as down")
        return time.monotonic() - start

    def forget_lookup(self, req_id: str) -> None:
        """The request ended: its question in flight, if any, is not asked again."""
        self._lookups.pop(req_id, None)

    def plan_write(self, new: list[BlockKey], cold: str | None) -> RemotePlan | None:
        """A write of the blocks of ``new`` the store may not hold (a lossy copy is never
        written; ``cold``: the lossy codec they are written with, if any)."""
        remote = [k for k, ok in zip(new, self.lossy.storable(new)) if ok and k not in self.known]
        if not remote:
            return None
        if cold:
            self.lossy.wrote("remote", remote)
        pid = self.next_id()
        self.writes[pid] = (remote, self.events.meta_of(remote))
        return pid, "remote", remote, (0,) * len(remote)

    def complete_write(self, plan_id: int, oks: list[bool]) -> None:
        """Every worker reported remote write ``plan_id``: count it, remember the keys written
        (not written again) and, with KV events on, publish them. A failed write makes this
        engine forget what it knew of the store (it may have restarted empty)."""
        keys, meta = self.writes.pop(plan_id)
        good = [k for k, ok in zip(keys, oks) if ok]
        self.counters["stored_blocks_remote"] += len(good)
        self.counters["store_failed_blocks_remote"] += len(keys) - len(good)
        if len(good) < len(keys):
            self.known.clear()
        self._remember(good)
        for key in good:  # a fresh, complete value: offer it again
            self._failed.pop(key, None)
        self.events.remote_stored(meta, oks)

    def loaded(self, keys: tuple[BlockKey, ...], num_ok: int, num_failed: int) -> None:
        """A load's remote run ``keys`` completed: its first ``num_ok`` blocks loaded (below 0:
        the local run before it failed), then ``num_failed`` blocks failed from the first bad one."""
        if num_ok > 0:
            self.counters["hit_tokens_remote"] += num_ok * self.block_size
            self._remember(keys[:num_ok])
        if num_failed > 0 and num_ok >= 0:
            self.counters["remote_load_failed_blocks"] += num_failed
            bad = keys[num_ok]  # the blocks after it failed with it
            self.known.pop(bad, None)
            self._failed[bad] = time.monotonic() + REMOTE_FAILED_TTL_S
            self._failed.move_to_end(bad)
            while len(self._failed) > REMOTE_FAILED_MAX:
                self._failed.popitem(last=False)

    def _remember(self, keys: Iterable[BlockKey]) -> None:
        known = self.known
        for key in keys:
            known[key] = None
            known.move_to_end(key)
        while len(known) > REMOTE_KNOWN_MAX:
            known.popitem(last=False)

    def stats(self) -> dict[str, Any]:
        """The store client's own outcomes (shared with rank 0's worker in one process)."""
        return {"master": self.settings.master, "counters": dict(self.client.counters), "known_blocks": len(self.known)}
