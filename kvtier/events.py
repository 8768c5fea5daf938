"""Events: the single record of every state change in a TierManager.

Owns: the event value types. Metrics, engine KV-event publishing, trace
recording and replay reports consume these; nothing else is authoritative.
Must not hold references to bytes or tensors.

Events are values: nobody mutates one after it is made. They are plain
slotted dataclasses (hashable, compared by value) rather than ``frozen``
ones because a frozen dataclass builds each instance through
``object.__setattr__`` — about 3x slower, and the manager makes one event
per block of every store and load.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Union

from .keys import BlockKey

RemoveReason = Literal["evicted", "removed", "moved", "failed_verify"]


@dataclass(slots=True, unsafe_hash=True)
class BlockStored:
    """``key`` became readable in ``tier`` (a store or a move completed and verified)."""

    key: BlockKey
    tier: str
    parent: BlockKey | None


@dataclass(slots=True, unsafe_hash=True)
class BlockRemoved:
    """``key`` stopped being readable in ``tier`` (or its pending store was dropped)."""

    key: BlockKey
    tier: str
    reason: RemoveReason


@dataclass(slots=True, unsafe_hash=True)
class StoreFailed:
    """A prepared store (or the destination side of a move) of ``key`` into ``tier`` failed."""

    key: BlockKey
    tier: str


@dataclass(slots=True, unsafe_hash=True)
class BlockLoaded:
    """A load of ``key`` from ``tier`` finished; ``ok`` is False when it did not verify."""

    key: BlockKey
    tier: str
    ok: bool


@dataclass(slots=True, unsafe_hash=True)
class BlockPinned:
    key: BlockKey
    expires_at: float


@dataclass(slots=True, unsafe_hash=True)
class BlockUnpinned:
    key: BlockKey
    reason: Literal["unpinned", "expired"]


@dataclass(slots=True, unsafe_hash=True)
class PinRefused:
    """A pin of ``num_blocks`` blocks was refused: it would exceed the pin budget."""

    num_blocks: int
    budget_blocks: int


Event = Union[BlockStored, BlockRemoved, StoreFailed, BlockLoaded, BlockPinned, BlockUnpinned, PinRefused]
