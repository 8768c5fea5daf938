"""Eviction policies: one small module each, registered by name (see ``registry``)."""

from . import arc, fifo, lfu, lru, s3fifo  # noqa: F401  (each registers itself)
from .base import EvictionPolicy, IsEvictable
from .registry import make_policy, policy_names, register_policy

__all__ = ["EvictionPolicy", "IsEvictable", "make_policy", "policy_names", "register_policy"]
