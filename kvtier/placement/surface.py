"""Engine surfaces: which placement decisions an engine lets kvtier carry out.

Owns: :class:`Surface` (one flag per kind of decision) and :data:`SURFACES`,
the named surfaces the replay can model. A policy decides the same way on
every surface; the surface says what its host does with a decision: the
replay simulator reads it (``kvtier replay --surface``), and the live vLLM
connector is the ``vllm`` surface by construction (its README's decision
table says how each flag is met). Must not decide anything itself.

* ``full`` — an engine whose HBM cache kvtier manages block by block:
  reorder, drop and prefetch into HBM, choose load or recompute, copy a
  block down to DRAM as HBM evicts it (SGLang HiCache's write-back). The
  replay's default; results on it are *modelled only* where a real engine
  does not let a connector do this.
* ``vllm`` — what vLLM 0.32's public connector surface allows: hold idle
  HBM blocks (``BlockPool.touch`` / ``free_blocks``) and refresh them to most
  recent; nothing can move an idle block to the front of vLLM's free queue
  or make room sooner (``evict_blocks`` only forgets the hash), nothing can
  load into HBM without a request, and the connector writes every computed
  block through to its host tiers and loads every hit it reports (it learns
  of an HBM eviction only after the block is reused: no victim write). HBM
  pressure is vLLM's KV usage (blocks referenced by requests or holds, not
  idle cached ones, which vLLM counts as free), plus queued demand.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError


@dataclass(frozen=True, slots=True)
class Surface:
    name: str
    hbm_hold: bool = True  # keep idle HBM blocks from eviction (pin)
    hbm_refresh: bool = True  # make idle HBM blocks most recent (touch)
    hbm_demote: bool = True  # make idle HBM blocks the next victims (deprioritize)
    hbm_drop: bool = True  # free an idle HBM copy at once (offload with a copy below, discard)
    prefetch_to: str = "hbm"  # where a predictive prefetch lands: "hbm", or "dram" (from SSD only)
    choose_load: bool = True  # the policy may recompute a lower-tier hit instead of loading it
    write_through_always: bool = False  # every computed block goes to the host tiers the policy uses
    pressure_counts_idle: bool = True  # HBM pressure counts idle cached blocks as used
    hbm_victim_write: bool = True  # a block HBM evicts can be copied down first (exclusive DRAM)


SURFACES: dict[str, Surface] = {
    "full": Surface("full"),
    "vllm": Surface("vllm", hbm_demote=False, hbm_drop=False, prefetch_to="dram", choose_load=False,
                    write_through_always=True, pressure_counts_idle=False, hbm_victim_write=False),
}


def surface(name: str, setting: str = "--surface") -> Surface:
    """The surface called ``name``; a ``ConfigError`` naming ``setting`` otherwise."""
    try:
        return SURFACES[name]
    except KeyError:
        raise ConfigError(setting, name, f"unknown engine surface; valid: {', '.join(SURFACES)}") from None
