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
  kvtier connector does not make.
* ``lmcache-lazy`` — LMCache's eviction-aware lazy offload (PR #4847,
  ``EvictionAwareStoreQueue``, the default with ``lmcache.mp.lazy_offload``):
  a block is stored to CPU memory when it is about to leave HBM, not as it
  is computed; CPU memory LRU (LMCache's default ``LRU`` cache policy). The
  replay stores each block as HBM evicts it (its victim write, the live
  connector's ``exclusive_dram``), so it runs live as ``lru-dram`` with
  ``exclusive_dram``. Not modelled: the 2.5-step look-ahead (a store begins
  before the eviction; here it begins at it, and the HBM slot waits for the
  copy), the cap of 64 blocks drained per step (none here: leans in the
  peer's favour), and LMCache keeps the CPU copy of a block it loads back
  (the replay's victim cache moves it: DRAM holds no copy of what HBM holds,
  which also leans in the peer's favour).
"""

from __future__ import annotations

from typing import Callable, Sequence

from ..keys import BlockKey
from ..policies.sae import SAEOrder
from .base import LRUDram, PlacementContext


class SAE(LRUDram):
    """vLLM CPU offloading with session-aware eviction (see the module docstring)."""

    name = "sae"
    lower_tiers = ("dram",)  # vLLM's offloading: one CPU tier
    replay_only = "a peer's model: SAE's lookup and store hooks are vLLM offloading-manager calls"

    def __init__(self) -> None:
        self.order: SAEOrder | None = None
        self._context: dict[tuple[int, str], tuple[BlockKey, ...]] = {}  # agent -> its request's keys

    def eviction_for(self, tier: str, clock: Callable[[], float] | None = None) -> object:
        if tier != "dram":
            return self.eviction
        self.order = SAEOrder()
        return self.order

    def on_wait_end(self, ctx: PlacementContext, agent_key: tuple[int, str], keys: Sequence[BlockKey]) -> None:
        self._context[agent_key] = tuple(keys)
        if self.order is not None:  # vLLM looks up past the blocks its HBM prefix cache holds
            self.order.count = ctx.count
            self.order.lookup(agent_key, keys, ctx.blocks_in(keys, "hbm"))

    def admit_lower(self, ctx: PlacementContext, tier: str, agent_key: tuple[int, str] | None) -> bool:
        """A store batch begins. vLLM passes a request's first batch the keys from its first
        block (``start_pos``: its prefix stored already) and later ones only the new keys
        (``start_pos`` 0): the first batch gets the request's context, later ones none."""
        if tier == "dram" and self.order is not None:
            self.order.open_store(agent_key, self._context.pop(agent_key, ()) if agent_key else ())
        return True

    def on_agent_end(self, ctx: PlacementContext, agent_key: tuple[int, str], keys: Sequence[BlockKey]) -> None:
        self._context.pop(agent_key, None)
        if self.order is not None:
            self.order.forget(agent_key)


class LMCacheLazy(LRUDram):
    """LMCache's eviction-aware lazy offload to CPU memory (see the module docstring)."""

    name = "lmcache-lazy"
    lower_tiers = ("dram",)  # LMCache's L1 (CPU memory); its disk and remote backends are off by default
    write_back_dram = "evict"


PEER_POLICIES = (SAE, LMCacheLazy)
