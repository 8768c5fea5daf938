"""Approximate reuse's segment masters: which computed copy a declared shared block is read from.

Owns: the approximate namespace (its requests' keys never meet exact ones),
the master key of every whole block inside a request's declared segments (a
chain within the segment over its tokens, keyed by the request's salt and
LoRA), the index of masters (master key -> the key and block index of the copy
a request computed; bounded, oldest forgotten first), and the keys an
approximate request loads (a master stored at another offset, with the shift
its keys are turned by). Must not import vLLM, move bytes or decide what is
stored: the scheduler asks it, the worker re-rotates.
"""

from __future__ import annotations

import hashlib
import logging
from array import array
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from kvtier.keys import BlockKey, Namespace
from kvtier.sdk.handles import is_approximate_salt

log = logging.getLogger(__name__)

MAX_MASTERS = 1 << 18  # segment blocks remembered (oldest forgotten first)

Segments = list[tuple[int, int]]
"""(block index, master key) of each whole block inside a request's declared segments."""


class SegmentMasters:
    """The masters of declared shared segments (see the module doc). ``contains(key)``:
    whether a tier holds ``key`` readable now (the scheduler's manager)."""

    def __init__(self, namespace: Namespace, block_size: int, counters: Counter[str],
                 contains: Callable[[BlockKey], bool]) -> None:
        self.namespace = replace(namespace, tenant=namespace.tenant + "\x1fapproximate")
        self.block_size = block_size
        self.counters = counters
        self._contains = contains
        self._masters: OrderedDict[int, tuple[BlockKey, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._masters)

    def clear(self) -> None:
        self._masters.clear()

    def segment_blocks(self, request: Any, spans: list[tuple[int, int]]) -> Segments | None:
        """(block index, master key) of every whole block inside ``spans`` (may be empty:
        the request is keyed with the approximate ones, its blocks reusable by them);
        ``None`` (the request runs exact) when its ``cache_salt`` does not mark it
        approximate or its prompt is not token ids only."""
        salt = getattr(request, "cache_salt", None)
        if not is_approximate_salt(salt):
            self.counters["approximate_refused_unsalted"] += 1
            log.warning("kvtier: request %s declares approximate segments without the approximate cache_salt: "
                        "served exact (vLLM's prefix cache would mix its blocks with exact ones)", request.request_id)
            return None
        if getattr(request, "mm_features", None) or getattr(request, "prompt_embeds", None) is not None:
            self.counters["approximate_refused_multimodal"] += 1  # placeholder tokens do not name their content
            return None
        tokens = list(request.prompt_token_ids or ())
        bs = self.block_size
        lora = getattr(getattr(request, "lora_request", None), "lora_name", "") or ""
        root = hashlib.blake2b(self.namespace.digest + f"\x1f{salt}\x1f{lora}".encode(), digest_size=16)
        covered: set[int] = set()
        out: Segments = []
        for start, length in sorted(spans):
            if start % bs:
                self.counters["approximate_unaligned_segments"] += 1
                continue
            h = root.copy()
            for b in range(start // bs, min(start + length, len(tokens)) // bs):
                if b in covered:  # overlapping spans: a block belongs to the first one
                    break
                covered.add(b)
                h.update(array("i", tokens[b * bs:(b + 1) * bs]).tobytes())
                out.append((b, int.from_bytes(h.copy().digest()[:8], "little")))  # a chain within the segment
        self.counters["approximate_requests"] += 1
        return out

    def keys_to_load(self, segments: Segments, keys: Sequence[BlockKey]) -> tuple[list[BlockKey], list[int]]:
        """An approximate request's keys to load, and the shift (in positions) of each:
        a segment block whose master was stored at another offset by another request
        is read from there and its keys turned by the difference."""
        alt, shifts = list(keys), [0] * len(keys)
        contains = self._contains
        for b, master in segments:
            if b >= len(keys) or contains(keys[b]):  # its own copy (an earlier turn) is stored: read that
                continue
            src = self._masters.get(master)
            if src is not None and src[0] != keys[b] and contains(src[0]):
                alt[b], shifts[b] = src[0], (b - src[1]) * self.block_size
        return alt, shifts

    def register(self, segments: Segments, keys: Sequence[BlockKey], loaded: set[int]) -> None:
        """A finished approximate request: the segment blocks it computed (not ``loaded``
        from another's copy, which never becomes a master) become the masters of their
        segment, unless a readable master is known (the first copy stays while it can
        be read; a master gone from the tiers is replaced)."""
        for b, master in segments:
            if b >= len(keys) or b in loaded:
                continue
            known = self._masters.get(master)
            if known is None or (known[0] != keys[b] and not self._contains(known[0])):
                self._masters[master] = (keys[b], b)
                self._masters.move_to_end(master)
                self.counters["approximate_masters"] += 1
        while len(self._masters) > MAX_MASTERS:
            self._masters.popitem(last=False)
