"""Movers: execute the TierManager's transfer plans (real bytes here; modelled in replay)."""

from .mover import TransferEngine, TransferJob

__all__ = ["TransferEngine", "TransferJob"]
