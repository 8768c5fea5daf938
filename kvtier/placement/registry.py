"""The placement policies by name, live and in the replay.

Owns: the registry (the baselines of :mod:`.base`, the agent-aware policies of
:mod:`.agent`, the peers' models of :mod:`.peers`, and any added with
:func:`register_placement`) and building a policy by name with its tunable
constants set (:func:`make_placement`). Must not hold a policy's logic.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from ..errors import ConfigError
from .agent import AGENT_POLICIES
from .base import ARC, LRU, S3FIFO, TTL, Belady, LRUDram, MinWaste, PlacementPolicy
from .params import apply_params
from .peers import PEER_POLICIES

_REGISTRY: dict[str, Callable[[], PlacementPolicy]] = {
    cls.name: cls for cls in (LRU, LRUDram, ARC, S3FIFO, TTL, MinWaste, Belady, *AGENT_POLICIES, *PEER_POLICIES)
}


def register_placement(name: str, factory: Callable[[], PlacementPolicy]) -> None:
    """Add a placement policy to the registry (live and replay)."""
    if name in _REGISTRY:
        raise ValueError(f"placement policy {name!r} registered twice")
    _REGISTRY[name] = factory


def placement_names() -> list[str]:
    return list(_REGISTRY)


def make_placement(name: str, setting: str = "--policies", params: Mapping[str, Any] | None = None,
                   params_setting: str = "placement") -> PlacementPolicy:
    """A new policy object by name, with the tunable constants of ``params`` set
    (:mod:`kvtier.placement.params`); an unknown name is a ``ConfigError``
    naming ``setting``, a bad constant one naming ``<params_setting>.<knob>``."""
    try:
        policy = _REGISTRY[name]()
    except KeyError:
        raise ConfigError(setting, name, f"unknown placement policy; valid: {', '.join(_REGISTRY)}") from None
    if params:
        apply_params(policy, params, params_setting)
    return policy
