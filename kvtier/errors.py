"""Exceptions raised by kvtier.

Owns: the exception hierarchy. Expected failures (a store that cannot find
room, a load whose bytes do not verify) are *values* (``None``, ``ok=False``)
and never exceptions; exceptions are for misuse and bad configuration, and
their messages name the setting, field or file to fix.
"""

from __future__ import annotations


class KVTierError(Exception):
    """Base class of every kvtier exception."""


class ConfigError(KVTierError, ValueError):
    """A setting is invalid; the message names the setting and its value."""

    def __init__(self, setting: str, value: object, problem: str) -> None:
        self.setting = setting
        self.value = value
        self.problem = problem
        super().__init__(f"{setting}={value!r}: {problem}")


class UnknownPolicyError(ConfigError):
    """A policy name is not registered; the message lists the valid names."""


class ProtocolError(KVTierError, RuntimeError):
    """A caller broke a two-phase protocol (e.g. completed a plan twice)."""


class StorageError(KVTierError, OSError):
    """The SSD tier cannot operate (unwritable directory, full map, ...)."""
