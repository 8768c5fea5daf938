"""Load or recompute, per request: the rules a host can apply to a lower-tier hit.

Owns: :data:`LOAD_RULES` and :func:`make_load_rule`, the per-request choice
between loading a cached prefix's DRAM / SSD blocks into HBM and recomputing
them (the blocks already in HBM are always used):

* ``surface`` (the replay's default): whatever the engine surface says. On
  ``full`` the placement policy's own ``should_load``, on the vLLM surfaces
  every hit loads, as the connector does by default;
* ``always``: every hit loads;
* ``never``: every lower-tier hit is recomputed (the host tiers are still
  written; nothing comes back from them);
* ``cost``: the policy's ``should_load`` (kvtier's: a load's predicted
  transfer against recomputing at the engine's prefill rate), on any surface.
  Live: the connector's ``recompute_when_cheaper: true``;
* ``llm-d``: the llm-d router's selective KV load (llm-d/llm-d-router PR #2833,
  ``selectivekv`` plugin, read at commit e872cb8d; rule paraphrased, no code
  taken): load only when the tokens the host tiers add beyond the HBM hit
  are at least ``min_external_tokens`` (1024 in its evaluation) and a gate on
  the engine's waiting queue is open. The gate follows an exponentially
  weighted mean of the number of waiting requests (a sample's weight is
  ``1 - exp(-ln 2 * dt / 2 s)``), closes when the mean reaches
  ``max_waiting`` (8) and opens again at half of it. Modelled: the rule, its
  defaults and its gate, sampled at each admission attempt (the router samples
  vLLM's ``num_requests_waiting`` metric when a request is routed; a retry at
  the same moment adds nothing, as the sample's weight is 0).
  Not modelled: the router's choice of endpoint, and its failing open when a
  tier reports nothing. Live, the router sends ``max_load_tokens: 0`` in
  ``kv_transfer_params`` to recompute, which vLLM's offloading connector
  honours.

Must not move blocks, count anything or read the simulator: a host calls
:meth:`LoadRule.observe` for every request it is about to admit and
:meth:`LoadRule.load` for one with a DRAM / SSD hit, and does what it answers.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from ..errors import ConfigError

LOAD_RULES = ("surface", "always", "never", "cost", "llm-d")


class LoadRule:
    """One load-or-recompute rule (see the module doc)."""

    name = "surface"

    def observe(self, now: float, waiting_requests: int) -> None:
        """A request is about to be admitted at ``now``, with ``waiting_requests`` waiting."""

    def load(self, policy: Any, ctx: Any, by_tier: Mapping[str, int], surface_chooses: bool) -> bool:
        """Load the lower-tier blocks of this hit (``by_tier``: blocks per tier past the HBM
        part)? ``surface_chooses``: the engine surface lets the policy choose."""
        return not surface_chooses or policy.should_load(ctx, dict(by_tier), 0)


class _Always(LoadRule):
    name = "always"

    def load(self, policy: Any, ctx: Any, by_tier: Mapping[str, int], surface_chooses: bool) -> bool:
        return True


class _Never(LoadRule):
    name = "never"

    def load(self, policy: Any, ctx: Any, by_tier: Mapping[str, int], surface_chooses: bool) -> bool:
        return False


class _Cost(LoadRule):
    name = "cost"

    def load(self, policy: Any, ctx: Any, by_tier: Mapping[str, int], surface_chooses: bool) -> bool:
        return bool(policy.should_load(ctx, dict(by_tier), 0))


class SelectiveLoad(LoadRule):
    """llm-d's selective KV load (see the module doc); ``now`` from the host's clock."""

    name = "llm-d"

    def __init__(self, min_external_tokens: int = 1024, max_waiting: float = 8.0, half_life_s: float = 2.0) -> None:
        self.min_external_tokens = min_external_tokens
        self.max_waiting = max_waiting
        self.half_life_s = half_life_s
        self.mean_waiting: float | None = None
        self.gate_open = True
        self._last_s = 0.0

    def observe(self, now: float, waiting_requests: int) -> None:
        """Fold in one sample of the waiting queue and move the gate (closed at ``max_waiting``,
        open again at half of it)."""
        if self.mean_waiting is None:
            self.mean_waiting = float(waiting_requests)
        else:
            weight = 1.0 - math.exp(-math.log(2.0) * max(0.0, now - self._last_s) / self.half_life_s)
            self.mean_waiting += weight * (waiting_requests - self.mean_waiting)
        self._last_s = now
        if self.gate_open and self.mean_waiting >= self.max_waiting:
            self.gate_open = False
        elif not self.gate_open and self.mean_waiting <= 0.5 * self.max_waiting:
            self.gate_open = True

    def load(self, policy: Any, ctx: Any, by_tier: Mapping[str, int], surface_chooses: bool) -> bool:
        external_tokens = sum(by_tier.values()) * ctx.block_size
        return self.gate_open and external_tokens >= self.min_external_tokens


_RULES: dict[str, type[LoadRule]] = {"surface": LoadRule, "always": _Always, "never": _Never, "cost": _Cost,
                                     "llm-d": SelectiveLoad}


def make_load_rule(name: str) -> LoadRule:
    """A fresh rule by name (one per replay: ``llm-d``'s gate has state); a clear error names the setting."""
    if name not in _RULES:
        raise ConfigError("--load-rule", name, f"valid: {', '.join(LOAD_RULES)}")
    return _RULES[name]()
