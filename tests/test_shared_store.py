"""SharedStore scenarios: masters, mirrors, ref counts, re-base, corruption, tiers."""

from __future__ import annotations

import pytest
import torch

from kvtier.errors import ProtocolError
from kvtier.keys import Namespace
from kvtier.layout import KVLayout
from kvtier.shared import AgentId, RestoreRequest, SegmentKey, SharedConfig, SharedStore, segment_key
from kvtier.shared.values import diff_key

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype="bfloat16", block_size=4)
NS = Namespace("test-shared", "bfloat16", "fused", 4)
BPB = LAYOUT.bytes_per_block  # 2 layers * 2 (K,V) * 4 tokens * 2 heads * 16 dim * 2 B = 1024
ROW = 2 * 16 * 2  # one token's K or V in one layer: 64 bytes
A, B, C, D = (AgentId(x) for x in "abcd")
SEG = segment_key(NS, list(range(8)))  # 2 blocks


def kv(seed: int, num_blocks: int = 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_blocks, BPB // 2, generator=g).to(torch.bfloat16).view(torch.uint8)


def perturb(base: torch.Tensor, rows: list[int], seed: int) -> torch.Tensor:
    """``base`` with the listed (segment-wide) rows replaced by fresh values."""
    out = base.clone().view(-1, ROW)
    g = torch.Generator().manual_seed(seed)
    for r in rows:
        out[r] = torch.randn(ROW // 2, generator=g).to(torch.bfloat16).view(torch.uint8)
    return out.view(base.shape)


def store(**kw) -> SharedStore:
    return SharedStore(LAYOUT, NS, SharedConfig(**{"dram_blocks": 8, **kw}))


def restore(s: SharedStore, agent: AgentId, seg: SegmentKey = SEG, n: int = 2) -> tuple[bool, torch.Tensor]:
    dst = torch.zeros(n, BPB, dtype=torch.uint8)
    ok = s.restore_round([RestoreRequest(agent, seg, tuple(range(n)))], dst)[0]
    return ok, dst


def test_first_copy_is_master_later_copies_are_sparse_mirrors() -> None:
    s = store()
    master = kv(1)
    mirror = perturb(master, [3, 20], seed=2)  # block 0 row 3, block 1 row 4 (16 rows per block)
    assert s.put_segment(A, SEG, list(master)).role == "master"
    res = s.put_segment(B, SEG, list(mirror))
    assert (res.role, res.num_diff_blocks, res.num_diff_rows) == ("mirror", 2, 2)
    assert res.stored_bytes < BPB  # two rows of 64 B plus a header, not two blocks
    same = s.put_segment(C, SEG, list(master))
    assert (same.num_diff_blocks, same.num_diff_rows) == (0, 0)
    for agent, expected in ((A, master), (B, mirror), (C, master)):
        ok, out = restore(s, agent)
        assert ok and torch.equal(out, expected)
    assert s.index.info(SEG).ref_count == 3
    s.check_invariants()
    with pytest.raises(ProtocolError):
        s.put_segment(B, SEG, list(mirror))  # already holds it


def test_mirrors_of_mirrors_are_never_created() -> None:
    s = store()
    master = kv(1)
    b = perturb(master, [1, 2, 3, 4, 5], seed=2)
    c = perturb(b, [6], seed=3)  # c is one row away from b but six rows away from the master
    s.put_segment(A, SEG, list(master))
    s.put_segment(B, SEG, list(b))
    res = s.put_segment(C, SEG, list(c))
    assert res.num_diff_rows == 6  # diffed against the master, not against b (that would be 1)
    info = s.index.info(SEG)
    assert info.owner == A and {m.agent for m in info.mirrors} == {B, C}
    # after a re-base the survivors diff against the new master only
    s.evict_master(SEG, prefer=B)
    info = s.index.info(SEG)
    assert info.owner == B and [m.agent for m in info.mirrors] == [C]
    value = s._values["dram"].get(diff_key(SEG, C))
    from kvtier.shared.diff import decode_diff
    assert decode_diff(value, 2 * BPB).num_rows == 1  # now relative to b, the new master
    assert torch.equal(restore(s, C)[1], c) and torch.equal(restore(s, B)[1], b)
    s.check_invariants()


def test_master_outlives_its_owner_while_mirrors_use_it() -> None:
    s = store()
    master, mirror = kv(1), perturb(kv(1), [0], seed=5)
    s.put_segment(A, SEG, list(master))
    s.put_segment(B, SEG, list(mirror))
    s.release(A, SEG)  # owner leaves: the mirror's ref keeps the master bytes
    info = s.index.info(SEG)
    assert info.owner is None and info.ref_count == 1 and s.index.free_slots("dram") == 6
    assert not restore(s, A)[0]  # A's copy is gone: a miss
    ok, out = restore(s, B)
    assert ok and torch.equal(out, mirror)
    s.release(B, SEG)  # last reference: segment freed
    assert s.index.info(SEG) is None and s.index.free_slots("dram") == 8
    assert s.stored_bytes() == {"master_bytes": 0, "diff_bytes": 0}
    s.check_invariants()


def test_master_eviction_rebases_live_mirrors() -> None:
    s = store()
    master = kv(1)
    b, c, d = (perturb(master, rows, seed=i) for i, rows in ((2, [0, 1]), (3, [17]), (4, [5, 30])))
    s.put_segment(A, SEG, list(master))
    for agent, blocks in ((B, b), (C, c), (D, d)):
        s.put_segment(agent, SEG, list(blocks))
    result = s.evict_master(SEG)  # promotes the first mirror, b
    assert result.promoted == B and set(result.rediffed) == {C, D} and result.dropped == (A,)
    info = s.index.info(SEG)
    assert info.owner == B and {m.agent for m in info.mirrors} == {C, D}
    assert s._values["dram"].get(diff_key(SEG, B)) is None  # the promoted mirror's diff is gone
    assert not restore(s, A)[0]
    for agent, expected in ((B, b), (C, c), (D, d)):
        ok, out = restore(s, agent)
        assert ok and torch.equal(out, expected), agent
    s.check_invariants()


def test_master_eviction_without_rebase_drops_every_mirror() -> None:
    s = store()
    s.put_segment(A, SEG, list(kv(1)))
    s.put_segment(B, SEG, list(perturb(kv(1), [2], seed=2)))
    result = s.evict_master(SEG, rebase=False)
    assert result.promoted is None and set(result.dropped) == {A, B}
    assert s.index.info(SEG) is None and len(s._values["dram"]) == 0
    assert not restore(s, B)[0]  # a miss, never a dangling mirror
    s.check_invariants()


@pytest.mark.parametrize("where", ["payload", "header", "truncate"])
def test_corrupted_diff_is_a_miss_and_other_agents_still_restore(where: str) -> None:
    s = store()
    master, b, c = kv(1), perturb(kv(1), [4], seed=2), perturb(kv(1), [9], seed=3)
    s.put_segment(A, SEG, list(master))
    s.put_segment(B, SEG, list(b))
    s.put_segment(C, SEG, list(c))
    values = s._values["dram"]
    value = bytearray(values.get(diff_key(SEG, B)))
    if where == "payload":
        value[-1] ^= 0x01
    elif where == "header":
        value[20] ^= 0x80
    else:
        value = value[:-3]
    values.put(diff_key(SEG, B), bytes(value))
    dst = torch.zeros(6, BPB, dtype=torch.uint8)
    oks = s.restore_round([RestoreRequest(a, SEG, (2 * i, 2 * i + 1)) for i, a in enumerate((A, B, C))], dst)
    assert oks == [True, False, True]
    assert torch.equal(dst[0:2], master) and torch.equal(dst[4:6], c)
    assert s.counters["corrupt_diffs"] == 1
    # a re-base drops the mirror whose diff does not verify instead of keeping it dangling
    result = s.evict_master(SEG, prefer=B)
    assert result.promoted == C and B in result.dropped
    s.check_invariants()


def test_diff_budget_full_refuses_the_mirror() -> None:
    s = store(dram_diff_bytes=100)  # smaller than any diff value with a changed row
    s.put_segment(A, SEG, list(kv(1)))
    assert s.put_segment(B, SEG, list(perturb(kv(1), [1, 2, 3], seed=2))) is None
    assert s.index.role(SEG, B) is None
    s.check_invariants()


def test_collective_restore_fused_equals_dense_for_many_agents() -> None:
    s = store()
    segs = [segment_key(NS, list(range(10 * i, 10 * i + 8))) for i in range(3)]
    expected = {}
    for j, seg in enumerate(segs):
        master = kv(10 + j)
        s.put_segment(AgentId(f"p{j}"), seg, list(master))
        for a in range(4):
            blocks = perturb(master, [a, 16 + 2 * a], seed=100 * j + a)
            s.put_segment(AgentId(f"r{a}"), seg, list(blocks))
            expected[(a, j)] = blocks
    reqs = [RestoreRequest(AgentId(f"r{a}"), segs[j], (2 * i, 2 * i + 1)) for i, (a, j) in enumerate(expected)]
    want = torch.cat(list(expected.values()))
    for mode in ("fused", "dense"):
        dst = torch.zeros(len(reqs) * 2, BPB, dtype=torch.uint8)
        assert all(s.restore_round(reqs, dst, mode=mode))
        assert torch.equal(dst, want), mode
    with pytest.raises(ValueError):
        s.restore_round(reqs[:2] + [RestoreRequest(reqs[2].agent, reqs[2].segment, (0, 5))],
                        torch.zeros(24, BPB, dtype=torch.uint8))
    s.check_invariants()


def test_ssd_tier_stores_and_restores_bit_exact_and_diffs_shrink(tmp_path) -> None:
    s = store(ssd_blocks=8, ssd_path=str(tmp_path))
    master = kv(1)
    rows = list(range(0, 32, 3))
    b = perturb(master, rows, seed=2)
    s.put_segment(A, SEG, list(master))
    dram_bytes = s.put_segment(B, SEG, list(b)).stored_bytes
    assert s.move_segment(SEG, "ssd")
    info = s.index.info(SEG)
    assert info.tier == "ssd" and s.index.used_blocks("dram") == 0
    assert s.index.used_diff_bytes("ssd") <= dram_bytes  # re-compressed at the SSD zstd level
    for agent, expected in ((A, master), (B, b)):
        ok, out = restore(s, agent)
        assert ok and torch.equal(out, expected)
    # a new mirror of an SSD segment is stored on SSD too
    c = perturb(master, [7], seed=9)
    assert s.put_segment(C, SEG, list(c)).tier == "ssd"
    assert torch.equal(restore(s, C)[1], c)
    s.evict_master(SEG)  # re-base on SSD
    assert torch.equal(restore(s, C)[1], c) and not restore(s, A)[0]
    s.release(B, SEG)
    s.release(C, SEG)
    assert s.index.info(SEG) is None and len(s._ssd) == 0  # SSD master values deleted
    s.check_invariants()
    s.close()


def test_random_operations_keep_invariants_and_restores_exact() -> None:
    import random

    rng = random.Random(7)
    s = store(dram_blocks=6)
    segs = [segment_key(NS, list(range(100 * i, 100 * i + 8))) for i in range(4)]
    truth: dict[tuple[AgentId, SegmentKey], torch.Tensor] = {}
    agents = [AgentId(f"x{i}") for i in range(5)]
    for step in range(150):
        seg, agent = rng.choice(segs), rng.choice(agents)
        op = rng.random()
        if op < 0.5 and (agent, seg) not in truth:
            base = next((v for (a, sg), v in truth.items() if sg == seg), kv(step))
            blocks = perturb(base, rng.sample(range(32), rng.randint(0, 4)), seed=step)
            res = s.put_segment(agent, seg, list(blocks))
            if res is not None:
                truth[(agent, seg)] = blocks
        elif op < 0.7 and (agent, seg) in truth:
            s.release(agent, seg)
            del truth[(agent, seg)]
        elif op < 0.8 and s.index.info(seg) is not None:
            result = s.evict_master(seg, rebase=rng.random() < 0.7)
            for a in result.dropped:
                truth.pop((a, seg), None)
        s.check_invariants()
        for (a, sg), blocks in truth.items():
            ok, out = restore(s, a, sg)
            assert ok and torch.equal(out, blocks), (step, a)
