"""The replay's modelled mover: links and codec stages as FIFO queues of modelled time.

Owns: when each stage of a copy (a link such as ``hbm->dram``, or a cold
codec's encode / decode, :mod:`kvtier.replay.codec`) is free next, the bytes
moved per link, the codec's block counters, and the transfer model
(:class:`~kvtier.transfer.linkmodel.LinkModel`) fed with every modelled
service time, as a live mover reports its completions. Must not change block
residency (the simulator's :class:`~kvtier.manager.TierManager` plans and
completes moves; this only says when the bytes arrive) or schedule events.
"""

from __future__ import annotations

from typing import Any, Sequence

from ..keys import BlockKey
from ..transfer.linkmodel import LinkModel
from .codec import CODEC_STAGES, ENCODE, ColdCodec, transfer_stages


class ModelledMover:
    """FIFO stages of modelled copies; ``counters`` is the simulator's (codec blocks go there)."""

    def __init__(self, profile: Any, codec: ColdCodec | None, bytes_per_block: int, counters: dict[str, int]) -> None:
        self.profile, self.codec, self.bytes_per_block, self.counters = profile, codec, bytes_per_block, counters
        self.link_free_s: dict[str, float] = {}
        self.bytes_moved: dict[str, int] = {}
        self.links = LinkModel(prior=dict(getattr(profile, "_link_to_cost", {})) |
                               (codec.prior() if codec is not None else {}))

    def transfer(self, now: float, src: str, dst: str, num_blocks: int, num_encode: int | None = None) -> float:
        """Queue a copy of ``num_blocks`` from ``src`` to ``dst`` at ``now`` on its stages (the
        link(s), and the codec's encode / decode where a compressed tier is entered / left),
        each a FIFO; returns its finish time. ``num_encode``: blocks to encode (default all)."""
        t = now
        for stage, nbytes in transfer_stages(self.codec, src, dst, num_blocks, self.bytes_per_block, num_encode):
            start = max(t, self.link_free_s.get(stage, 0.0))
            service_s = self.service_s(stage, nbytes)
            self.links.observe(stage, nbytes, service_s)  # what a live mover reports on completion
            t = start + service_s
            self.link_free_s[stage] = t
            if stage in CODEC_STAGES:
                name = "codec_encoded_blocks" if stage == ENCODE else "codec_decoded_blocks"
                self.counters[name] = self.counters.get(name, 0) + nbytes // self.bytes_per_block
            else:
                self.bytes_moved[stage] = self.bytes_moved.get(stage, 0) + nbytes
        return t

    def link_copy(self, now: float, link: str, nbytes: int, gbps: float) -> float:
        """Queue ``nbytes`` on a plain ``link`` of ``gbps`` GB/s outside the profile (a fleet's
        remote tier): FIFO, bytes over bandwidth; returns its finish time."""
        start = max(now, self.link_free_s.get(link, 0.0))
        done = start + nbytes / (gbps * 1e9)
        self.link_free_s[link] = done
        self.bytes_moved[link] = self.bytes_moved.get(link, 0) + nbytes
        return done

    def service_s(self, stage: str, nbytes: int) -> float:
        """Service time of one stage of a transfer (a link, or the codec's CPU)."""
        if stage in CODEC_STAGES:
            assert self.codec is not None
            return self.codec.service_s(stage, nbytes)
        return self.profile.transfer_time_s(nbytes, stage)

    def path_s(self, src: str, dst: str, num_blocks: int) -> float:
        """Service time of a copy from ``src`` to ``dst`` on idle stages (no queueing)."""
        return sum(self.service_s(stage, nbytes)
                   for stage, nbytes in transfer_stages(self.codec, src, dst, num_blocks, self.bytes_per_block))

    def predict_s(self, num_blocks: int, link: str) -> float:
        """Expected time to move ``num_blocks`` over ``link`` (``ssd->hbm``: both hops; with a
        cold codec, its encode / decode too), from the transfer model fitted to completed copies."""
        src, dst = link.split("->")
        return sum(self.links.predict_s(stage, nbytes)
                   for stage, nbytes in transfer_stages(self.codec, src, dst, num_blocks, self.bytes_per_block))

    def queued_s(self, link: str, now: float) -> float:
        """Seconds after ``now`` until the busiest stage of ``link``'s path (``ssd->hbm``: both hops,
        and a cold codec's decode) has done the copies queued on it."""
        src, dst = link.split("->")
        stages = [stage for stage, _ in transfer_stages(self.codec, src, dst, 1, self.bytes_per_block)]
        return max([0.0, *(self.link_free_s.get(stage, 0.0) - now for stage in stages)])

    def num_to_encode(self, mgr: Any, lower: Sequence[str], keys: Sequence[BlockKey], dst: str) -> int | None:
        """How many of ``keys``, written down from HBM to ``dst``, the codec encodes: those
        without a compressed copy, held or arriving, in another compressed tier of ``lower``
        (a block is never compressed twice: its compressed bytes are what goes down).
        ``None`` (all) without a codec."""
        if self.codec is None:
            return None
        others = [t for t in lower if t != dst and self.codec.compresses(t)]
        if not others:
            return None
        return sum(1 for k in keys if not any(mgr.contains(k, t) or mgr.is_pending(k, t) for t in others))
