"""Tool-duration prediction: client estimates blended with observed history.

Owns: per (agent type, tool), per tool and (optionally used) over-all EWMA statistics, a bounded empirical sample of
durations per tool (for quantiles and distributions), and the running error
of the predictions it made. Pure: no clock, no I/O; the caller passes
durations in seconds. Must stay bounded: at most ``max_keys`` statistics
entries and ``max_samples`` durations per tool, oldest forgotten first.

>>> h = DurationHistory(max_keys=8)
>>> for d in (2.0, 2.0, 2.0):
...     h.observe("coder", "bash", d)
>>> h.predict_s("coder", "bash", None), h.predict_s("coder", "bash", 5.0)
(2.0, 3.5)
>>> h.quantile_s("bash", 0.5)
2.0
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PredictionError:
    """How far predictions were from the durations that followed them."""

    num_predictions: int
    mean_abs_error_s: float
    mean_rel_error: float  # |predicted - actual| / max(actual, 0.1 s)
    under_fraction: float  # share of calls that returned later than predicted


class DurationHistory:
    """Observed durations per (agent type, tool): an EWMA and a sample count,
    plus a pooled entry per tool (agent type ``""``) that also keeps the last
    ``max_samples`` durations. At most ``max_keys`` entries; the
    oldest-inserted key is forgotten first.

    ``predict_s`` blends the client's estimate with history (the weight of
    history grows with its sample count); ``observe_error`` feeds the error
    statistics exported by :meth:`error`.
    """

    ALPHA = 0.3
    MIN_SAMPLES = 3
    GLOBAL = ("", "\0all tools")  # the entry over every tool (a name no tool has)

    def __init__(self, max_keys: int, max_samples: int = 256, *, global_fallback: bool = False) -> None:
        self.max_keys = max_keys
        self.max_samples = max_samples
        self.global_fallback = global_fallback
        self._stats: dict[tuple[str, str], list[float]] = {}  # key -> [ewma, count]
        self._samples: dict[str, deque[float]] = {}  # tool -> recent durations
        self._err_n = 0
        self._err_abs = 0.0
        self._err_rel = 0.0
        self._err_under = 0

    def __len__(self) -> int:
        return len(self._stats)

    def observe(self, agent_type: str, tool: str, duration_s: float) -> None:
        """Record one finished call (negative durations are clamped to 0). O(1)."""
        duration_s = max(0.0, duration_s)
        if agent_type:
            self._observe((agent_type, tool), duration_s)
        self._observe(("", tool), duration_s)
        if self.global_fallback:
            self._observe(self.GLOBAL, duration_s)
        samples = self._samples.get(tool)
        if samples is None:
            if len(self._samples) >= self.max_keys:
                del self._samples[next(iter(self._samples))]
            samples = self._samples[tool] = deque(maxlen=self.max_samples)
        samples.append(duration_s)

    def _observe(self, key: tuple[str, str], duration_s: float) -> None:
        entry = self._stats.get(key)
        if entry is None:
            if len(self._stats) >= self.max_keys:
                # the oldest scoped entry goes; the pooled per-tool and all-tools entries, the fallbacks every
                # scope shares, stay (unless nothing else is left)
                old = next((k for k in self._stats if k[0]), None) or next(iter(self._stats))
                del self._stats[old]
            self._stats[key] = [duration_s, 1.0]
        else:
            entry[0] += self.ALPHA * (duration_s - entry[0])
            entry[1] += 1.0

    def predict_s(self, agent_type: str, tool: str, client_s: float | None) -> float | None:
        """Blend ``client_s`` with history: ``w * ewma + (1 - w) * client_s``,
        ``w = n / (n + 3)``, using the agent type's entry when it has at least
        3 samples, else the tool's pooled entry, else (with ``global_fallback``)
        the entry over all tools. Only one of them known: that one; neither:
        ``None``. (A stream-derived agent's type is its session: per (session,
        tool), then per tool, then over all.)"""
        entry = self._stats.get((agent_type, tool))
        if entry is None or entry[1] < self.MIN_SAMPLES:
            entry = self._stats.get(("", tool))
        if (entry is None or entry[1] < self.MIN_SAMPLES) and self.global_fallback:
            entry = self._stats.get(self.GLOBAL)
        if entry is None or entry[1] < self.MIN_SAMPLES:
            return client_s
        if client_s is None:
            return entry[0]
        w = entry[1] / (entry[1] + 3.0)
        return w * entry[0] + (1.0 - w) * client_s

    def quantile_s(self, tool: str, q: float) -> float | None:
        """The ``q`` quantile (nearest rank) of the tool's recent durations; ``None``
        without samples. O(samples log samples)."""
        samples = self._samples.get(tool)
        if not samples:
            return None
        ordered = sorted(samples)
        return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]

    def samples(self, tool: str) -> tuple[float, ...]:
        """The tool's recent durations, oldest first (the empirical distribution)."""
        return tuple(self._samples.get(tool, ()))

    def observe_error(self, predicted_s: float, actual_s: float) -> None:
        """Score one prediction against the duration that followed it."""
        self._err_n += 1
        self._err_abs += abs(predicted_s - actual_s)
        self._err_rel += abs(predicted_s - actual_s) / max(actual_s, 0.1)
        self._err_under += actual_s > predicted_s

    def error(self) -> PredictionError:
        n = self._err_n
        if not n:
            return PredictionError(0, 0.0, 0.0, 0.0)
        return PredictionError(n, self._err_abs / n, self._err_rel / n, self._err_under / n)


def wait_pin_ttl_s(predicted_wait_s: float) -> float:
    """How long to pin a waiting agent's context: 1.5x the predicted wait plus 1 s,
    so a tool that runs somewhat long still returns to its KV, while a pin whose
    agent never comes back lapses on its own. One rule for the replay's reserve
    and the engine connector's tool-wait pins."""
    return 1.5 * predicted_wait_s + 1.0
