"""Prefix breaks: an agent's new request that does not begin with its previous prompt.

An agent's context only grows: its next request repeats its last prompt and adds to it,
so everything the engine and kvtier cached of that prompt is reused. A client that
rewrites something near the top (a timestamp or a task list in the system prompt, a
hash a gateway injects, a reordered tool list) breaks that prefix: every block after the
first changed token is computed again, each turn, and the hit rate drops with no error
anywhere. This module notices it for agents named by kvtier's tags (the SDK, the
request-stream middleware with an agent header): the new request's tokens against the
agent's previous prompt.

A break is a first differing token before the previous prompt's last full block (a
difference in that block is a template closing the turn, or a branch at its end, not a
break). Counted: ``prefix_breaks``, ``prefix_break_tokens_lost`` (the previous prompt's
tokens after the break's block start, which the engine computes again); logged once per
session with the token offset and block of the first difference.

Owns: each tracked agent's last prompt tokens (a compact array, at most
:data:`MAX_TOKENS` of them, for at most :data:`MAX_AGENTS` agents, least recently seen
forgotten first) and the sessions already logged. Must not: import vLLM, change a
request's placement, or log more than once per session.
"""

from __future__ import annotations

import logging
from array import array
from collections import Counter, OrderedDict
from collections.abc import Sequence

import numpy as np

log = logging.getLogger(__name__)

MAX_AGENTS = 1024
MAX_TOKENS = 32_768
MAX_LOGGED_SESSIONS = 4096

AgentKey = tuple[str, str]


def first_difference(a: array, b: array) -> int:
    """The first index where ``a`` and ``b`` differ (the shorter's length when one is a prefix of the other)."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    x = np.frombuffer(a, dtype=np.uint32, count=n)
    y = np.frombuffer(b, dtype=np.uint32, count=n)
    diff = np.flatnonzero(x != y)
    return int(diff[0]) if diff.size else n


class PrefixBreaks:
    """Prefix breaks per agent (see the module doc)."""

    def __init__(self, counters: Counter[str], block_size: int) -> None:
        self.counters = counters
        self.block_size = block_size
        self._last: OrderedDict[AgentKey, array] = OrderedDict()
        self._logged: OrderedDict[str, None] = OrderedDict()

    def arrived(self, agent: AgentKey | None, prompt_token_ids: Sequence[int] | None) -> int | None:
        """A new request of ``agent``: the token offset of its prefix break, or ``None`` (no break,
        the agent's first request, or nothing to compare). Remembers its prompt for the next."""
        if agent is None or prompt_token_ids is None:
            return None
        try:
            tokens = array("I", prompt_token_ids[:MAX_TOKENS])
        except (OverflowError, TypeError):  # not token ids: nothing to compare
            return None
        prev = self._last.get(agent)
        self._last[agent] = tokens
        self._last.move_to_end(agent)
        while len(self._last) > MAX_AGENTS:
            self._last.popitem(last=False)
        if prev is None:
            return None
        at = first_difference(prev, tokens)
        last_full_block = (len(prev) // self.block_size - 1) * self.block_size  # where the last full block starts
        if at >= last_full_block or at >= len(tokens):
            return None  # it continues the previous prompt, differs only in its last block, or is a prefix of it
        block = at // self.block_size
        lost = len(prev) - block * self.block_size
        self.counters["prefix_breaks"] += 1
        self.counters["prefix_break_tokens_lost"] += lost
        session = agent[0]
        if session not in self._logged:
            self._logged[session] = None
            while len(self._logged) > MAX_LOGGED_SESSIONS:
                self._logged.popitem(last=False)
            log.warning("kvtier: session %s, agent %s: the request does not begin with the agent's previous prompt: "
                        "first difference at token %d (block %d of %d tokens); the %d cached tokens after that "
                        "block's start are computed again. A timestamp, id or list near the top of the prompt "
                        "breaks the prefix each turn (docs/agents.md, \"Prefix breaks\"); logged once per session",
                        session[:64], agent[1][:64], at, block, self.block_size, lost)
        return at
