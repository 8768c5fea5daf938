"""What the simulator's collaborators see of it.

Owns: :class:`SimState`, the protocol that admission (:mod:`.admit`), the placement
context (:mod:`.context`), prefetches (:mod:`.prefetches`) and the victim cache
(:mod:`.victims`) type the simulator against. The simulator builds them and they act on
it, so they name what they use here rather than importing :mod:`.sim` (which imports
them). Must not hold state or logic: :class:`~kvtier.replay.sim.Simulator` is its one
implementation, and a name a collaborator starts to use is added here first.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, Protocol

from ..agents import AgentGraph
from ..manager import TierManager
from ..placement import PlacementPolicy
from ..placement.surface import Surface
from .mover import ModelledMover
from .runs import Run


class SimState(Protocol):
    """The simulator as its collaborators use it (see the module doc). Attributes typed ``Any``
    are the collaborators themselves (``ctx``, ``admission``, ``prefetches``, ``victims``), the
    configuration (a ``SimConfig``) and the hardware profile, whose modules import this one."""

    cfg: Any
    profile: Any
    policy: PlacementPolicy
    surface: Surface
    mgr: TierManager
    mover: ModelledMover
    graph: AgentGraph
    ctx: Any
    admission: Any
    prefetches: Any
    victims: Any
    oracle: Any
    order_log: list | None
    lower: list[str]
    block_size: int
    hbm_capacity_blocks: int
    now: float
    counters: dict[str, int]
    block_touches: int
    waiting: Any  # the admission queue: append, head, pop, iteration
    prefilling: list[Run]
    decoding: list[Run]
    admission_blocked: bool
    write_through_on: bool
    tool_history: deque[float]

    def schedule_at(self, t: float, fn: Callable[..., None], *args: Any) -> None:
        """Call ``fn(*args)`` when the simulated clock reaches ``t``."""

    def transfer_s(self, src: str, dst: str, num_blocks: int, num_encode: int | None = None) -> float:
        """When a copy of ``num_blocks`` from ``src`` to ``dst`` started now lands (simulated seconds)."""

    def load_beyond(self, run: Run, n_used: int, n_cached: int) -> None:
        """What a fleet engine loads past the ``n_used`` blocks ``run`` takes from this engine's tiers."""

    def running_blocks(self) -> int:
        """HBM blocks the running requests hold."""
