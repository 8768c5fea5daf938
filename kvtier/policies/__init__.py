"""Eviction policies: one small module each, registered by name (see ``base``)."""

from .base import EvictionPolicy, IsEvictable, make_policy, policy_names, register_policy

__all__ = ["EvictionPolicy", "IsEvictable", "make_policy", "policy_names", "register_policy"]
