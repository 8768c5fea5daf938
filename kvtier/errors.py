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


class MissingExtraError(KVTierError, ModuleNotFoundError):
    """An optional dependency is not installed; the message names the extra that brings it. The CLI prints
    it as one line and exits 2 (an install problem, not a bug); ``except ImportError`` still catches it."""

    def __init__(self, what: str, extra: str, module: str) -> None:
        self.extra = extra
        super().__init__(f"{what} needs the '{extra}' extra ({module} is not installed): "
                         f"pip install 'kvtier[{extra}]'", name=module)


class FetchError(KVTierError, OSError):
    """A download failed or did not verify; the message names the file, its URL and what went wrong."""


class ProtocolError(KVTierError, RuntimeError):
    """A caller broke a two-phase protocol (e.g. completed a plan twice)."""


class StorageError(KVTierError, OSError):
    """The SSD tier cannot operate (unwritable directory, full map, ...)."""
