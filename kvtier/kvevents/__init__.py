"""Engine KV events in vLLM's wire format (ZMQ + msgpack): publish kvtier's tier
residency so KV-aware routers see DRAM and SSD, and consume an engine's events
to keep the TierManager's view of HBM.

Owns nothing itself; see :mod:`.wire` (format), :mod:`.publisher`,
:mod:`.subscriber` and :mod:`.hbm_view`. ``import kvtier`` does not import this
package; importing it does not import zmq or msgpack (they load on first use
and need ``pip install 'kvtier[events]'``).
"""

from .hbm_view import EngineKeyMap, HBMView
from .publisher import KVEventPublisher
from .subscriber import KVEventSubscriber
from .wire import (
    END_SEQ,
    MEDIUM_CPU,
    MEDIUM_GPU,
    MEDIUM_STORAGE,
    TIER_TO_MEDIUM,
    KVAllBlocksCleared,
    KVBlockRemoved,
    KVBlockStored,
    KVEventBatch,
    KVUnknownEvent,
    decode_batch,
    encode_batch,
    to_wire,
)

__all__ = [
    "END_SEQ", "MEDIUM_CPU", "MEDIUM_GPU", "MEDIUM_STORAGE", "TIER_TO_MEDIUM",
    "EngineKeyMap", "HBMView", "KVAllBlocksCleared", "KVBlockRemoved", "KVBlockStored", "KVEventBatch",
    "KVEventPublisher", "KVEventSubscriber", "KVUnknownEvent", "decode_batch", "encode_batch", "to_wire",
]
