"""The scheduler's load plans in flight, and which request is bringing each key into vLLM's blocks.

Owns: each planned load (plan id -> the request, the tier manager's plan, the
remote run) from planning until every worker reported it, and an index of the
keys an asynchronous load is writing into a request's own blocks. vLLM caches
such blocks only once the load has finished, so without the index a second
request behind the same prefix would load the same blocks again, into blocks of
its own: N requests behind one shared prefix made N loads and held N copies in
HBM (the convoy of vLLM issue #44294). The scheduler asks :meth:`LoadPlans.loader`
and defers that lookup (vLLM asks again next step); by then the first load has
finished and vLLM's own prefix cache serves the prefix to every request.

Also owns how long lookups have waited on a block on its way into DRAM (a
write-back, or a promotion from the SSD): :meth:`LoadPlans.wait_on` defers each
request for ``load_deadline_s`` at most. A promotion from an SSD whose reads hang lands
when the read ends: without the bound, every request behind that block waited
with it (104-114 s in ``bench/chaos_serve.py``'s stalled loads, one past the
client's 120 s).

Must not complete plans or count anything (the scheduler does, once every worker
reported), move bytes, or import vLLM. A load that never reports holds the
requests deferred behind it as long as it holds its own: ``load_deadline_s``
bounds both.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable

from kvtier.keys import BlockKey
from kvtier.manager import LoadPlan

WAITED_MAX = 4096  # requests remembered as having waited (wait_on)

Planned = tuple[str, LoadPlan | None, tuple[BlockKey, ...]]
"""(request id, the tier manager's plan or a lanes plan, the remote run's keys) of one load."""


class LoadPlans:
    """Load plans by plan id (see the module doc). ``own_keys`` given to :meth:`add` are the
    keys whose blocks the load fills under the request's own hashes: an asynchronous load
    of the request's own keys. Leave them out for a synchronous load (vLLM caches its blocks
    in the step that plans it, so the next lookup already finds them), an approximate load
    (the blocks are cached under other hashes) and a hybrid model's lanes.

    >>> p = LoadPlans()
    >>> p.add(7, "a", None, (), own_keys=[11, 12])
    >>> p.loader(12), p.loader(13)
    ('a', None)
    >>> p.pop(7)[0], p.loader(12), bool(p)
    ('a', None, False)
    """

    def __init__(self) -> None:
        self._plans: dict[int, tuple[str, LoadPlan | None, tuple[BlockKey, ...], tuple[BlockKey, ...]]] = {}
        self._loading: dict[BlockKey, str] = {}  # key -> the request whose load writes it (the first one)
        self._waited: OrderedDict[str, float] = OrderedDict()  # request -> when its lookup first waited

    def add(self, plan_id: int, req_id: str, plan: LoadPlan | None, remote: tuple[BlockKey, ...],
            own_keys: Iterable[BlockKey] = ()) -> None:
        own = tuple(own_keys)
        self._plans[plan_id] = (req_id, plan, remote, own)
        for key in own:
            self._loading.setdefault(key, req_id)

    def pop(self, plan_id: int) -> Planned:
        """The plan, forgotten (its keys no longer on their way)."""
        req_id, plan, remote, own = self._plans.pop(plan_id)
        for key in own:
            if self._loading.get(key) == req_id:
                del self._loading[key]
        return req_id, plan, remote

    def loader(self, key: BlockKey) -> str | None:
        """The request whose load in flight is writing ``key`` into its own blocks, if any."""
        return self._loading.get(key)

    def wait_on(self, req_id: str, bound_s: float, now: float | None = None) -> bool:
        """Request ``req_id``'s lookup would wait for a block on its way into DRAM: whether it
        may, for ``bound_s`` from its first such wait (``bound_s`` 0: no bound). Per request, not
        per block: vLLM may ask about a waiting request seconds apart. The oldest of
        ``WAITED_MAX`` requests are forgotten first.

        >>> p = LoadPlans()
        >>> [p.wait_on("a", 2.0, now=t) for t in (10.0, 11.9, 12.1)], p.wait_on("b", 2.0, now=12.1)
        ([True, True, False], True)
        >>> p.wait_on("c", 0.0, now=99.0)
        True
        """
        now = time.monotonic() if now is None else now
        first = self._waited.setdefault(req_id, now)
        if len(self._waited) > WAITED_MAX:
            self._waited.popitem(last=False)
        return bound_s <= 0 or now - first < bound_s

    def __contains__(self, plan_id: object) -> bool:
        return plan_id in self._plans

    def __len__(self) -> int:
        return len(self._plans)
