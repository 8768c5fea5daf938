"""A process-wide table of open resources shared by reference count.

Owns: :class:`RefTable`, the open-once, close-on-last-release bookkeeping that
:mod:`~.ssdshare` (one LMDB environment per directory and process) and
:mod:`~.remoteshare` (one store client per store and namespace) both need when
vLLM runs the scheduler and a worker in one process. Must not know what it
holds beyond ``close()``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Any


class RefTable:
    """Resources by key: :meth:`acquire` opens one on first use, :meth:`release` closes it with its last user."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[Hashable, list[Any]] = {}  # key -> [resource, references]

    def acquire(self, key: Hashable, open_fn: Callable[[], Any], check: Callable[[Any], None] | None = None) -> Any:
        """The resource of ``key`` (``open_fn()`` on first use); ``check`` may refuse a
        resource already open (it raises). Pair with :meth:`release`."""
        with self._lock:
            entry = self._open.get(key)
            if entry is None:
                entry = self._open[key] = [open_fn(), 0]
            elif check is not None:
                check(entry[0])
            entry[1] += 1
            return entry[0]

    def release(self, resource: Any) -> None:
        """Drop one reference to ``resource``; the last one closes it."""
        with self._lock:
            for key, entry in list(self._open.items()):
                if entry[0] is resource:
                    entry[1] -= 1
                    if entry[1] == 0:
                        del self._open[key]
                        resource.close()
                    return
