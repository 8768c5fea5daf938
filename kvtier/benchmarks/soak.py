"""Memory soak loops: TierManager churn and a live hint stream, with RSS sampled.

Owns: two measurement loops and their RSS figures, shared by the fault suite
(``tests/fault/test_fault_memory.py``, CI-sized) and ``bench/soak.py`` (the
10-minute version). Each returns a :class:`SoakResult`: RSS at the end of the
warm-up (caches and bounded tables full) and at the end, the largest sample
after warm-up, and the structure sizes that must stay bounded. Must not
assert (callers decide the bound) and must not import torch.

RSS is read from ``/proc/self/statm`` (Linux); the hint stream runs server
and client in this process, so its RSS covers both.
"""

from __future__ import annotations

import asyncio
import os
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


def rss_bytes() -> int:
    """Resident set size of this process."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@dataclass(slots=True)
class SoakResult:
    """RSS figures of one soak loop (bytes) and what it did."""

    name: str
    num_ops: int
    wall_s: float
    rss_after_warmup_bytes: int
    rss_end_bytes: int
    rss_max_after_warmup_bytes: int
    sizes: dict[str, int] = field(default_factory=dict)

    @property
    def growth_bytes(self) -> int:
        """Largest RSS after warm-up minus RSS at the end of warm-up."""
        return self.rss_max_after_warmup_bytes - self.rss_after_warmup_bytes

    def describe(self) -> str:
        mib = 1 << 20
        return (f"{self.name}: {self.num_ops} ops in {self.wall_s:.1f} s; RSS after warm-up "
                f"{self.rss_after_warmup_bytes / mib:.1f} MiB, end {self.rss_end_bytes / mib:.1f} MiB, "
                f"max {self.rss_max_after_warmup_bytes / mib:.1f} MiB, growth {self.growth_bytes / mib:+.2f} MiB; "
                + ", ".join(f"{k}={v}" for k, v in self.sizes.items()))


class _Sampler:
    def __init__(self, warmup_fraction: float) -> None:
        self.warmup_fraction = warmup_fraction
        self.after_warmup: int | None = None
        self.max_after = 0

    def sample(self, progress: float) -> None:
        rss = rss_bytes()
        if self.after_warmup is None:
            if progress >= self.warmup_fraction:
                self.after_warmup = rss
                self.max_after = rss
        else:
            self.max_after = max(self.max_after, rss)


def manager_churn(num_ops: int = 1_000_000, *, seed: int = 0, warmup_fraction: float = 0.2,
                  num_chains: int = 50_000, blocks_per_chain: int = 8) -> SoakResult:
    """``num_ops`` TierManager operations over three tiers (512 / 4096 / 16384
    blocks): chain stores, lookups, two-phase loads, demotions to ssd,
    promotions, explicit evictions, removals, pins and releases, drawn from a
    skewed population of ``num_chains`` chains so tiers stay full and evict.
    Events are drained as the store does. Each manager call counts as an op."""
    from ..keys import BlockKey
    from ..manager import TierManager, TierSpec

    rng = random.Random(seed)
    m = TierManager([TierSpec("hbm", 512), TierSpec("dram", 4096), TierSpec("ssd", 16384)], pin_budget_blocks=256)
    sampler = _Sampler(warmup_fraction)
    chains = [[BlockKey((c << 8) | i) for i in range(blocks_per_chain)] for c in range(num_chains)]
    ops = 0
    t0 = time.perf_counter()
    next_sample = 0
    step = max(1, num_ops // 50)

    def pick() -> list[BlockKey]:
        return chains[min(int(rng.paretovariate(1.1)) - 1, num_chains - 1) if rng.random() < 0.7
                      else rng.randrange(num_chains)]

    while ops < num_ops:
        if ops >= next_sample:
            sampler.sample(ops / num_ops)
            next_sample += step
        keys = pick()
        r = rng.random()
        if r < 0.30:
            tier = "hbm" if r < 0.12 else "dram" if r < 0.24 else "ssd"
            plan = m.prepare_store(tier, keys)
            if plan is not None:
                m.complete_store(plan, rng.random() > 0.01)  # 1% of stores fail
            ops += 2
        elif r < 0.55:
            m.lookup(keys)
            ops += 1
        elif r < 0.75:
            plan = m.prepare_load(keys)
            if plan is not None:
                m.complete_load(plan, rng.random() > 0.005)  # 0.5% fail verification
            ops += 2
        elif r < 0.85:
            src, dst = ("dram", "ssd") if r < 0.82 else ("ssd", "dram")
            plan = m.prepare_move(keys, src, dst)
            if plan is not None:
                m.complete_move(plan, True)
            ops += 2
        elif r < 0.90:
            m.evict(rng.choice(("hbm", "dram", "ssd")), 8)
            ops += 1
        elif r < 0.94:
            m.remove(keys, rng.choice((None, "hbm", "dram", "ssd")))
            ops += 1
        elif r < 0.97:
            known = [k for k in keys if m.contains(k)]
            if known:
                m.acquire(known)
                m.release(known)
            ops += 2
        else:
            m.pin(keys[:2], ttl_s=0.01)
            m.unpin(keys[:1])
            ops += 2
        if ops % 1024 < 2:
            m.take_events()
    m.take_events()
    sampler.sample(1.0)
    m.check_invariants()
    sizes = {f"{t}_used_blocks": m.used_blocks(t) for t in m.tier_names}
    sizes["index_nodes"] = m.num_indexed()
    sizes["open_plans"] = m.num_open_plans()
    return SoakResult("manager churn", ops, time.perf_counter() - t0, sampler.after_warmup or 0, rss_bytes(),
                      sampler.max_after, sizes)


TOOLS = ("search", "python", "browser", "shell")
AGENT_TYPES = ("planner", "coder", "critic")


def hint_stream(duration_s: float = 30.0, *, warmup_fraction: float = 0.3, dedupe_window_events: int | None = None,
                progress: Callable[[str], None] | None = None) -> SoakResult:
    """Stream complete agent sessions (start, agents, requests with block keys,
    tool calls, dependencies, ends) from a :class:`~kvtier.sdk.HintClient` to a
    :class:`~kvtier.hints.server.HintServer` in this process for
    ``duration_s``; RSS covers both. ``dedupe_window_events`` shrinks the
    server's duplicate-detection window (default: the server's default) so a
    short run reaches steady state."""
    from ..hints.apply import HintLimits
    from ..hints.server import HintServer
    from ..sdk import HintClient

    limits = HintLimits() if dedupe_window_events is None else HintLimits(dedupe_window_events=dedupe_window_events)
    box: dict[str, Any] = {}
    ready = threading.Event()

    def serve() -> None:
        async def main() -> None:
            server = HintServer(limits=limits)
            box["server"] = server
            box["address"] = await server.start("127.0.0.1:0")
            box["loop"] = asyncio.get_running_loop()
            box["stop"] = asyncio.Event()
            ready.set()
            await box["stop"].wait()
            await server.stop(0.2)

        asyncio.run(main())

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    if not ready.wait(30):
        raise RuntimeError("hint server did not start")
    client = HintClient(box["address"], client_id="soak", max_queue_events=8192)
    sampler = _Sampler(warmup_fraction)
    t0 = time.perf_counter()
    end = t0 + duration_s
    next_sample = t0
    i = 0
    try:
        while (now := time.perf_counter()) < end:
            if now >= next_sample:
                sampler.sample((now - t0) / duration_s)
                next_sample = now + 0.5
                if progress is not None and i % 50 == 0:
                    progress(f"hint stream: {now - t0:.0f}/{duration_s:.0f} s, {client.stats().accepted} events")
            _one_session(client, i)
            i += 1
            while client.stats().queued > 1024 and time.perf_counter() < end:
                time.sleep(0.001)  # let the sender catch up: measure memory, not drops
        client.flush(30)
        stats = client.stats()
        sampler.sample(1.0)

        async def sizes() -> dict[str, int]:
            server = box["server"]
            g = server.graph
            return {"sessions_left": g.num_sessions, "agents_left": g.num_agents,
                    "tool_calls_left": g.num_tool_calls, "dedupe_window": server.applier.dedupe_size,
                    "events_accepted": stats.accepted, "events_dropped": stats.num_dropped,
                    "events_rejected": stats.rejected, **{f"dropped_{k}": v for k, v in stats.dropped.items() if v}}

        result_sizes = asyncio.run_coroutine_threadsafe(sizes(), box["loop"]).result(10)
    finally:
        client.close(5)
        box["loop"].call_soon_threadsafe(box["stop"].set)
        thread.join(10)
    return SoakResult("hint stream", stats.accepted, time.perf_counter() - t0, sampler.after_warmup or 0,
                      rss_bytes(), sampler.max_after, result_sizes)


def _one_session(client: Any, i: int) -> None:
    sid = f"soak-{i}"
    emit = client.emit
    emit("session_start", session_id=sid, model="m")
    emit("agent_spawn", session_id=sid, agent_id="root", agent_type=AGENT_TYPES[i % 3])
    for a in range(2):
        aid = f"sub{a}"
        emit("agent_spawn", session_id=sid, agent_id=aid, parent_agent_id="root", agent_type=AGENT_TYPES[a])
        emit("dependency", session_id=sid, from_agent_id=aid, to_agent_id="root")
        emit("request_start", session_id=sid, agent_id=aid, request_id="r0",
             prompt_block_keys=[(i << 8) | b for b in range(16)], num_prompt_tokens=256)
        emit("request_end", session_id=sid, agent_id=aid, request_id="r0", num_output_tokens=32)
        emit("tool_call_start", session_id=sid, agent_id=aid, tool_call_id="t0", tool_name=TOOLS[(i + a) % 4],
             expected_duration_s=0.5)
        emit("tool_call_end", session_id=sid, agent_id=aid, tool_call_id="t0", status="ok")
        emit("agent_end", session_id=sid, agent_id=aid, status="completed")
    emit("agent_end", session_id=sid, agent_id="root", status="completed")
    emit("session_end", session_id=sid)
