"""KV cache groups (vLLM's hybrid KV cache manager) as lanes of keys: what a hybrid
model's hit, load and store cover in each group.

Owns: the groups' windows (0: full attention; else the blocks a sliding window
reads before a reuse point), the primary group (the first full-attention one:
its keys are the request's keys, for placement, recording and KV events), each
other group's keys (chained in a namespace of its own, kept on the request's
record), and the loads of a hybrid model in flight (a token block is a hit only
if every group's blocks loaded). Must not import vLLM or move bytes: the
scheduler plans and sends the jobs, with the block ids vLLM gives it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from kvtier.keys import BlockKey, Namespace, chain_foreign_keys
from kvtier.manager import LoadPlan, TierManager
from kvtier.tiers.lossy import LossyCopies

from .metadata import LoadJob

Units = list[tuple[list[BlockKey], BlockKey | None, bool]]
"""Runs of keys to store: (keys, the key before them, chained)."""
StoreRuns = Callable[[list[BlockKey], BlockKey | None], list[tuple[list[BlockKey], BlockKey | None]]]


class HybridLanes:
    """The KV cache groups' lanes (see the module doc); one group (``(0,)``) is not hybrid.
    ``keys_of(st)``: the primary group's keys of a request's full blocks."""

    def __init__(self, window_blocks: Sequence[int], namespace: Namespace, manager: TierManager,
                 counters: Counter[str], lossy: LossyCopies, block_size: int,
                 keys_of: Callable[[Any], list[BlockKey]]) -> None:
        self.windows = tuple(window_blocks)
        self.hybrid = len(self.windows) > 1
        self.primary = self.windows.index(0)
        self._ns = {g: replace(namespace, tenant=f"{namespace.tenant}\x1fkv-cache-group-{g}")
                    for g in range(len(self.windows)) if g != self.primary}
        self.manager = manager
        self.counters = counters
        self.lossy = lossy
        self.block_size = block_size
        self._keys_of = keys_of
        self.loads: dict[int, tuple[int, int]] = {}  # load plan id -> (token blocks offered, blocks read)

    @property
    def hold_groups(self) -> tuple[int, tuple[tuple[int, int], ...]]:
        """(primary group, (group, window) of each other) for the placement's HBM holds."""
        return self.primary, tuple((g, w) for g, w in enumerate(self.windows) if g != self.primary)

    def hit(self, st: Any, start: int, max_blocks: int) -> int:
        """Blocks of a hybrid model's hit past block ``start``: the longest run every
        full-attention group holds, cut back until every sliding-window group
        holds its window before the hit point (its blocks before ``start`` are
        vLLM's own hit, in HBM)."""
        end = max_blocks
        for g, w in enumerate(self.windows):
            if not w:
                end = min(end, start + self.manager.lookup(self.keys(st, g)[start:end]).num_blocks)
        while end > start and not all(self._window_held(st, g, w, start, end) for g, w in enumerate(self.windows) if w):
            end -= 1
        return max(0, end - start)

    def _window_held(self, st: Any, lane: int, window: int, start: int, end: int) -> bool:
        keys = self.keys(st, lane)[max(start, end - window):end]
        return self.manager.lookup(keys).num_blocks == len(keys)

    def blocks(self, st: Any, start: int, end: int) -> list[tuple[int, int, list[BlockKey]]]:
        """Per KV cache group, primary first: (group, first block, keys of blocks
        ``first:end``) to move for blocks ``start:end``: every block of a
        full-attention group, the window before ``end`` of a sliding-window one."""
        order = [self.primary] + [g for g in range(len(self.windows)) if g != self.primary]
        out = []
        for g in order:
            lo = start if not self.windows[g] else max(start, end - self.windows[g])
            out.append((g, lo, self.keys(st, g)[lo:end]))
        return out

    def keys(self, st: Any, lane: int) -> list[BlockKey]:
        """Keys of the request's full blocks in KV cache group ``lane`` (the primary
        group's are ``keys_of``'s; another group's chain in a namespace of its own)."""
        if lane == self.primary:
            return self._keys_of(st)
        keys = st.lane_keys.setdefault(lane, [])
        hashes = st.request.block_hashes
        if len(hashes) > len(keys):
            keys.extend(chain_foreign_keys(self._ns[lane], hashes[len(keys):], keys[-1] if keys else None))
        return keys

    def load_job(self, st: Any, start: int, n: int,
                 group_block_ids: Sequence[Sequence[int]]) -> tuple[LoadJob, LoadPlan | None]:
        """A hybrid model's load of blocks ``start:start + n``: every group's blocks in
        one job, primary group first; sliding-window groups only inside the window."""
        keys: list[BlockKey] = []
        targets: list[int] = []
        for g, lo, lane in self.blocks(st, start, start + n):
            keys += lane
            targets += group_block_ids[g][lo : start + n]
            if self.windows[g]:
                self.counters["load_window_skipped_blocks"] += n - len(lane)
        plan = self.manager.prepare_load(keys)
        req_id = st.request.request_id
        if plan is None:
            return LoadJob(req_id, 0, (), (), (), tuple(targets)), None
        self.loads[plan.plan_id] = (n, len(keys))
        return LoadJob(req_id, plan.plan_id, plan.keys, plan.tiers,
                       tuple(s if t != "ssd" else 0 for s, t in zip(plan.slots, plan.tiers)), tuple(targets)), plan

    def complete_load(self, plan_id: int, plan: LoadPlan, oks: list[bool]) -> None:
        """A hybrid model's load: its token blocks are hits only if every group's
        blocks loaded (vLLM recomputes a request whose load failed in full)."""
        n, total = self.loads.pop(plan_id)
        self.manager.complete_load(plan, oks)
        if len(oks) == total and all(oks):
            for tier in plan.tiers[:n]:  # the primary group's blocks come first
                self.counters[f"hit_tokens_{tier}"] += self.block_size
            self.counters["hit_tokens"] += n * self.block_size
        else:
            self.counters["load_failed_requests"] += 1
        self.counters["load_failed_blocks"] += total - sum(oks)

    def store_units(self, st: Any, start: int, upto: int, groups: Sequence[Sequence[int]],
                    store_runs: StoreRuns) -> tuple[Units, list[BlockKey], list[int], list[BlockKey | None]]:
        """What a hybrid model stores of blocks ``start:upto``: the runs per group (a sliding
        window's blocks are independent, stored only inside it), and per row of the job its
        key, engine block id (``groups``: vLLM's per group) and chain parent."""
        units: Units = []
        new: list[BlockKey] = []
        ids: list[int] = []
        parents: list[BlockKey | None] = []
        for g, lo, lane in self.blocks(st, start, upto):
            if self.windows[g]:  # a window: independent blocks, stored only inside it
                self.counters["store_window_skipped_blocks"] += upto - start - len(lane)
                kept = [k for k, ok in zip(lane, self.lossy.storable(lane)) if ok]
                units += [(kept, None, False)] if kept else []
                lane_parents: list[BlockKey | None] = [None] * len(lane)
            else:
                before = self.keys(st, g)[start - 1] if start else None
                units += [(run, b, True) for run, b in store_runs(lane, before)]
                lane_parents = [before, *lane[:-1]]
            new += lane
            ids += groups[g][lo:upto]
            parents += lane_parents
        return units, new, ids, parents
