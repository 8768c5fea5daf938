"""Engine surfaces: which placement decisions an engine lets kvtier carry out.

Owns: :class:`Surface` (one flag per kind of decision), :data:`SURFACES`,
the named surfaces the replay can model, and :data:`ADDITIONS`, the single
decisions that can be added to one by name (``vllm-write-through+exclusive``,
``vllm-write-through+order+drop``, ``vllm-write-through+all``: issue 41's
ablation). A policy decides the same way on every surface; the surface says
what its host does with a decision: the replay simulator reads it (``kvtier
replay --surface``), and the live vLLM connector is the ``vllm`` surface
(``exclusive_dram: true``, recommended) or the ``vllm-write-through`` one by
construction (its README's decision table says how each flag is met). Must
not decide anything itself.

* ``full`` — an engine whose HBM cache kvtier manages block by block:
  reorder, drop and prefetch into HBM, choose load or recompute, copy a
  block down to DRAM as HBM evicts it (SGLang HiCache's write-back). The
  replay's default; results on it are *modelled only* where a real engine
  does not let a connector do this.
* ``vllm-write-through`` — the vLLM connector writing through (``exclusive_dram``
  off), through vLLM 0.32's public connector surface: hold idle HBM blocks
  (``BlockPool.touch`` / ``free_blocks``) and refresh them to most recent;
  nothing can move an idle block to the front of vLLM's free queue or make
  room sooner (``evict_blocks`` only forgets the hash), nothing can load into
  HBM without a request, and the connector writes every computed block
  through to its host tiers and loads every hit it reports. HBM pressure is
  vLLM's KV usage (blocks referenced by requests or holds, not idle cached
  ones, which vLLM counts as free), plus queued demand.
* ``vllm`` — the recommended live setup, the connector as the integration
  README's "Enable it" configures it (``exclusive_dram: true``):
  ``vllm-write-through`` with ``exclusive``, ``requeue`` and ``defer``
  (:data:`ADDITIONS`). It watches each block it would have written through
  (``BlockPool.unpin_blocks``' ``on_reuse``), copies it down to DRAM when
  vLLM hands the slot to another request (before that step's forward), moves
  a DRAM block up on load, re-queues waiting agents' idle HBM blocks in the
  policy's next-use order at the tail of vLLM's free queue (``touch`` then
  ``free_blocks``, once vLLM has freed them), and defers (``None`` from
  ``get_num_new_matched_tokens``) a request whose prefix goes on in a block
  on its way down. ``requeue`` is that HBM order, and only that: ended
  agents' and untagged requests' blocks keep their LRU places (``order``
  ranks every idle block, which no vLLM surface allows).

By default the replay knows when an agent is done (``on_agent_end``), as the
live connector does from the SDK's agent ends through a hint server (live, a
``turn_end`` wait comes first, until the end is reported). With hints in
``kv_transfer_params`` alone (the recommended setup as "Enable it" shows it,
without a hint server), or from the request-stream middleware (which reports
no ends), a turn without a tool wait may be the agent's last:
live it starts a ``turn_end`` wait
(:data:`~kvtier.placement.base.TURN_END_GAP_S`), and nothing ends; ``kvtier
replay --agent-ends unknown`` models that on any surface (not an engine's
decision, but what the client tells kvtier).
* ``BASE+ADDITION[+ADDITION...]`` — a named surface with single decisions
  added (:data:`ADDITIONS`), each one flag: four of ``full``'s, ``defer``,
  which ``full`` has not, and ``requeue``. *Modelled only*: :data:`LIVE`
  names the surfaces a live setup runs. An addition the base already has is
  refused.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

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
    # A request whose cached prefix goes on in blocks still being copied down to DRAM waits in the
    # queue without HBM while those behind it are admitted (vLLM: get_num_new_matched_tokens -> None).
    # Off on ``full`` too: there the request lands them at once and waits for them holding its HBM.
    defer_loads: bool = False
    # HBM stays LRU, but after each wait start the idle HBM blocks of the waiting agents due no later go to
    # its tail in the policy's next-use order (vLLM: touch + free_blocks; kvtier.placement.nextuse.requeue_order)
    hbm_requeue: bool = False
    # Where a block going down to DRAM (hbm_victim_write) finds room. True: the slot a load of the same
    # admission frees, through a staging buffer (the victims and the loads swap places; modelled only).
    # False: it claims a DRAM slot when it leaves HBM, evicting there in the policy's order (or is dropped
    # when nothing there can go), as the live connector's write-back does in ``on_reuse``.
    victim_swap: bool = True


_WRITE_THROUGH = Surface("vllm-write-through", hbm_demote=False, hbm_drop=False, prefetch_to="dram",
                         choose_load=False, write_through_always=True, pressure_counts_idle=False,
                         hbm_victim_write=False, victim_swap=False)
SURFACES: dict[str, Surface] = {
    "full": Surface("full"),
    "vllm": replace(_WRITE_THROUGH, name="vllm", hbm_victim_write=True, hbm_requeue=True, defer_loads=True),
    "vllm-write-through": _WRITE_THROUGH,
}


@dataclass(frozen=True, slots=True)
class Addition:
    """One decision added to a base surface: the flag it sets and what that does with ``kvtier``."""

    flag: str
    value: object
    means: str


ADDITIONS: dict[str, Addition] = {
    "exclusive": Addition("hbm_victim_write", True, "exclusive DRAM: a block goes down to DRAM as HBM evicts it, "
                          "a load moves it up (DRAM holds what HBM does not)"),
    "order": Addition("hbm_demote", True, "HBM evicts in the policy's order (kvtier: predicted next use, ended "
                      "agents first) instead of LRU, and idle HBM blocks can be made the next victims"),
    "drop": Addition("hbm_drop", True, "idle HBM copies can be freed at once: kvtier frees ended agents' "
                     "private blocks when it cannot reorder HBM"),
    "prefetch": Addition("prefetch_to", "hbm", "a waiting agent's DRAM blocks are prefetched into HBM before its "
                         "predicted return and held until its request is admitted (a late one joins the queue "
                         "when they land)"),
    "defer": Addition("defer_loads", True, "a request whose prefix goes on in blocks still being copied down to "
                      "DRAM is deferred, without HBM, while those behind it are admitted (not on full either: "
                      "there it takes its HBM and waits for them)"),
    "requeue": Addition("hbm_requeue", True, "HBM stays LRU, but when an agent starts waiting, its idle HBM blocks "
                        "and those of waiting agents due back no later go to the tail in kvtier's next-use order "
                        "(what vLLM's free queue allows: touch + free_blocks); other blocks keep their LRU places"),
}
ALL = "all"  # every addition at once but requeue, the part of the order vLLM's free queue allows (order has it)
ALL_ADDITIONS = tuple(a for a in ADDITIONS if a != "requeue")

LIVE: dict[str, str] = {
    "vllm": "the vLLM connector with exclusive_dram: true (recommended)",
    "vllm-write-through": "the vLLM connector with exclusive_dram: false (write-through)",
}
"""Surfaces a live setup runs, and which setup; every other surface is modelled only."""


def _with(base: Surface, name: str, additions: list[str]) -> Surface:
    return replace(base, name=name, **{ADDITIONS[a].flag: ADDITIONS[a].value for a in additions})


def surface(name: str, setting: str = "--surface") -> Surface:
    """The surface called ``name`` (``BASE`` or ``BASE+ADDITION+...``, ``all`` for every
    addition); a ``ConfigError`` naming ``setting`` and the valid names otherwise."""
    base_name, *added = name.split("+")
    base = SURFACES.get(base_name)
    if base is None:
        raise ConfigError(setting, name, f"unknown engine surface; valid: {', '.join(SURFACES)}")
    if not added:
        return base
    lacks = [a for a in ADDITIONS if getattr(base, ADDITIONS[a].flag) != ADDITIONS[a].value]
    valid = [*lacks, ALL]
    for a in added:
        if a in valid:
            continue
        if a not in ADDITIONS:
            why = f"unknown addition {a!r} to surface {base_name!r}"
        else:
            why = f"surface {base_name!r} already has {a!r}"
            if base_name == "vllm":
                why += " (vllm-write-through is the vLLM connector without exclusive_dram)"
        raise ConfigError(setting, name, f"{why}; valid additions: {', '.join(valid)} "
                                         f"(e.g. {base_name}+{'+'.join(lacks[:2])})")
    if len(set(added)) < len(added) or (ALL in added and len(added) > 1):
        raise ConfigError(setting, name, "names an addition twice")
    return _with(base, name, list(ALL_ADDITIONS) if added == [ALL] else added)


def surfaces_help() -> str:
    """What ``--surface`` accepts, for the CLI's help."""
    adds = "; ".join(f"+{n}: {a.means}" for n, a in ADDITIONS.items())
    return (f"BASE[+ADDITION...]. Bases: full (default: every decision, including HBM reordering and prefetch "
            f"into HBM, modelled only); vllm (what the live vLLM connector does as its README recommends, with "
            f"exclusive_dram: true: hold and refresh HBM blocks, waiting agents' idle HBM blocks re-queued in "
            f"next-use order, exclusive DRAM, deferred loads, prefetch SSD to DRAM); vllm-write-through (the "
            f"connector with exclusive_dram off: every computed block written through to DRAM). Additions, one "
            f"flag each, MODELLED ONLY: {adds}; +{ALL}: every one of them but requeue. "
            f"E.g. vllm-write-through+exclusive, vllm+order")
