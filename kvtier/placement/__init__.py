"""Placement: the decisions of what to keep where, shared by the live engine connectors and the replay.

Owns: the :class:`PlacementContext` interface a policy decides through, the
policies themselves (baselines in :mod:`.base`, agent-aware ones in
:mod:`.agent`), their registry (:mod:`.registry`), and :mod:`.surface` (which decisions an
engine's public surface lets a live connector carry out). Must not import
the simulator, an engine or a tier: everything a policy does goes through
the context its host implements (``kvtier.replay.sim.Simulator`` offline,
``kvtier_vllm.placement.EnginePlacement`` in vLLM).
"""

from .base import PlacementContext, PlacementPolicy, ToolWait
from .registry import make_placement, placement_names, register_placement

__all__ = ["PlacementContext", "PlacementPolicy", "ToolWait", "make_placement", "placement_names",
           "register_placement"]
