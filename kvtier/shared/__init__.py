"""Shared context across agents: one master copy per shared segment plus per-agent diffs.

Owns nothing itself; re-exports the public names of :mod:`.segments` (content
keys), :mod:`.diff` (the diff codec), :mod:`.index` (bookkeeping) and
:mod:`.store` (bytes, fused restore). :mod:`.kvmodel` (a small torch
transformer producing real KV for measurements) is imported on demand.
"""

from .diff import DiffSpec, decode_diff, encode_diff
from .index import AgentId, SegmentInfo, SharedIndex
from .segments import SegmentKey, segment_block_keys, segment_key
from .store import EvictResult, PutResult, RestoreRequest, SharedConfig, SharedStore

__all__ = [
    "AgentId", "DiffSpec", "EvictResult", "PutResult", "RestoreRequest", "SegmentInfo", "SegmentKey",
    "SharedConfig", "SharedIndex", "SharedStore", "decode_diff", "encode_diff", "segment_block_keys",
    "segment_key",
]
