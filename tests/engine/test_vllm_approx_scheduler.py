"""The connector's scheduler half in approximate mode, on vLLM's real ``BlockPool``
(the stand-in engine of ``test_vllm_placement.py``): which blocks a request may load
from another's copy, and which it never may."""

from __future__ import annotations

import hashlib

import pytest

from kvtier_vllm.settings import ConnectorSettings, EngineFacts

from kvtier.sdk import approximate_segments

from .test_vllm_placement import BS, _Engine, _Request

pytestmark = pytest.mark.vllm_interface  # no engine: also run against newer vLLMs (scripts/vllm_next.sh)

SEGMENT = [(7 * j + 3) % 997 for j in range(3 * BS)]  # 3 blocks
SALT = approximate_segments({}, [])["cache_salt"]


class _Prompt(_Request):
    """A request with token ids, vLLM's cache salt, and block hashes that depend on both
    (as vLLM's do: the salt is mixed into the first block's hash)."""

    def __init__(self, req_id: str, tokens: list[int], params: dict | None, salt: str | None) -> None:
        hashes, h = [], hashlib.sha256((salt or "").encode())
        for b in range(len(tokens) // BS):
            h.update(str(tokens[b * BS:(b + 1) * BS]).encode())
            hashes.append(h.copy().digest())
        super().__init__(req_id, hashes, params)
        self.prompt_token_ids = tokens
        self.num_tokens = len(tokens) + 5
        self.cache_salt = salt


def _engine() -> _Engine:
    facts = EngineFacts("tiny", "bfloat16", BS, 2, 2, 32, "fused", "sha256", rope=(10000.0, 32))
    settings = ConnectorSettings.build({"dram_capacity_blocks": 64, "approximate_shifted_segments": True}, facts,
                                       env={})
    return _Engine(101, _settings=settings)


def _prompt(agent: int) -> tuple[list[int], int]:
    private = [(31 * agent + j) % 997 + 3 for j in range((agent + 1) * BS)]
    return private + SEGMENT + [5, 6, 7], len(private)


def _params(start: int) -> dict:
    return approximate_segments({}, [(start, len(SEGMENT))])["kv_transfer_params"]


def _serve(eng: _Engine, req_id: str, agent: int, salt: str | None = SALT, declare: bool = True) -> _Prompt:
    tokens, start = _prompt(agent)
    req = _Prompt(req_id, tokens, _params(start) if declare else None, salt)
    eng.sched.on_new_request(req)
    blocks = eng.pool.get_new_blocks(len(req.block_hashes) + 1)
    eng.block_ids[req_id] = [b.block_id for b in blocks]
    eng.step({req_id: req.num_tokens})
    eng.sched.request_finished(req)
    eng.pool.free_blocks(reversed(blocks))
    return req


def _lookup(eng: _Engine, req_id: str, agent: int, salt: str | None = SALT, declare: bool = True) -> tuple[int, tuple]:
    """Tokens kvtier offers past the agent's private prefix (as if vLLM had it cached), and the shifts."""
    tokens, start = _prompt(agent)
    req = _Prompt(req_id, tokens, _params(start) if declare else None, salt)
    eng.sched.on_new_request(req)
    n, _ = eng.sched.get_num_new_matched_tokens(req, start)
    match = eng.sched._matches.get(req_id)
    return n, (match.shifts if match else ())


def test_a_segment_loads_from_the_first_copy_with_its_shift() -> None:
    eng = _engine()
    _serve(eng, "a", 0)  # segment at offset 32: the masters
    n, shifts = _lookup(eng, "b", 2)  # segment at offset 96
    assert n == len(SEGMENT) and shifts == (64, 64, 64)


def test_exact_and_unmarked_requests_never_load_approximate_blocks() -> None:
    eng = _engine()
    _serve(eng, "a", 0)
    assert _lookup(eng, "exact", 0, salt=None, declare=False)[0] == 0  # the same prompt, exact: nothing
    assert _lookup(eng, "tenant", 2, salt="tenant-1", declare=True)[0] == 0  # spans without the approximate salt
    assert eng.sched.counters["approximate_refused_unsalted"] == 1
    # a salt that marks it approximate keys it apart even without spans; with another tenant's salt: no master
    other = approximate_segments({"cache_salt": "tenant-2"}, [])["cache_salt"]
    assert other.startswith("tenant-2") and _lookup(eng, "t2", 2, salt=other)[0] == 0


def test_a_master_gone_from_the_tiers_is_replaced_and_an_own_copy_is_preferred() -> None:
    eng = _engine()
    _serve(eng, "a", 0)
    eng.sched.manager.evict("dram", 64)  # the masters' bytes are gone
    assert _lookup(eng, "b", 2)[0] == 0
    _serve(eng, "c", 1)  # computes the segment itself (nothing to load): the new masters
    n, shifts = _lookup(eng, "b2", 2)
    assert n == len(SEGMENT) and shifts == (32, 32, 32)
    _serve(eng, "d", 2)  # agent 2's own turn is stored: its next lookup reads its own copy, unshifted
    n, shifts = _lookup(eng, "d2", 2)
    assert n == len(SEGMENT) and shifts == ()


def test_reset_forgets_the_masters() -> None:
    eng = _engine()
    _serve(eng, "a", 0)
    eng.sched.reset()
    assert not len(eng.sched._approx) and _lookup(eng, "b", 2)[0] == 0
