"""Tunable constants of the agent-aware placement policies: the knobs that a
config file sets (``placement.*``) and ``kvtier tune`` searches.

Owns: each knob's name, range, the values a search tries and what it means
(:data:`KNOBS`), checking a mapping of knob values, and applying one to a
policy object before it runs (live in the connector, or in the replay). Must
not choose values (``kvtier tune`` does) or import the simulator or an engine.

>>> from kvtier.placement import make_placement
>>> p = make_placement("kvtier", params={"next_use_trust": 2.0, "rho_max": 0.5})
>>> p.next_use_trust, p.rho_bounds
(2.0, (0.05, 0.5))
>>> make_placement("lru-dram", params={"rho_max": 0.5})
Traceback (most recent call last):
...
kvtier.errors.ConfigError: placement.rho_max=0.5: policy 'lru-dram' has no tunable constants (the agent-aware ones do: kvtier, kvflow, tokencake and the kvtier ablations)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from ..errors import ConfigError


@dataclass(frozen=True, slots=True)
class Knob:
    """One tunable constant: its range and the values a search tries."""

    name: str
    lo: float
    hi: float
    grid: tuple[float, ...]
    doc: str


KNOBS: dict[str, Knob] = {k.name: k for k in (
    Knob("next_use_trust", 0.0, 8.0, (0.0, 0.5, 1.0, 2.0, 4.0),
         "weight of an agent's predicted wait in the next-use order of its blocks "
         "(rank = wait start + trust x predicted wait; 0 ranks by wait start alone)"),
    Knob("rho_min", 0.0, 0.9, (0.0, 0.05, 0.1),
         "least share of HBM reserved for the blocks of critical waiting agents"),
    Knob("rho_max", 0.0, 0.9, (0.1, 0.3, 0.5),
         "most share of HBM reserved for the blocks of critical waiting agents"),
    Knob("critical_at", 0.0, 1.0, (0.5, 0.75, 0.9),
         "criticality from which a waiting agent's blocks may take the reserve"),
    Knob("demote_after_s", 0.0, 86400.0, (1.0, 5.0, 30.0),
         "a tool wait predicted at least this long demotes the agent's blocks below DRAM "
         "(used by policies without the next-use order)"),
    Knob("prefetch_lead_factor", 0.0, 20.0, (1.0, 1.5, 3.0),
         "a prefetch starts this many transfer times before an agent's predicted return"),
    Knob("user_wait_s", 0.0, 86400.0, (60.0, 120.0, 300.0, 900.0),
         "the wait the next-use order expects after a turn that called no tool (a user's turn, or an "
         "agent that is done), and for a block no agent claimed"),
)}


def check_params(params: Mapping[str, Any], setting: str = "placement") -> dict[str, float]:
    """The knob values of ``params`` as floats; a ``ConfigError`` naming
    ``<setting>.<knob>`` for an unknown knob, a non-number or a value out of range."""
    out: dict[str, float] = {}
    for name, value in params.items():
        knob = KNOBS.get(name)
        if knob is None:
            raise ConfigError(f"{setting}.{name}", value, f"unknown knob; valid: {', '.join(KNOBS)}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(f"{setting}.{name}", value, "must be a number")
        if not knob.lo <= value <= knob.hi:
            raise ConfigError(f"{setting}.{name}", value, f"must be in [{knob.lo:g}, {knob.hi:g}]")
        out[name] = float(value)
    lo, hi = out.get("rho_min"), out.get("rho_max")
    if lo is not None and hi is not None and lo > hi:
        raise ConfigError(f"{setting}.rho_min", lo, f"must not exceed {setting}.rho_max={hi:g}")
    return out


def apply_params(policy: Any, params: Mapping[str, Any], setting: str = "placement") -> None:
    """Set the knobs of ``params`` on a new ``policy`` object (before it runs)."""
    from .agent import AgentAware

    values = check_params(params, setting)
    if not values:
        return
    if not isinstance(policy, AgentAware):
        name = next(iter(values))
        raise ConfigError(f"{setting}.{name}", values[name],
                          f"policy {policy.name!r} has no tunable constants (the agent-aware ones do: kvtier, "
                          "kvflow, tokencake and the kvtier ablations)")
    lo, hi = policy.rho_bounds
    lo, hi = values.get("rho_min", lo), values.get("rho_max", hi)
    if lo > hi:
        raise ConfigError(f"{setting}.rho_min" if "rho_min" in values else f"{setting}.rho_max",
                          values.get("rho_min", values.get("rho_max")),
                          f"gives an empty reserve range ({lo:g} > {hi:g})")
    policy.rho_bounds = (lo, hi)
    policy.rho = lo
    for name in ("next_use_trust", "critical_at", "demote_after_s", "user_wait_s"):
        if name in values:
            setattr(policy, name, values[name])
    if "prefetch_lead_factor" in values:
        policy.lead_factor = values["prefetch_lead_factor"]
