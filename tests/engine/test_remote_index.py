"""The scheduler's view of the remote tier when the store stops answering (no engine).

A dead ``mooncake_master`` left every request's remote lookup unanswered until
``REMOTE_LOOKUP_GIVE_UP_S``: each request waited 2 s before vLLM scheduled it
(``bench/chaos_serve.py``: TTFT p50 2.0 s instead of 50 ms while the master was down).
Now the first lookup that goes unanswered marks the store down: later lookups are misses
at once, one probe at a time asks the store, and the first probe answered in time brings
lookups back. The store's client here is a stand-in that blocks like a dead master's.
"""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest
from kvtier_vllm import remote_index
from kvtier_vllm.settings import ConnectorSettings, EngineFacts

from kvtier.keys import BlockKey

FACTS = EngineFacts("tiny", "bfloat16", 32, 2, 2, 32, "fused", "sha256")


class _Store:
    """``contains_many`` answers after ``delay_s`` while ``up`` is set, else blocks until it is (a dead master)."""

    def __init__(self) -> None:
        self.up = threading.Event()
        self.up.set()
        self.asked = 0
        self.delay_s = 0.0

    def contains_many(self, keys):
        self.asked += 1
        self.up.wait()
        time.sleep(self.delay_s)
        return [True] * len(keys)


@pytest.fixture
def index(monkeypatch, request):
    store = _Store()
    monkeypatch.setattr(remote_index.remoteshare, "acquire", lambda *a: store)
    monkeypatch.setattr(remote_index.remoteshare, "release", lambda client: None)
    monkeypatch.setattr(remote_index, "REMOTE_LOOKUP_GIVE_UP_S", 0.3)
    wait_ms = getattr(request, "param", 1)
    settings = ConnectorSettings.build({"remote_master": "127.0.0.1:1", "remote_lookup_wait_ms": wait_ms}, FACTS,
                                       env={})
    idx = remote_index.RemoteIndex(settings, None, Counter(), 32, None, None)
    yield idx, store
    store.up.set()
    idx.close()


def _ask(idx, req: str, keys, limit_s: float = 5.0) -> tuple[int, float]:
    """Step as the scheduler does until the lookup answers: (blocks found, seconds it took)."""
    start = time.monotonic()
    while time.monotonic() - start < limit_s:
        n = idx.hit(req, keys, 0, len(keys))
        if n is not None:
            return n, time.monotonic() - start
        time.sleep(0.01)
    raise AssertionError("the lookup never answered")


def test_a_store_that_stops_answering_makes_misses_at_once_and_is_used_again_when_it_answers(index) -> None:
    idx, store = index
    keys = [BlockKey(i) for i in range(1, 5)]
    assert _ask(idx, "r0", keys)[0] == 4
    store.up.clear()  # the master dies
    n, took = _ask(idx, "r1", keys)
    assert n == 0 and took >= 0.3  # the first one waits for the give-up, then the store counts as down
    assert idx.counters["remote_down"] == 1 and idx.counters["remote_lookup_timeouts"] == 1
    for i in range(20):  # every later request: a miss at once, never a wait
        n, took = _ask(idx, f"r{i + 2}", keys)
        assert n == 0 and took < 0.1, took
    assert idx.counters["remote_lookup_skipped_down"] == 20
    assert store.asked <= 3  # the hung question and one probe behind it: not one question per request
    store.up.set()  # the master is back: the probe is answered
    deadline = time.monotonic() + 5
    while True:
        n, _ = _ask(idx, "again", keys)
        if n == 4:
            break
        assert time.monotonic() < deadline, dict(idx.counters)
        time.sleep(0.05)
    assert idx.counters["remote_up_again"] == 1


@pytest.mark.parametrize("index", [5], indirect=True)  # remote_lookup_wait_ms (its default)
def test_a_lookup_storm_on_a_slow_store_holds_no_step_and_starts_no_thread(index) -> None:
    """A thousand new requests at once for blocks the store is slow to answer about (50 ms a question):
    each new lookup used to wait ``remote_lookup_wait_ms`` in turn, so one step took seconds. A step now
    waits at most ``STEP_LOOKUP_WAITS`` times that in all; the rest are asked without waiting and vLLM
    asks again next step. One lookup thread whatever the load, and every request answered (a miss, once
    the store counts as down) within the give-up time."""
    idx, store = index
    store.delay_s = 0.05
    keys = [BlockKey(i) for i in range(1, 5)]
    threads = threading.active_count()
    start = time.monotonic()
    answers = [idx.hit(f"r{i}", keys, 0, len(keys)) for i in range(1000)]  # one scheduling step
    took = time.monotonic() - start
    assert took < 2.5, took  # a bound, not a speed figure: 1,000 x 5 ms is 5 s, what the step took before
    assert answers.count(None) == 1000 and idx.counters["remote_lookup_unwaited"] >= 990
    assert threading.active_count() <= threads + 1
    idx.step_started()
    deadline = time.monotonic() + 5
    pending = set(range(1000))
    while pending:  # later steps: every request gets its answer, none waits past the give-up
        assert time.monotonic() < deadline, len(pending)
        idx.step_started()
        pending = {i for i in pending if idx.hit(f"r{i}", keys, 0, len(keys)) is None}
        time.sleep(0.01)
    assert idx.counters["remote_down"] == 1  # 1,000 questions at 50 ms each: given up on, the store down


_RELAY = """
import asyncio, sys

port, target, delay = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])


async def pipe(src, dst):
    try:
        while data := await src.read(1 << 16):
            await asyncio.sleep(delay)
            dst.write(data)
            await dst.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        dst.close()


async def relay(reader, writer):
    up_reader, up_writer = await asyncio.open_connection("127.0.0.1", target)
    await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))


async def main():
    server = await asyncio.start_server(relay, "127.0.0.1", port)
    print("ready", flush=True)
    await server.serve_forever()

asyncio.run(main())
"""


class _SlowLink:
    """A TCP relay in front of a real ``mooncake_master``'s RPC port that holds every chunk ``delay_s``
    before passing it on, each way: the store a long way off (a question answers ``2 x delay_s`` later
    at least). A process of its own: the store's client holds the GIL while it waits on the master."""

    def __init__(self, target_port: int, delay_s: float) -> None:
        import subprocess
        import sys

        from kvtier.benchmarks.remote import free_port

        self.port = free_port()
        self.proc = subprocess.Popen([sys.executable, "-c", _RELAY, str(self.port), str(target_port), str(delay_s)],
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "ready"

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)


def _os_threads() -> int:
    import os

    return len(os.listdir("/proc/self/task"))  # the store client's own threads too, not only Python's


def test_a_lookup_storm_on_a_slow_real_mooncake_store_holds_no_step_and_starts_no_thread(tmp_path) -> None:
    """The storm above on the real thing: a ``mooncake_master`` on loopback behind a relay that delays
    each message 25 ms each way, kvtier's real Mooncake client, a thousand new requests at once for
    blocks the store has never held. One step's thousand lookups wait at most ``STEP_LOOKUP_WAITS x
    remote_lookup_wait_ms`` in all (a bound, not a speed figure); the storm starts no thread, in Python
    or in the store's client; every request is answered within the give-up time, and once the storm is
    over the store is asked again and answers (``remote_up_again``, or it never counted as down)."""
    import os

    from kvtier.benchmarks.remote import LocalMaster, mooncake_problem

    problem = mooncake_problem()
    if problem is not None:
        if os.environ.get("KVTIERTEST_REQUIRE_VLLM") == "1":  # CI: the engine venv has the remote extra
            pytest.fail(problem)
        pytest.skip(problem)
    master = LocalMaster(tmp_path / "master.log").start()
    link = _SlowLink(master.rpc, 0.025)
    idx = None
    try:
        settings = ConnectorSettings.build({"remote_master": f"127.0.0.1:{link.port}",
                                            "remote_metadata_server": master.metadata_server,
                                            "remote_segment_mib": 16, "remote_buffer_mib": 8,
                                            "remote_lookup_wait_ms": 5}, FACTS, env={})
        namespace = settings.config.namespace.to_namespace(settings.config.layout.to_layout())
        idx = remote_index.RemoteIndex(settings, namespace, Counter(), 32, None, None)
        keys = [BlockKey(i) for i in range(1, 5)]
        assert _ask(idx, "warm", keys, limit_s=10)[0] == 0  # the client joined; its threads are up
        threads = _os_threads()
        idx.step_started()
        start = time.monotonic()
        answers = [idx.hit(f"r{i}", keys, 0, len(keys)) for i in range(1000)]  # one scheduling step
        took = time.monotonic() - start
        assert took < 2.5, took  # each lookup waiting its 5 ms in turn would hold this step 5 s
        assert answers.count(None) >= 990 and idx.counters["remote_lookup_unwaited"] >= 990, dict(idx.counters)
        assert _os_threads() <= threads + 1, (threads, _os_threads())
        deadline = time.monotonic() + remote_index.REMOTE_LOOKUP_GIVE_UP_S + 3
        pending = {i for i, n in enumerate(answers) if n is None}
        while pending:  # later steps: every request answered (a miss), none waiting past the give-up
            assert time.monotonic() < deadline, (len(pending), dict(idx.counters))
            idx.step_started()
            pending = {i for i in pending if idx.hit(f"r{i}", keys, 0, len(keys)) is None}
            time.sleep(0.01)
        assert _os_threads() <= threads + 1
        deadline = time.monotonic() + 30  # the storm is over: a probe is answered and lookups come back
        while _ask(idx, f"after{time.monotonic()}", keys, limit_s=10)[1] > 1.0 or \
                idx.counters["remote_down"] > idx.counters["remote_up_again"]:
            assert time.monotonic() < deadline, dict(idx.counters)
            time.sleep(0.2)
    finally:
        if idx is not None:
            idx.close()
        link.close()
        master.stop()
