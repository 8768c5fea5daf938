"""Diff codec on real KV of the small transformer: bit-exact lossless, bounded lossy, segment keys."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtier.errors import ConfigError
from kvtier.keys import Namespace, chain_keys
from kvtier.layout import KVLayout
from kvtier.shared import AgentId, RestoreRequest, SharedConfig, SharedStore, segment_key
from kvtier.shared.diff import DiffSpec, decode_diff, encode_diff
from kvtier.shared.kvmodel import ModelSpec, TinyKVModel, to_blocks

BS = 16
SPEC = ModelSpec(num_layers=3, hidden_size=128, num_heads=2, num_kv_heads=2, head_dim=32, ffn_size=256,
                 vocab_size=512, seed=3)
LAYOUT = KVLayout(SPEC.num_layers, SPEC.num_kv_heads, SPEC.head_dim, "bfloat16", BS)
NS = Namespace("tiny", "bfloat16", "fused", BS)


@pytest.fixture(scope="module")
def round_kv() -> dict:
    """3 agents; agent j produced segment j (its master); each agent blends the other two."""
    model = TinyKVModel(SPEC)
    g = torch.Generator().manual_seed(0)
    segs = [torch.randint(0, 512, (64,), generator=g) for _ in range(3)]
    privs = [torch.randint(0, 512, (32 + 16 * i,), generator=g) for i in range(3)]
    masters = [model.prefill(privs[j], [segs[j]])[0] for j in range(3)]
    mirrors, stats = {}, []
    for a in range(3):
        order = [j for j in (2, 0, 1) if j != a]
        kv, st = model.blend(privs[a], [segs[j] for j in order], [masters[j] for j in order], 0.25, BS)
        stats.append(st)
        mirrors.update({(a, j): k for j, k in zip(order, kv)})
    return {"segs": segs, "masters": masters, "mirrors": mirrors, "stats": stats, "model": model, "privs": privs}


def test_blend_recomputes_the_asked_fraction_and_differs_only_there(round_kv) -> None:
    for st in round_kv["stats"]:
        assert st.recomputed_fraction == pytest.approx(0.25)  # 1 of 4 blocks per segment
    for (a, j), kv in round_kv["mirrors"].items():
        m, r = to_blocks(round_kv["masters"][j], BS), to_blocks(kv, BS)
        differs = (m != r).any(dim=1)
        assert differs[0] and int(differs.sum()) == 1, (a, j)  # the first block: recomputed in context


def test_blend_layer0_is_context_free_and_deeper_layers_move_towards_exact(round_kv) -> None:
    model, segs, privs = round_kv["model"], round_kv["segs"], round_kv["privs"]
    exact = model.prefill(privs[0], [segs[2], segs[1]])
    blended = [round_kv["mirrors"][(0, 2)], round_kv["mirrors"][(0, 1)]]
    masters = [round_kv["masters"][2], round_kv["masters"][1]]
    for e, b, m in zip(exact, blended, masters):
        sel = slice(0, BS)  # the recomputed block
        err_blend = (b[1:, :, sel].float() - e[1:, :, sel].float()).abs().mean()
        err_master = (m[1:, :, sel].float() - e[1:, :, sel].float()).abs().mean()
        assert err_blend < err_master


def test_lossless_restore_of_every_agent_is_bit_exact(round_kv) -> None:
    nb = 64 // BS
    keys = [segment_key(NS, s.tolist()) for s in round_kv["segs"]]
    store = SharedStore(LAYOUT, NS, SharedConfig(dram_blocks=3 * nb))
    for j, k in enumerate(keys):
        store.put_segment(AgentId(f"a{j}"), k, list(to_blocks(round_kv["masters"][j], BS)))
    items = sorted(round_kv["mirrors"].items())
    full = mirror = 0
    for (a, j), kv in items:
        res = store.put_segment(AgentId(f"a{a}"), keys[j], list(to_blocks(kv, BS)))
        assert res.role == "mirror"
        full += nb * LAYOUT.bytes_per_block
        mirror += res.stored_bytes
    assert full / mirror > 2.5  # 25% of blocks recomputed, layer 0 rows equal: well under a third
    reqs = [RestoreRequest(AgentId(f"a{a}"), keys[j], tuple(range(i * nb, (i + 1) * nb)))
            for i, ((a, j), _) in enumerate(items)]
    for mode in ("fused", "dense"):
        dst = torch.zeros(len(reqs) * nb, LAYOUT.bytes_per_block, dtype=torch.uint8)
        assert all(store.restore_round(reqs, dst, mode=mode))
        for i, (_, kv) in enumerate(items):  # every restored tensor against the agent's own KV
            restored = dst[i * nb:(i + 1) * nb].contiguous().view(torch.bfloat16).view(
                nb, SPEC.num_layers, 2, BS, SPEC.num_kv_heads, SPEC.head_dim).permute(1, 2, 0, 3, 4, 5).reshape(kv.shape)
            assert torch.equal(restored, kv), (mode, i)
    store.check_invariants()


@pytest.mark.parametrize("bound", [1e-3, 1.0 / 64, 0.25])
def test_lossy_diff_holds_its_error_bound_on_real_kv(round_kv, bound: float) -> None:
    spec = DiffSpec("bfloat16", SPEC.num_kv_heads * SPEC.head_dim * 2, "lossy", bound)
    lossless = DiffSpec("bfloat16", spec.row_bytes)
    for (a, j), kv in round_kv["mirrors"].items():
        master = to_blocks(round_kv["masters"][j], BS).reshape(-1).numpy()
        mirror = to_blocks(kv, BS).reshape(-1).numpy()
        value = encode_diff(master, mirror, spec)
        rows = decode_diff(value, master.size)
        assert rows is not None and rows.num_rows > 0
        out = torch.from_numpy(master.copy()).view(1, -1)
        from kvtier.shared.restore import Patch, apply_patches
        apply_patches(out, [Patch(rows, (0,))], master.size)
        err = (out.view(torch.bfloat16).float() - torch.from_numpy(mirror).view(torch.bfloat16).float()).abs()
        assert float(err.max()) <= bound
        if bound >= 1.0 / 64:
            assert len(value) < len(encode_diff(master, mirror, lossless))


def test_lossy_needs_a_float_dtype_and_a_bound() -> None:
    with pytest.raises(ConfigError, match="shared.error_bound_abs"):
        DiffSpec("bfloat16", 64, "lossy", 0.0)
    with pytest.raises(ConfigError, match="shared.diff_mode"):
        DiffSpec("int8", 64, "lossy", 0.1)


def test_corrupt_rows_index_or_payload_is_rejected() -> None:
    spec = DiffSpec("bfloat16", 8)
    master = np.zeros(64, np.uint8)
    mirror = master.copy()
    mirror[40] = 7
    value = bytearray(encode_diff(master, mirror, spec))
    assert decode_diff(bytes(value), 64).exact_rows.tolist() == [5]
    assert decode_diff(bytes(value), 128) is None  # foreign block size
    for i in range(56, len(value)):  # every byte of the frame is covered by the payload checksum
        bad = bytearray(value)
        bad[i] ^= 0x10
        assert decode_diff(bytes(bad), 64) is None


def test_segment_keys_match_across_offsets_where_prefix_keys_do_not() -> None:
    seg = list(range(500, 532))
    a = chain_keys(NS, list(range(16)) + seg)[1:]
    b = chain_keys(NS, list(range(100, 132)) + seg)[2:]
    assert set(a).isdisjoint(b)
    assert segment_key(NS, seg) == segment_key(NS, list(seg))
    assert segment_key(NS, seg) != segment_key(Namespace("other", "bfloat16", "fused", BS), seg)
    with pytest.raises(ConfigError, match="shared.segment_tokens"):
        segment_key(NS, seg[:20])
