"""The modelled engine's admission: which waiting request gets HBM, with which loads.

Owns: the admission pass over the wait queue (``max_running``, the token
budget of scheduler ``vllm``, requests deferred while their blocks are still
on their way down), the HBM fit check an engine makes before it allocates,
and one request's admission: the cached prefix it uses (the policy may
recompute rather than load), the moves into HBM, the store plan of the blocks
it computes, its decode reserve, the reference that protects its prefix, and
under scheduler ``vllm`` the blocks other prefilling requests already compute.
Must not step the batch or decide placement: loads are modelled through the
simulator's mover, and load or recompute is the replay's load rule's
(:mod:`kvtier.placement.loadrule`: by default the surface's, which asks the
policy's ``should_load`` on ``full``). The order of
the queue is :mod:`kvtier.replay.admission`'s.
"""

from __future__ import annotations

import math
from itertools import chain, compress
from typing import TYPE_CHECKING, Any, NamedTuple, Sequence

from ..keys import BlockKey
from ..placement.loadrule import make_load_rule

if TYPE_CHECKING:
    from .runs import Run
    from .state import SimState

HBM = 0  # the index of HBM in a lookup's tier names


class _Plan(NamedTuple):
    """What one admission reserved: rolled back whole when any part fails."""

    moves: list[Any]  # promotions into HBM, per source tier
    tail: BlockKey | None  # the referenced deepest ready HBM block
    store_plan: Any  # the blocks it computes into HBM
    n_sched: int  # blocks other prefilling requests compute for it (scheduler "vllm")
    reserve: int  # decode blocks reserved


class Admission:
    """The simulator's admission (see the module doc)."""

    def __init__(self, sim: "SimState", vllm_scheduler: bool) -> None:
        self.sim = sim
        self.vllm = vllm_scheduler
        self.deferred: list[tuple["Run", Any]] = []  # taken off the queue's head during one pass
        # scheduler "vllm": the blocks prefilling runs store in HBM, by key: (run, position in its keys)
        self.prefill_owner: dict[BlockKey, tuple["Run", int]] = {}
        self.num_holding = 0  # scheduler "vllm": runs in sim.prefilling that are ``holding``
        self.load_rule = make_load_rule(sim.cfg.load_rule)

    # ------------------------------------------------------------ the pass

    def admit_waiting(self) -> None:
        sim = self.sim
        budget = self.plan_running() if self.vllm else 1
        if sim.admission_blocked:
            return
        deferred = self.deferred  # skipped this pass, keeping their places (a surface's defer_loads)
        while sim.waiting and self.num_running() < sim.cfg.max_running and budget > 0:
            run = sim.waiting.head()
            if self.load_not_ready(run):
                deferred.append((run, sim.waiting.pop_entry()))
                continue
            if not self.admit(run):
                if sim.prefetches.release_holds():
                    continue  # blocks prefetched for later requests must not keep the head out
                sim.admission_blocked = True
                sim.counters["admission_waits"] += 1
                break
            sim.waiting.pop()
            sim.prefilling.append(run)
            if self.vllm and run.loads_pending:
                run.holding = True
                self.num_holding += 1
                run.step_wait = True  # its load finishes with the engine's next step, not before
                run.loads_pending += 1
            if sim.victims.pending:  # the slots it takes are reused once their old blocks are copied out
                done = sim.victims.write(run.load_ready_s if run.loads_pending else None)
                if done is not None:
                    run.loads_pending += 1
                    run.load_ready_s = max(run.load_ready_s, done)
                    sim.schedule_at(done, self._victims_out, run)
            if self.vllm and not run.loads_pending and not run.holding:
                run.take = min(run.prefill_left, budget)
                budget -= run.take
        if deferred:
            sim.waiting.put_back([entry for _, entry in deferred])
            deferred.clear()

    def plan_running(self) -> int:
        """Scheduler "vllm": the prompt tokens this pass's step gives the running
        prefills (each run's ``take``, in the order the step serves them);
        returns the tokens left for new requests, as vLLM schedules its running
        requests before it admits any waiting one."""
        sim = self.sim
        budget = sim.cfg.max_batch_tokens - len(sim.decoding)
        for run in sim.prefilling:
            run.take = 0 if run.loads_pending or run.holding or budget <= 0 else min(run.prefill_left, budget)
            budget -= run.take
        # then, first of the waiting ones, those whose load is done (vLLM's kv_holding_waiting), in order:
        # each runs, at the end of the running list, while a slot and tokens are left
        ready = [r for r in sim.prefilling if r.holding and not r.loads_pending]
        running = self.num_running()
        for run in ready:
            if running >= sim.cfg.max_running or budget <= 0:
                break
            run.holding = False
            self.num_holding -= 1
            running += 1
            sim.prefilling.remove(run)
            sim.prefilling.append(run)
            run.take = min(run.prefill_left, budget)
            budget -= run.take
        return budget

    def num_running(self) -> int:
        """Requests holding a running slot (``max_running``): under scheduler "vllm", not
        those admitted with a load that have not run yet (``holding``)."""
        return len(self.sim.prefilling) + len(self.sim.decoding) - self.num_holding

    def load_not_ready(self, run: "Run") -> bool:
        """Whether ``run`` is deferred: on a surface with ``defer_loads``, its cached
        prefix goes on in HBM victims still being copied down to DRAM. It stays
        queued without HBM and those behind it may be admitted, as vLLM's
        scheduler does when a connector's ``get_num_new_matched_tokens`` answers
        ``None``; it is tried again once they have landed."""
        sim = self.sim
        if not (sim.surface.defer_loads and sim.victims.on_way):
            return False
        if sim.victims.wanted(run.keys, sim.mgr.lookup(run.keys).num_blocks):
            sim.counters["deferred_admissions"] = sim.counters.get("deferred_admissions", 0) + 1
            return True
        return False

    def may_fit(self, run: "Run", need: int) -> bool:
        """Whether ``run`` fits in HBM beside what cannot be evicted there: the
        running requests' blocks and reserves, and arrived prefetches' holds.
        An engine checks its free plus evictable blocks before it allocates, so
        a request that cannot fit waits without evicting anything (trying would
        push out blocks and then roll back). Shared blocks count once."""
        sim = self.sim
        others = [pf for pf in sim.prefetches.held() if pf is not run.prefetch]
        busy = sim.running_blocks() + sum(len(pf.keys) for pf in others)
        if busy + need <= sim.cfg.hbm_blocks:  # fits even if nothing were shared (most calls)
            return True
        held = set(run.keys)
        reserved = need - len(run.keys)
        for r in chain(sim.prefilling, sim.decoding):
            if not r.uncached:  # (served without caching: holds no HBM)
                held.update(r.keys)
                reserved += r.reserved
        for pf in others:
            held.update(pf.keys)
        return len(held) + reserved <= sim.cfg.hbm_blocks

    # ------------------------------------------------------------ one request

    def admit(self, run: "Run") -> bool:
        """Admit ``run`` if HBM can take it now; False leaves everything as it was."""
        sim, req = self.sim, run.req
        need = math.ceil((req.input_tokens + req.output_tokens) / sim.block_size)
        request_id = (run.sess.idx, run.agent.agent_id, req.index)
        if sim.oracle is not None:
            sim.oracle.advance(request_id, sim.now)
        if need > sim.cfg.hbm_blocks:  # can never fit: served without caching
            self._admit_uncached(run, request_id)
            return True
        limit = sim.cfg.running_limit_blocks
        if (sim.prefilling or sim.decoding) and (
                (limit is not None and sim.running_blocks() + need > limit) or not self.may_fit(run, need)):
            return False
        self.load_rule.observe(sim.now, len(sim.waiting))
        hit, n_used, lands = self._usable_hit(run.keys)
        plan = self._reserve(run, hit, n_used, need)
        if plan is None:
            return False
        self._commit(run, request_id, hit, n_used, lands, plan)
        if n_used < hit.num_blocks:  # the load rule recomputes its DRAM / SSD part
            sim.counters["hits_recomputed"] = sim.counters.get("hits_recomputed", 0) + 1
        return True

    def _admit_uncached(self, run: "Run", request_id: tuple[int, str, int]) -> None:
        sim = self.sim
        sim.counters["oversized_requests"] += 1
        run.uncached = True
        if run.prefetch is not None:  # its hold must not outlive the request
            sim.prefetches.settle(run.prefetch, ())
            run.prefetch = None
        run.prefill_left = run.computed_tokens = run.req.input_tokens
        self._count(run, request_id)

    def _count(self, run: "Run", request_id: tuple[int, str, int]) -> None:
        sim = self.sim
        sim.block_touches += len(run.keys)
        if sim.order_log is not None:
            sim.order_log.append((request_id, run.keys, sim.now))

    def _usable_hit(self, keys: Sequence[BlockKey]) -> tuple[Any, int, float]:
        """The cached prefix of ``keys`` (victims on their way down landed first: ``lands``,
        when the last of them does) and how much of it the request uses: all, or only
        its HBM head where the policy recomputes rather than loads."""
        sim, mgr = self.sim, self.sim.mgr
        hit = mgr.lookup(keys)
        lands = 0.0
        if sim.victims.wanted(keys, hit.num_blocks):
            lands = sim.victims.land(keys, hit.num_blocks)
            hit = mgr.lookup(keys)
        names, tiers = hit.tier_names, hit.tier_indices
        n_used = hit.num_blocks
        if any(t != HBM for t in tiers):
            by_tier: dict[str, int] = {}
            for t in tiers:
                if t != HBM:
                    by_tier[names[t]] = by_tier.get(names[t], 0) + 1
            if not self.load_rule.load(sim.policy, sim.ctx, by_tier, sim.surface.choose_load):
                n_used = next(i for i, t in enumerate(tiers) if t != HBM)
        return hit, n_used, lands

    def _reserve(self, run: "Run", hit: Any, n_used: int, need: int) -> _Plan | None:
        """Plan the loads, the computed blocks' store and the decode reserve of ``run``
        (``keys[:n_used]`` cached); ``None``, all rolled back, when HBM has no room."""
        sim, mgr, keys = self.sim, self.sim.mgr, run.keys
        names, used_tiers = hit.tier_names, hit.tier_indices[:n_used]
        moves = []
        ok = True
        for src_idx in range(1, len(names) if used_tiers.count(HBM) != n_used else 1):
            src_keys = list(compress(keys, map(src_idx.__eq__, used_tiers)))
            if not src_keys:
                continue
            plan = mgr.prepare_move(src_keys, names[src_idx], "hbm",
                                    keep_source=sim.victims.keep_source(names[src_idx]))
            if plan is not None:
                moves.append(plan)
            if plan is None or len(plan.keys) < len(src_keys):
                ok = False
                break
        # One reference on the deepest ready HBM block protects its whole prefix
        # in HBM (a block with a resident child is never a victim): O(1) per request.
        tail = self.deepest_ready_hbm(keys, n_used)
        if tail is not None:
            mgr.acquire((tail,))
        n_sched = self.scheduled_in_hbm(keys, n_used) if self.vllm and n_used == hit.num_blocks else 0
        n_own = n_used + n_sched  # the rest this request computes
        store_plan = None
        if ok and n_own < len(keys):
            store_plan = mgr.prepare_store("hbm", keys[n_own:], keys[n_own - 1] if n_own else None)
            if store_plan is None or len(store_plan.keys) + len(store_plan.skipped) < len(keys) - n_own:
                ok = False
        reserve = need - len(keys)
        if ok and reserve > 0 and not mgr.reserve("hbm", reserve):
            ok = False
        if ok:
            return _Plan(moves, tail, store_plan, n_sched, reserve)
        for plan in moves:  # roll back; the request waits for memory
            mgr.complete_move(plan, False)
        if store_plan is not None:
            mgr.complete_store(store_plan, False)
        if tail is not None:
            mgr.release((tail,))
        return None

    def _commit(self, run: "Run", request_id: tuple[int, str, int], hit: Any, n_used: int, lands: float,
                plan: _Plan) -> None:
        """``run`` is admitted with ``plan``: recency, its holds, its hits and its loads in flight."""
        sim, mgr, keys, bs = self.sim, self.sim.mgr, run.keys, self.sim.block_size
        store_plan, n_sched = plan.store_plan, plan.n_sched
        self._count(run, request_id)
        if run.prefetch is not None:
            sim.prefetches.settle(run.prefetch, keys[:n_used])
            run.prefetch = None
        mgr.touch(keys[:n_used], "hbm")
        if store_plan is not None and store_plan.skipped:
            mgr.touch(store_plan.skipped, "hbm")
        if sim.write_through_on:
            # A write-through store of this prompt refreshes the copies already
            # below (so a chain's head stays at least as recent as its tail);
            # exclusive DRAM: the DRAM copies of what now runs in HBM go first.
            for tier in sim.lower:
                if tier == "dram" and sim.victims.on:
                    mgr.deprioritize(keys, tier)
                else:
                    mgr.touch(keys, tier)
        run.held, run.reserved, run.store_plan = plan.tail, max(0, plan.reserve), store_plan
        run.computed_keys = store_plan.keys if store_plan is not None else ()
        run.hit["hbm"] = (hit.tier_indices[:n_used].count(HBM) + n_sched) * bs
        if self.vllm and store_plan is not None and store_plan.keys:
            n_own, computes = n_used + n_sched, set(store_plan.keys)
            self.prefill_owner.update((key, (run, i)) for i, key in enumerate(keys[n_own:], n_own)
                                      if key in computes)
        for move in plan.moves:
            run.hit[move.src] += len(move.keys) * bs
            done = sim.transfer_s(move.src, "hbm", len(move.keys))
            if move.src == "dram" and lands > sim.now:  # some of them are still on their way down
                done = max(done, lands + sim.mover.path_s("dram", "hbm", len(move.keys)))
            run.loads_pending += 1
            run.load_ready_s = max(run.load_ready_s, done)
            sim.schedule_at(done, self._load_done, run, move)
        sim.load_beyond(run, n_used + n_sched, hit.num_blocks + n_sched)
        # vLLM recomputes at least the last token of a fully cached prompt
        run.computed_tokens = max(1, run.req.input_tokens - sum(run.hit.values()))
        run.prefill_left = run.computed_tokens
        run.ctx_tokens = run.req.input_tokens - run.computed_tokens

    def scheduled_in_hbm(self, keys: Sequence[BlockKey], n: int) -> int:
        """Scheduler "vllm": how many of ``keys[n:]`` (not readable in any tier) a prefilling
        request has already been scheduled to compute, by this pass or an earlier one:
        vLLM caches a block when it allocates it, so a request admitted after that
        finds it as a prefix hit in HBM (and the forward pass computes it once)."""
        owner, bs = self.prefill_owner, self.sim.block_size
        m = n
        while m < len(keys):
            entry = owner.get(keys[m])
            if entry is None:
                break
            run, pos = entry
            if run.holding:  # (vLLM caches a loading request's blocks only once its load is done)
                break
            done = sum(run.hit.values()) + run.computed_tokens - run.prefill_left + run.take
            if (pos + 1) * bs > done:
                break
            m += 1
        return m - n

    def computed(self, run: "Run") -> None:
        """``run``'s prefill is done: other requests no longer wait on it for its blocks."""
        if self.vllm:
            for key in run.computed_keys:
                del self.prefill_owner[key]

    # ------------------------------------------------------------ HBM references

    def deepest_ready_hbm(self, keys: Sequence[BlockKey], n_used: int) -> BlockKey | None:
        mgr = self.sim.mgr
        if keys and mgr.contains(keys[-1], "hbm"):
            return keys[-1]
        return mgr.last_present(keys[:n_used], "hbm")

    def retail(self, run: "Run") -> None:
        """Move the run's reference to its prompt's last block once it is ready in HBM."""
        mgr = self.sim.mgr
        last = run.keys[-1] if run.keys else None
        if last is None or last == run.held or not mgr.contains(last, "hbm"):
            return
        mgr.acquire((last,))
        if run.held is not None:
            mgr.release((run.held,))
        run.held = last

    def _load_done(self, run: "Run", plan: Any) -> None:
        mgr = self.sim.mgr
        mgr.complete_move(plan, True)
        if plan.keep_source and plan.src == "dram" and self.sim.victims.on:  # in HBM now: first to go below
            mgr.deprioritize(plan.keys, plan.src)
        run.loads_pending -= 1
        self.retail(run)

    @staticmethod
    def _victims_out(run: "Run") -> None:
        run.loads_pending -= 1
