"""Movers: execute the TierManager's transfer plans (real bytes here; modelled in replay),
and the transfer-time model fitted from completed transfers (:mod:`.linkmodel`).

``TransferEngine`` / ``TransferJob`` load torch, so they are imported on first
use: the replay imports :mod:`.linkmodel` without pulling torch in.
"""

from typing import Any

__all__ = ["TransferEngine", "TransferJob"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import mover

        return getattr(mover, name)
    raise AttributeError(f"module 'kvtier.transfer' has no attribute {name!r}")
