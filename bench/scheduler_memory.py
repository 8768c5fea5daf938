#!/usr/bin/env python3
"""Memory of the connector's scheduler half as sessions come and never say they ended.

Live, a session may never end in kvtier's view: a client that abandons it, the soak's
sessions (tagged in ``kv_transfer_params``, no hint server), or one named only by vLLM's
``session_id``. Every structure kvtier keeps per agent must then stop at a bound. This
drives :class:`kvtier_vllm.scheduler.KVTierScheduler` (no engine: stand-in requests and
worker reports, as ``tests/engine/test_vllm_scheduler.py`` does) through ``--sessions``
sessions of one tagged request of ``--blocks`` blocks each, every store reported done, and
reads Python's traced memory (``tracemalloc``) every ``--every`` sessions. The comparison is
within the run: growth per session before the connector's agent bound
(``MAX_TRACKED_AGENTS``) against growth per session after it, which must be about nothing.

Usage (in the vLLM venv; about a minute for the defaults)::

    .venv-vllm/bin/python bench/scheduler_memory.py --sessions 12288 --blocks 40
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
import tracemalloc
from types import SimpleNamespace


def measure(sessions: int, blocks: int, every: int, block_size: int = 16) -> list[tuple[int, float, int]]:
    """(sessions so far, traced MiB, agents the placement tracks) every ``every`` sessions."""
    from kvtier_vllm.metadata import KVTierWorkerMetadata
    from kvtier_vllm.scheduler import KVTierScheduler
    from kvtier_vllm.settings import ConnectorSettings, EngineFacts

    class Request:  # what the scheduler reads of vLLM's Request
        def __init__(self, req_id: str, session: str) -> None:
            self.request_id = req_id
            self.block_hashes = [os.urandom(32) for _ in range(blocks)]
            self.num_tokens = blocks * block_size + 2
            self.num_computed_tokens = 0
            self.kv_transfer_params = {"kvtier_session_id": session, "kvtier_agent_id": "agent",
                                       "kvtier_tool_wait_s": 1.0}
            self.session_id = None

    class BlocksOf:  # vLLM's KV cache manager, as far as the scheduler asks it
        def __init__(self) -> None:
            self.blocks: dict[str, list[int]] = {}

        def get_block_ids(self, req_id: str) -> tuple[list[int], ...]:
            return (self.blocks[req_id],)

    facts = EngineFacts("bench", "bfloat16", block_size, 2, 2, 32, "fused", "sha256")
    settings = ConnectorSettings.build({"dram_capacity_blocks": 8, "exclusive_dram": False}, facts, env={})
    sched = KVTierScheduler(settings, settings.config.namespace.to_namespace(settings.config.layout.to_layout()),
                            block_size, 1)
    kvm = BlocksOf()
    sched.bind_kv_cache_manager(kvm)
    out = []
    tracemalloc.start()
    for i in range(sessions):
        r = Request(f"r{i}", f"s{i}")
        kvm.blocks = {r.request_id: list(range(blocks + 1))}
        sched.on_new_request(r)
        sched.get_num_new_matched_tokens(r, 0)
        sched.update_state_after_alloc(r, kvm.blocks[r.request_id], 0)
        meta = sched.build_connector_meta(SimpleNamespace(num_scheduled_tokens={r.request_id: r.num_tokens},
                                                          preempted_req_ids=set()))
        sched.update_connector_output(KVTierWorkerMetadata(
            {w.plan_id: (1, [True] * len(w.rows)) for job in meta.stores for w in job.writes},
            {job.job_id: 1 for job in meta.stores}))
        sched.request_finished(r)  # its session never ends: the agent waits on a tool, never comes back
        sched.build_connector_meta(SimpleNamespace(num_scheduled_tokens={}, preempted_req_ids=set()))
        if (i + 1) % every == 0:
            gc.collect()
            out.append((i + 1, tracemalloc.get_traced_memory()[0] / 2**20, sched.placement.num_tracked_agents))
            print(f"{i + 1:>7,} sessions: {out[-1][1]:7.1f} MiB traced, {out[-1][2]:,} agents tracked", flush=True)
    tracemalloc.stop()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Compares growth per session before and after the connector's agent bound.")
    p.add_argument("--sessions", type=int, default=12288, help="sessions driven (default 12,288: 3x the bound)")
    p.add_argument("--blocks", type=int, default=40, help="blocks of each session's context (default 40)")
    p.add_argument("--every", type=int, default=1024, help="read memory every this many sessions (default 1,024)")
    args = p.parse_args(argv)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "integrations", "vllm_ascend"))
    from kvtier_vllm.settings import MAX_TRACKED_AGENTS

    start = time.monotonic()
    points = measure(args.sessions, args.blocks, args.every)
    before = [p for p in points if p[0] <= MAX_TRACKED_AGENTS]
    after = [p for p in points if p[0] >= 2 * MAX_TRACKED_AGENTS]  # (past the bound, and past a sweep or two)
    if len(before) < 2 or len(after) < 2:
        print(f"need readings before {MAX_TRACKED_AGENTS:,} and after {2 * MAX_TRACKED_AGENTS:,} sessions "
              f"(--sessions at least {3 * MAX_TRACKED_AGENTS:,})", file=sys.stderr)
        return 2

    def per_session_kib(a: tuple[int, float, int], b: tuple[int, float, int]) -> float:
        return (b[1] - a[1]) * 1024 / (b[0] - a[0])

    grow_before = per_session_kib(before[0], before[-1])
    grow_after = per_session_kib(after[0], after[-1])
    print(f"\ngrowth per session of {args.blocks} blocks: {grow_before:.2f} KiB up to the bound "
          f"({MAX_TRACKED_AGENTS:,} agents), {grow_after:.2f} KiB from {after[0][0]:,} to {after[-1][0]:,} sessions "
          f"({grow_after / grow_before if grow_before else float('nan'):.2f}x); {time.monotonic() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
