"""vLLM's KV-event wire format (vLLM 0.32 ``vllm/distributed/kv_events.py``), in msgpack.

Owns: the value types of the engine event stream and their exact bytes, and
the mapping from kvtier's :mod:`kvtier.events` to them. Must not open sockets
(see :mod:`.publisher` / :mod:`.subscriber`) or touch a TierManager.

The format, as vLLM's msgspec types produce it:

* a ZMQ message is three frames: topic (UTF-8), sequence number (8 bytes,
  big-endian, from 0), payload;
* payload = msgpack array ``[ts, events, data_parallel_rank]`` (``ts`` a
  float64; the rank is left out when ``None``);
* each event is a msgpack map whose first key is ``"type"`` (the class name:
  ``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``), then the fields in
  declaration order; the required fields are always present (``None`` as nil),
  fields with a default are left out while they equal it. Block hashes are
  ``bytes`` (msgpack bin) or ``int``.

Decoding also accepts the older array form of events (``["BlockStored", ...]``)
and keeps an event of an unknown type as :class:`KVUnknownEvent`.

kvtier keys are 128-bit, wider than a msgpack int, so by default a kvtier key
is published as its 16 big-endian bytes; pass ``external_id`` to publish the
engine's own block hashes instead (what KV-aware routers index).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Union

from ..errors import ProtocolError
from ..events import BlockRemoved, BlockStored, Event
from ..keys import BlockKey, key_to_bytes

ExternalBlockHash = Union[bytes, int]  # noqa: UP007 - a runtime alias, also on Python 3.10

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"
TIER_TO_MEDIUM: Mapping[str, str] = {"hbm": MEDIUM_GPU, "dram": MEDIUM_CPU, "ssd": MEDIUM_STORAGE,
                                     "remote": MEDIUM_STORAGE}
"""Default ``medium`` of each kvtier tier (vLLM's own medium names; the remote tier,
a store shared by engines, is ``STORAGE`` with locality ``REMOTE``)."""

END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""Sequence frame that ends a replay reply."""


@dataclass(frozen=True, slots=True)
class KVBlockStored:
    """Blocks ``block_hashes`` (a chain after ``parent_block_hash``) became cached in ``medium``."""

    block_hashes: tuple[ExternalBlockHash, ...]
    parent_block_hash: ExternalBlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: tuple[tuple[Any, ...] | None, ...] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


@dataclass(frozen=True, slots=True)
class KVBlockRemoved:
    """Blocks ``block_hashes`` stopped being cached in ``medium``."""

    block_hashes: tuple[ExternalBlockHash, ...]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


@dataclass(frozen=True, slots=True)
class KVAllBlocksCleared:
    """The engine dropped its whole prefix cache."""


@dataclass(frozen=True, slots=True)
class KVUnknownEvent:
    """An event of a type this version does not know (kept, not applied)."""

    type: str


KVEvent = Union[KVBlockStored, KVBlockRemoved, KVAllBlocksCleared, KVUnknownEvent]  # noqa: UP007


@dataclass(frozen=True, slots=True)
class KVEventBatch:
    """One published message: events of one engine step."""

    ts: float
    events: tuple[KVEvent, ...]
    data_parallel_rank: int | None = None


# (required fields, fields with a default) per type, in vLLM's declaration order
_FIELDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "BlockStored": (
        ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name"),
        ("extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window", "locality", "ownership",
         "session_id"),
    ),
    "BlockRemoved": (("block_hashes", "medium"), ("group_idx", "locality", "ownership")),
    "AllBlocksCleared": ((), ()),
}
_CLASSES: dict[str, type] = {"BlockStored": KVBlockStored, "BlockRemoved": KVBlockRemoved,
                             "AllBlocksCleared": KVAllBlocksCleared}
_NAMES = {cls: name for name, cls in _CLASSES.items()}


def _msgpack() -> Any:
    try:
        import msgpack
    except ModuleNotFoundError:
        from ..errors import MissingExtraError

        raise MissingExtraError("kvtier.kvevents (engine KV events)", "events", "msgpack") from None
    return msgpack


def _event_map(event: KVEvent) -> dict[str, Any]:
    name = _NAMES.get(type(event))
    if name is None:
        raise TypeError(f"cannot encode {type(event).__name__}; only BlockStored/BlockRemoved/AllBlocksCleared")
    required, optional = _FIELDS[name]
    out: dict[str, Any] = {"type": name}
    for f in required:
        out[f] = getattr(event, f)
    for f in optional:
        value = getattr(event, f)
        if value is not None:
            out[f] = value
    return out


def encode_batch(batch: KVEventBatch) -> bytes:
    """The msgpack payload of ``batch``, byte-identical to vLLM's encoder."""
    body: list[Any] = [float(batch.ts), [_event_map(e) for e in batch.events]]
    if batch.data_parallel_rank is not None:
        body.append(batch.data_parallel_rank)
    return _msgpack().packb(body, use_bin_type=True)


def decode_batch(payload: bytes) -> KVEventBatch:
    """Inverse of :func:`encode_batch`; raises :class:`ProtocolError` on a
    payload that is not an event batch."""
    msgpack = _msgpack()
    try:
        body = msgpack.unpackb(payload, raw=False)
    except (ValueError, msgpack.UnpackException) as err:
        raise ProtocolError(f"KV event payload is not msgpack: {err}") from None
    if not isinstance(body, list) or len(body) not in (2, 3) or not isinstance(body[1], list):
        raise ProtocolError(f"KV event payload must be [ts, events(, dp_rank)], got {type(body).__name__}")
    rank = body[2] if len(body) == 3 else None
    return KVEventBatch(float(body[0]), tuple(_decode_event(e) for e in body[1]), rank)


def _decode_event(raw: Any) -> KVEvent:
    if isinstance(raw, dict):
        name = raw.get("type")
        values = raw
    elif isinstance(raw, list) and raw and isinstance(raw[0], str):  # older array_like events
        name = raw[0]
        fields = _FIELDS.get(name, ((), ()))
        values = dict(zip(fields[0] + fields[1], raw[1:]))
    else:
        raise ProtocolError(f"KV event must be a map or a tagged array, got {raw!r:.80}")
    if name not in _CLASSES:
        return KVUnknownEvent(str(name))
    required, optional = _FIELDS[name]
    missing = [f for f in required if f not in values]
    if missing:
        raise ProtocolError(f"KV event {name} lacks field(s) {', '.join(missing)}")
    kwargs = {f: _freeze(values[f]) for f in required + optional if f in values}
    return _CLASSES[name](**kwargs)


def _freeze(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    return value


def to_wire(
    events: Sequence[Event],
    *,
    block_size: int,
    tiers: Sequence[str] | None = None,
    medium_of_tier: Mapping[str, str] = TIER_TO_MEDIUM,
    external_id: Callable[[BlockKey], ExternalBlockHash] = key_to_bytes,
    token_ids_of: Callable[[BlockKey], Sequence[int]] | None = None,
) -> list[KVEvent]:
    """vLLM events for kvtier's tier events, in order.

    ``BlockStored`` / ``BlockRemoved`` of the ``tiers`` given (all when
    ``None``) become ``KVBlockStored`` / ``KVBlockRemoved`` with ``medium`` from
    ``medium_of_tier``; a run of stores that continues one chain in one tier is
    one event, as are consecutive removals from one tier. Other events (loads,
    pins, failures) are not engine events and are left out. Token ids are
    published only when ``token_ids_of`` knows them.
    """
    out: list[KVEvent] = []
    run: list[Event] = []

    def flush() -> None:
        if not run:
            return
        first = run[0]
        hashes = tuple(external_id(e.key) for e in run)
        medium = medium_of_tier.get(first.tier, first.tier)
        if isinstance(first, BlockStored):
            tokens = tuple(t for e in run for t in token_ids_of(e.key)) if token_ids_of is not None else ()
            parent = None if first.parent is None else external_id(first.parent)
            out.append(KVBlockStored(hashes, parent, tokens, block_size, None, medium, None))
        else:
            out.append(KVBlockRemoved(hashes, medium))
        run.clear()

    for event in events:
        if not isinstance(event, (BlockStored, BlockRemoved)) or (tiers is not None and event.tier not in tiers):
            continue
        if run:
            last = run[-1]
            same = type(last) is type(event) and last.tier == event.tier
            if not same or (isinstance(event, BlockStored) and event.parent != last.key):
                flush()
        run.append(event)
    flush()
    return out
