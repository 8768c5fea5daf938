"""Peer systems' placements, modelled from their code, for the replay to compare kvtier with.

Owns: the placements that stand for what kvtier's users would run instead,
each as its system ships it (eviction, store rule and tiers together), with
its source and what is and is not modelled. Must not carry kvtier's own
ideas: a peer is as strong as its code, no stronger and no weaker; where the
replay cannot model a part, its docstring says so and which way that leans.

* ``sae`` — vLLM's session-aware eviction for its CPU offloading (PR #50422,
  ``SAECachePolicy``): every computed block written through to DRAM (vLLM's
  ``OffloadingConnector``), DRAM evicted by :class:`~kvtier.policies.sae.SAEOrder`
  (groups by store, worst-scored group first, tail first, with SAE's
  admission gate), HBM by vLLM's LRU. Replay only: SAE's hooks (a request's
  lookup, a store batch's start) are vLLM offloading manager calls that the
  kvtier connector does not make. Modelled differently (SAEOrder's docstring
  has the rest): a batch too large for the room SAE's walk finds stores what
  fits, where SAE stores none of it (leans in the peer's favour), and a
  request whose batch was declined offers none of its later blocks, where
  vLLM retries the batch every step with them (against the peer where a
  retry would pass the gate; it compares the same baseline with a timer a
  few requests later).
* ``lmcache-lazy`` — LMCache's eviction-aware lazy offload (PR #4847,
  ``lmcache/integration/vllm/lazy_offload_policy/eviction_aware.py`` at
  e6764ce1, ``EvictionAwareStoreQueue``, the default with ``lmcache.mp.lazy_offload``):
  a block is stored to CPU memory when it is about to leave HBM, not as it
  is computed; CPU memory LRU (LMCache's default ``LRU`` cache policy). The
  replay stores each block as HBM evicts it (its victim write, the live
  connector's ``exclusive_dram``): live it is ``lmcache-lazy`` with
  ``exclusive_dram: true`` (LRU order, no agent actions). Not modelled: the 2.5-step look-ahead (a store begins
  before the eviction; here it begins at it, and the HBM slot waits for the
  copy), the cap of 64 blocks drained per step (none here: leans in the
  peer's favour), and LMCache keeps the CPU copy of a block it loads back
  (the replay's victim cache moves it: DRAM holds no copy of what HBM holds,
  which also leans in the peer's favour).
* ``vllm-tiering`` — the session lifecycle of vLLM PR #48837 (closed
  unmerged; ``vllm/v1/kv_offload/tiering/lifecycle.py`` at 90218a15 and its
  ``TieringPolicyConfig`` store budget, read and paraphrased), at its
  defaults: stores to CPU memory only under HBM pressure (on at 70% of HBM
  referenced, off at 50%), only for a session seen at least twice (its reuse
  estimate ``(n - 1) / n`` at least 0.5), at most 64 blocks per request, 64
  per session and 128 in all per pressure episode (reset when the pressure
  clears); LRU. Its idle TTL is off by default, so sessions never expire.
  Replay only (its store budget is vLLM tiering-manager code). Not modelled:
  the 16-block-per-step rate (leans in the peer's favour), the two store jobs
  in flight, the CPU watermark gate (DRAM here evicts by LRU instead), and
  the HBM copy freed after a store (vLLM's public surface frees no cached
  block early). The session is kvtier's session (a client sends one
  ``session_id`` for all its agents).
"""

from __future__ import annotations

from typing import Callable, Sequence

from ..keys import BlockKey
from ..policies.sae import SAEOrder
from .base import LRUDram, PlacementContext, ToolWait


class SAE(LRUDram):
    """vLLM CPU offloading with session-aware eviction (see the module docstring)."""

    name = "sae"
    lower_tiers = ("dram",)  # vLLM's offloading: one CPU tier
    replay_only = "a peer's model: SAE's lookup and store hooks are vLLM offloading-manager calls"

    def __init__(self) -> None:
        self.order: SAEOrder | None = None
        self._context: dict[tuple[int, str], tuple[BlockKey, ...]] = {}  # agent -> its running request's keys
        self._batches: dict[tuple[int, str], int] = {}  # agent -> store batches its running request opened

    def eviction_for(self, tier: str, clock: Callable[[], float] | None = None) -> object:
        if tier != "dram":
            return self.eviction
        self.order = SAEOrder()
        return self.order

    def on_wait_end(self, ctx: PlacementContext, agent_key: tuple[int, str], keys: Sequence[BlockKey]) -> None:
        self._context[agent_key], self._batches[agent_key] = tuple(keys), 0
        if self.order is not None:  # vLLM looks up past the blocks its HBM prefix cache holds
            self.order.count = ctx.count
            self.order.lookup(agent_key, keys, ctx.blocks_in(keys, "hbm"))

    def admit_lower(self, ctx: PlacementContext, tier: str, agent_key: tuple[int, str] | None,
                    num_blocks: int) -> int:
        """A store batch begins: the prompt's computed blocks at prefill end, then the answer's.
        vLLM gives a request's first batch the keys from its first block (``start_pos``: its
        prefix stored already), each later one a new block (``start_pos`` 0) as decode fills
        it, and touches the request's keys after each batch that stored: the answer is one
        batch touching ``num_blocks`` times here. vLLM retries a declined batch at its next
        step with the blocks after it; here a request whose batch was declined stores none
        of its later blocks (their parents are not there)."""
        order = self.order
        if tier != "dram" or order is None or agent_key is None:
            return num_blocks
        context, first = self._context.get(agent_key, ()), not self._batches.get(agent_key, 0)
        self._batches[agent_key] = self._batches.get(agent_key, 0) + 1
        if agent_key in order.declined_by:
            order.close()
            ctx.count("sae_batches_after_a_decline")
            return 0
        order.open_store(agent_key, context if first else (), context, 1 if first else num_blocks)
        return num_blocks

    def on_wait_start(self, ctx: PlacementContext, wait: ToolWait) -> None:
        self._finished(wait.agent_key)

    def on_agent_end(self, ctx: PlacementContext, agent_key: tuple[int, str], keys: Sequence[BlockKey]) -> None:
        self._finished(agent_key)

    def _finished(self, agent_key: tuple[int, str]) -> None:
        """The agent's request finished: its batches are closed, its merge pointer dropped."""
        self._context.pop(agent_key, None)
        self._batches.pop(agent_key, None)
        if self.order is not None:
            self.order.close()
            self.order.forget(agent_key)


class LMCacheLazy(LRUDram):
    """LMCache's eviction-aware lazy offload to CPU memory (see the module docstring)."""

    name = "lmcache-lazy"
    lower_tiers = ("dram",)  # LMCache's L1 (CPU memory); its disk and remote backends are off by default
    write_back_dram = "evict"


class SessionTiering(LRUDram):
    """vLLM PR #48837's pressure- and session-gated stores to CPU memory (see the module docstring)."""

    name = "vllm-tiering"
    lower_tiers = ("dram",)
    replay_only = "a peer's model: its store budget is vLLM tiering-manager code"
    pressure_on, pressure_off = 0.70, 0.50  # fractions of HBM referenced by requests
    per_request, per_session, per_episode = 64, 64, 128  # blocks stored, the last two per pressure episode

    def __init__(self) -> None:
        self.pressure = False
        self._requests: dict[int, int] = {}  # session -> requests seen
        self._stored: dict[tuple[int, str], int] = {}  # agent -> blocks its running request stored
        self._session_stored: dict[int, int] = {}  # session -> blocks stored this episode
        self._episode_stored = 0

    def on_wait_end(self, ctx: PlacementContext, agent_key: tuple[int, str], keys: Sequence[BlockKey]) -> None:
        self._requests[agent_key[0]] = self._requests.get(agent_key[0], 0) + 1
        self._stored[agent_key] = 0

    def admit_lower(self, ctx: PlacementContext, tier: str, agent_key: tuple[int, str] | None,
                    num_blocks: int) -> int:
        used = ctx.running_blocks() / max(1, ctx.hbm_capacity_blocks)
        if used >= self.pressure_on:
            self.pressure = True
        elif used <= self.pressure_off and self.pressure:
            self.pressure = False
            self._session_stored.clear()
            self._episode_stored = 0
        if not self.pressure or agent_key is None:
            ctx.count("tiering_stores_no_pressure")
            return 0
        session = agent_key[0]
        n = self._requests.get(session, 0)
        if n < 2 or (n - 1) / n < 0.5:
            ctx.count("tiering_stores_cold_session")
            return 0
        budget = min(num_blocks, self.per_request - self._stored.get(agent_key, 0),
                     self.per_session - self._session_stored.get(session, 0), self.per_episode - self._episode_stored)
        if budget <= 0:
            ctx.count("tiering_stores_over_budget")
            return 0
        self._stored[agent_key] = self._stored.get(agent_key, 0) + budget
        self._session_stored[session] = self._session_stored.get(session, 0) + budget
        self._episode_stored += budget
        return budget

    def on_agent_end(self, ctx: PlacementContext, agent_key: tuple[int, str], keys: Sequence[BlockKey]) -> None:
        self._stored.pop(agent_key, None)


PEER_POLICIES = (SAE, LMCacheLazy, SessionTiering)
