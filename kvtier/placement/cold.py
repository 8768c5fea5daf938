"""Which codec a block is written to the slow tiers with: exact, or lossy because its next use is far.

Owns: the rule (:class:`ColdCodecRule`) that turns what is known about a
block's next use when it is stored (the tool wait its agent announced for
the request that computed it) into a codec name for the SSD and remote
tiers. Must not encode, know tiers, or read engine state; the vLLM
connector's scheduler applies it to each store plan
(``kv_connector_extra_config.cold_codec`` / ``cold_after_s``). The replay
does not run this rule per block: its compressed-tier model
(:mod:`kvtier.replay.codec`) treats every block of a compressed tier as cold,
which is this rule at ``cold_after_s = 0``; the per-block choice is live only.

A block whose agent is about to wait at least ``after_s`` (a long tool call)
is cold: it goes to the slow tiers with ``codec`` (``rq4`` or ``rq3``,
:mod:`kvtier.tiers.rq`), about 3.8x / 5x smaller. Every other block is
written with the tier's own (exact) codec. The DRAM tier always holds exact
bytes, so a block written cold that is read back while its DRAM copy
lasts is exact; only a load from SSD or the remote store decodes the
approximation.

>>> rule = ColdCodecRule("rq4", after_s=30.0)
>>> rule.codec_for(120.0), rule.codec_for(5.0), rule.codec_for(None)
('rq4', None, None)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import ConfigError
from ..layout import KVLayout


@dataclass(frozen=True, slots=True)
class ColdCodecRule:
    """Blocks followed by a wait of at least ``after_s`` seconds are written with ``codec``."""

    codec: str
    after_s: float = 30.0

    def __post_init__(self) -> None:
        from ..tiers.codec import LOSSY_CODECS

        if self.codec not in LOSSY_CODECS:
            raise ConfigError("cold_codec", self.codec, f"must be a lossy codec: {', '.join(sorted(LOSSY_CODECS))}")
        if isinstance(self.after_s, bool) or not isinstance(self.after_s, (int, float)) or not (
                math.isfinite(self.after_s) and self.after_s >= 0):
            raise ConfigError("cold_after_s", self.after_s, "must be a number of seconds >= 0")

    def check_layout(self, layout: KVLayout, setting: str = "cold_codec") -> None:
        """Refuse, naming ``setting``, a layout the lossy codec cannot store."""
        from ..tiers.codec import check_codec_layout

        check_codec_layout(self.codec, layout, setting)

    def codec_for(self, wait_s: float | None) -> str | None:
        """The lossy codec for a block whose agent then waits ``wait_s`` (``None``:
        unknown, or no wait), or ``None`` for the tier's exact codec."""
        return self.codec if wait_s is not None and wait_s >= self.after_s else None
