"""Transfer-time model fitted online from completed transfers, per link and direction.

Owns: for each link name (``"hbm->dram"``, ``"dram->hbm"``, ``"ssd->dram"``,
...) an exponentially weighted least-squares fit of ``seconds = latency +
bytes / bandwidth`` over the transfers the mover (live) or the modelled mover
(replay) reported, with a prior used until enough samples arrived. Any
serial resource a transfer passes through can be a "link": the replay's
cold-tier codec reports its CPU stages as ``"codec:encode"`` and
``"codec:decode"`` (bytes = raw bytes; see :mod:`kvtier.replay.codec`). Pure
arithmetic: no clock, no I/O, no knowledge of which engine moved the bytes.
Must not return a negative or zero-bandwidth estimate.

>>> m = LinkModel(prior={"dram->hbm": (1e-5, 25e9)})
>>> round(m.predict_s("dram->hbm", 25_000_000) * 1e3, 3)  # the prior: 10 us + 1 ms
1.01
>>> for n in (1e6, 2e6, 4e6, 8e6):
...     m.observe("dram->hbm", int(n), 2e-5 + n / 10e9)  # the link is slower than thought
>>> round(m.predict_s("dram->hbm", 10_000_000) * 1e3, 2)
1.02
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class _Fit:
    n: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0
    count: int = 0


class LinkModel:
    """Online fit per link. ``prior``: link -> (latency_s, bandwidth_bytes_s)
    answered until ``min_samples`` transfers of that link were observed;
    ``decay`` < 1 weights recent transfers more (the link's load changes)."""

    def __init__(self, prior: dict[str, tuple[float, float]] | None = None, *, decay: float = 0.99,
                 min_samples: int = 4) -> None:
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay={decay!r}: must be in (0, 1]")
        self.prior = dict(prior or {})
        self.decay = decay
        self.min_samples = min_samples
        self._fits: dict[str, _Fit] = {}

    def observe(self, link: str, num_bytes: int, seconds: float) -> None:
        """One completed transfer of ``num_bytes`` that took ``seconds`` of service time. O(1)."""
        f = self._fits.setdefault(link, _Fit())
        d = self.decay
        x = float(num_bytes)
        f.n = f.n * d + 1.0
        f.sx = f.sx * d + x
        f.sy = f.sy * d + seconds
        f.sxx = f.sxx * d + x * x
        f.sxy = f.sxy * d + x * seconds
        f.count += 1

    def params(self, link: str) -> tuple[float, float] | None:
        """(latency_s, bandwidth_bytes_s) for ``link``: the fit once it has
        ``min_samples`` distinct-enough transfers, else the prior, else ``None``."""
        f = self._fits.get(link)
        if f is not None and f.count >= self.min_samples:
            var = f.sxx * f.n - f.sx * f.sx
            if var > 1e-9 * f.sxx * f.n:  # sizes vary: a line through the points
                slope = (f.sxy * f.n - f.sx * f.sy) / var
                intercept = (f.sy - slope * f.sx) / f.n
            else:  # one size seen: all of it is bandwidth
                slope, intercept = f.sy / f.sx if f.sx else 0.0, 0.0
            if slope > 0:
                return max(0.0, intercept), 1.0 / slope
        return self.prior.get(link)

    def predict_s(self, link: str, num_bytes: int) -> float:
        """Expected service time of moving ``num_bytes`` over ``link``; ``KeyError``
        for a link with neither samples nor a prior."""
        p = self.params(link)
        if p is None:
            raise KeyError(f"no transfer model for link {link!r}; known: {sorted(set(self.prior) | set(self._fits))}")
        latency_s, bw = p
        return latency_s + num_bytes / bw if num_bytes else 0.0

    def num_samples(self, link: str) -> int:
        f = self._fits.get(link)
        return f.count if f else 0
