"""The eviction policies by name.

Owns: the registry (:func:`register_policy`, used as a decorator by each policy's
module), building a policy by name (:func:`make_policy`, with an error that names the
setting and lists the valid names) and the list of names. The built-in policies'
modules register themselves when :mod:`kvtier.policies` imports them, so this module
imports none of them. Must not hold a policy's logic.
"""

from __future__ import annotations

from typing import Callable

from ..errors import UnknownPolicyError
from .base import EvictionPolicy

PolicyFactory = Callable[[int], EvictionPolicy]
"""Builds a policy for a tier of the given capacity in blocks."""

_REGISTRY: dict[str, PolicyFactory] = {}


def register_policy(name: str) -> Callable[[PolicyFactory], PolicyFactory]:
    """Class/function decorator registering a policy factory under ``name``."""

    def deco(factory: PolicyFactory) -> PolicyFactory:
        if name in _REGISTRY:
            raise ValueError(f"policy {name!r} registered twice")
        _REGISTRY[name] = factory
        return factory

    return deco


def policy_names() -> list[str]:
    """Sorted names of every registered eviction policy."""
    return sorted(_REGISTRY)


def make_policy(name: str, capacity_blocks: int, setting: str = "policy") -> EvictionPolicy:
    """Build the policy registered as ``name``; an unknown name raises
    :class:`UnknownPolicyError` naming ``setting`` and listing the valid names."""
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise UnknownPolicyError(setting, name, f"unknown policy; valid: {', '.join(sorted(_REGISTRY))}") from None
    return factory(capacity_blocks)
