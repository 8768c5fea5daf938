"""One remote-tier client (:class:`~kvtier.tiers.remote.MooncakeTier`) per store,
namespace and process.

Owns: a process-wide, reference-counted table of open clients. vLLM may run
the scheduler and a worker in one process (in-process engine core, ``uni``
executor); both halves of the connector then use rank 0's client (the
scheduler to ask which blocks the store has, the worker to move bytes)
instead of joining the store twice. Must not decide anything about the
blocks, and imports ``mooncake`` only when a client is opened.
"""

from __future__ import annotations

from typing import Any

from kvtier.keys import Namespace
from kvtier.layout import KVLayout

from .reftable import RefTable
from .settings import RemoteSettings

_open = RefTable()  # (master, metadata server, namespace) -> client


def acquire(remote: RemoteSettings, namespace: Namespace, layout: KVLayout) -> Any:
    """The client of ``namespace`` in the store ``remote`` names (joined on first
    use); pair with :func:`release`. Raises :class:`~kvtier.tiers.remote.RemoteTierError`
    naming the setting when the store cannot be reached."""
    from kvtier.tiers.remote import MooncakeTier

    return _open.acquire((remote.master, remote.metadata_server, namespace),
                         lambda: MooncakeTier.from_config(namespace, layout, remote.tier))


def release(tier: Any) -> None:
    """Drop one reference; the last one leaves the store."""
    _open.release(tier)
