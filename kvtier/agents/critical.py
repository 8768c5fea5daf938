"""Critical-path analysis of an agent dependency DAG.

Owns: the longest expected remaining path *through* each agent and the
criticality derived from it (1.0 on the critical path, smaller off it), with
join-group inheritance: sub-agents that one join waits for all run at the
group's highest criticality until the join, because the join finishes with
the slowest of them. Pure functions over plain mappings (no graph object,
no clock), so the hints server's :class:`~kvtier.agents.AgentGraph` and tests
drive the same code. Must not mutate its inputs.

Edges follow :class:`~kvtier.agents.graph.Agent`: ``depends_on[x]`` holds the
agents that must finish before ``x`` continues.

>>> rem = {"plan": 2.0, "a": 5.0, "b": 1.0, "merge": 1.0}
>>> deps = {"merge": ["a", "b"], "a": ["plan"], "b": ["plan"]}
>>> through = path_through_s(rem, deps)
>>> through["a"], through["b"]  # plan -> a -> merge is the critical path
(8.0, 4.0)
>>> criticality(rem, deps, join_group={"a": "g", "b": "g"})["b"]  # b joins with a
1.0
"""

from __future__ import annotations

from typing import Iterable, Mapping


def _topo_order(nodes: Iterable[str], preds: Mapping[str, list[str]]) -> list[str]:
    """Kahn's order (predecessors first); raises ``ValueError`` on a cycle."""
    nodes = sorted(nodes)
    indeg = {n: len(preds[n]) for n in nodes}
    succ: dict[str, list[str]] = {n: [] for n in nodes}
    for n in nodes:
        for p in preds[n]:
            succ[p].append(n)
    ready = [n for n in nodes if indeg[n] == 0]
    order: list[str] = []
    while ready:
        n = ready.pop()
        order.append(n)
        for m in succ[n]:
            indeg[m] -= 1
            if indeg[m] == 0:
                ready.append(m)
    if len(order) != len(nodes):
        raise ValueError("dependency graph has a cycle")
    return order


def path_through_s(remaining_s: Mapping[str, float], depends_on: Mapping[str, Iterable[str]]) -> dict[str, float]:
    """For each agent of ``remaining_s``, the longest expected remaining path
    through it: longest chain of predecessors ending at it plus longest chain
    of dependents starting at it, its own remaining time counted once.
    Edges to agents missing from ``remaining_s`` (finished) are ignored.
    O(agents + edges)."""
    preds = {n: [p for p in depends_on.get(n, ()) if p in remaining_s] for n in remaining_s}
    order = _topo_order(remaining_s, preds)
    head = {}  # longest path ending at n (n included)
    for n in order:
        head[n] = remaining_s[n] + max((head[p] for p in preds[n]), default=0.0)
    tail = {n: remaining_s[n] for n in order}  # longest path starting at n
    for n in reversed(order):
        for p in preds[n]:
            tail[p] = max(tail[p], remaining_s[p] + tail[n])
    return {n: head[n] + tail[n] - remaining_s[n] for n in order}


def criticality(remaining_s: Mapping[str, float], depends_on: Mapping[str, Iterable[str]], *,
                join_group: Mapping[str, str] | None = None) -> dict[str, float]:
    """``path_through_s / critical path length`` in [0, 1] (1.0 on the critical
    path; all 1.0 when nothing remains), then every agent of a non-empty
    join group raised to the group's maximum."""
    through = path_through_s(remaining_s, depends_on)
    longest = max(through.values(), default=0.0)
    crit = {n: (t / longest if longest > 0 else 1.0) for n, t in through.items()}
    if join_group:
        best: dict[str, float] = {}
        for n, g in join_group.items():
            if g and n in crit:
                best[g] = max(best.get(g, 0.0), crit[n])
        for n, g in join_group.items():
            if g and n in crit:
                crit[n] = best[g]
    return crit
