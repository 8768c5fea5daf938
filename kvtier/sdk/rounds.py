"""Round-aware prompt layout: exact sharing of an all-gather round's context through a common prefix.

Owns: the order in which a multi-agent application's shared context and each
agent's own text are laid out as token ids. Every agent's prompt in a round
begins with the same tokens: the preamble, then the outputs of every round so
far, each round's in a canonical order (by agent id). An engine's prefix cache
and kvtier's chained block keys then store that prefix once per round, not
once per agent. What follows it (the agent's persona, own history and task) is
the agent's private suffix: its "diff" from the others is real blocks of its
own, not numeric deltas, and nothing is approximated.

To keep the round's prefix while its agents run one after another (tool waits
between them), announce the round on the hint plane
(``SessionHandle.shared_round(round_id, agent_ids)``) and tag each of its
requests with :func:`kvtier.sdk.handles.tag_round` (``RoundPrompt.shared_tokens``):
the vLLM connector then holds the shared blocks in HBM and pins them in its
tiers until every announced agent was served.

Must not tokenize, call an engine or send hints (pure; the caller tokenizes
each piece, e.g. with the model's chat template applied to the pieces). The
layout changes the prompt itself: whether that changes an application's
answers is for the application to test.

>>> layout = RoundLayout(preamble=[1, 2, 3])
>>> layout.add_round({"b": [20, 21], "a": [10]})  # canonical order: a, then b
>>> p = layout.prompt(private=[7, 7])
>>> p.tokens, p.shared_tokens
([1, 2, 3, 10, 20, 21, 7, 7], 6)
>>> p.shared_blocks(block_size=4)  # full blocks every agent of the round shares
1
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence


@dataclass(frozen=True, slots=True)
class RoundPrompt:
    """One agent's prompt of a round: ``tokens``, of which the first ``shared_tokens``
    are the same for every agent of the round."""

    tokens: list[int]
    shared_tokens: int

    def shared_blocks(self, block_size: int) -> int:
        """Full blocks of ``block_size`` tokens inside the shared prefix (the block
        holding its end and the private start is the agent's own)."""
        return self.shared_tokens // block_size


class RoundLayout:
    """The shared context of an all-gather application, round by round; see the module docstring."""

    def __init__(self, preamble: Sequence[int]) -> None:
        self._shared: list[int] = [int(t) for t in preamble]
        self.rounds = 0

    @property
    def shared(self) -> list[int]:
        """The prefix every agent's next prompt begins with (a copy)."""
        return list(self._shared)

    def add_round(self, outputs: Mapping[str, Sequence[int]]) -> None:
        """Append a finished round: ``outputs`` maps each agent id to its output
        tokens. They go in by agent id, so the order in which agents finished (or
        the caller's dict order) does not change the prefix."""
        for agent in sorted(outputs):
            tokens = outputs[agent]
            if not isinstance(agent, str):
                raise TypeError(f"add_round: agent ids must be str, got {agent!r}")
            self._shared.extend(int(t) for t in tokens)
        self.rounds += 1

    def prompt(self, private: Sequence[int]) -> RoundPrompt:
        """An agent's prompt for the next round: the shared prefix, then ``private``
        (its persona, own history and task)."""
        return RoundPrompt(self._shared + [int(t) for t in private], len(self._shared))
