"""``kvtier bench shared``: master + mirror storage and fused restore on real KV.

Real KV: a seeded 4-layer transformer (:mod:`kvtier.shared.kvmodel`, 4 KV
heads of 64, bf16) runs an all-gather round. Agent ``j`` produced segment
``j`` (its exact KV after its private history is the segment's master);
every agent receives the other agents' segments, in its own order, after its
own private history, and fills their KV CacheBlend-style: reuse the master,
recompute ``fraction`` of the positions in its own context. Measured in the
same run:

* ``bytes_ratio``: bytes of received segments stored per agent as full copies
  (``(N-1) * segment bytes``) over the bytes of that agent's mirror diffs
  (lossless, DRAM); ``bytes_ratio_ssd`` after moving every segment to the SSD
  tier (diffs re-compressed at a higher zstd level); ``bytes_ratio_lossy``
  with a lossy diff of bound ``error_bound_abs``.
* ``fused_gbps`` vs ``dense_gbps``: a collective restore of every mirror of the
  round into an engine-like block tensor, fused (masters copied straight to
  their destination, rows patched in place) against reconstruct-then-copy
  (each diff expanded to a dense XOR block, XORed with the master in a
  staging buffer, then copied); both decode and verify the same diff values
  (the zstd decode is inside both timings). ``memcpy_gbps``: copying the same bytes from dense full copies
  (what full per-agent copies cost to restore).
* ``bit_exact``: every restored block of every agent (DRAM fused, DRAM dense,
  SSD) equals the KV the agent computed; ``lossy_max_err`` <= the bound.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from ..keys import Namespace
from ..layout import KVLayout
from ..shared.index import AgentId
from ..shared.kvmodel import ModelSpec, TinyKVModel, to_blocks
from ..shared.segments import SegmentKey, segment_key
from ..shared.store import RestoreRequest, SharedConfig, SharedStore
from .common import gbps

TARGETS = {"bytes_ratio": 10.0, "fused_vs_dense": 1.3}


def build_round(num_agents: int, segment_tokens: int, private_tokens: int, block_size: int, fraction: float,
                granularity: str, seed: int, progress: Callable[[str], None]) -> dict[str, Any]:
    """Run the model: masters (producer KV) and every agent's blended KV of the others' segments."""
    model = TinyKVModel(ModelSpec(seed=seed))
    g = torch.Generator().manual_seed(seed + 1)
    vocab = model.spec.vocab_size
    segs = [torch.randint(0, vocab, (segment_tokens,), generator=g) for _ in range(num_agents)]
    privs = [torch.randint(0, vocab, (private_tokens + block_size * (i % 4),), generator=g)
             for i in range(num_agents)]
    masters = []
    for j in range(num_agents):
        masters.append(model.prefill(privs[j], [segs[j]])[0])
    progress(f"[bench shared] {num_agents} masters computed; blending mirrors ...")
    orders, mirrors, fractions = [], {}, []
    for a in range(num_agents):
        others = [j for j in range(num_agents) if j != a]
        perm = torch.randperm(len(others), generator=g).tolist()
        order = [others[i] for i in perm]
        kv, stats = model.blend(privs[a], [segs[j] for j in order], [masters[j] for j in order], fraction,
                                block_size, granularity)  # type: ignore[arg-type]
        fractions.append(stats.recomputed_fraction)
        for j, k in zip(order, kv):
            mirrors[(a, j)] = k
        orders.append(order)
    return {"model": model, "segs": segs, "masters": masters, "mirrors": mirrors, "orders": orders,
            "recomputed_fraction": sum(fractions) / len(fractions)}


def run(num_agents: int = 6, segment_tokens: int = 320, private_tokens: int = 128, block_size: int = 16,
        fraction: float = 0.15, granularity: str = "block", error_bound_abs: float = 1.0 / 64, repeats: int = 5,
        seed: int = 0, progress: Callable[[str], None] = print) -> dict[str, Any]:
    """Every measurement of the module docstring; returns the JSON report."""
    torch.manual_seed(seed)
    rnd = build_round(num_agents, segment_tokens, private_tokens, block_size, fraction, granularity, seed, progress)
    spec = rnd["model"].spec
    layout = KVLayout(spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.kv_dtype, block_size)
    ns = Namespace("bench-shared-tiny", spec.kv_dtype, "fused", block_size)
    seg_keys = [segment_key(ns, s.tolist()) for s in rnd["segs"]]
    nb = segment_tokens // block_size
    master_blocks = [to_blocks(m, block_size) for m in rnd["masters"]]
    mirror_blocks = {k: to_blocks(v, block_size) for k, v in rnd["mirrors"].items()}
    seg_bytes = nb * layout.bytes_per_block
    report: dict[str, Any] = {
        "num_agents": num_agents, "segment_tokens": segment_tokens, "block_size": block_size,
        "bytes_per_block": layout.bytes_per_block, "layout": layout.describe(),
        "recompute_fraction_asked": fraction, "recompute_fraction": rnd["recomputed_fraction"],
        "granularity": granularity, "model": f"{spec.num_layers}L x {spec.num_kv_heads}KVh x {spec.head_dim}d "
                                             f"{spec.kv_dtype}, hidden {spec.hidden_size}, seed {seed}",
    }
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-shared-") as tmp:
        cfg = SharedConfig(dram_blocks=num_agents * nb, ssd_blocks=num_agents * nb, ssd_path=tmp)
        with SharedStore(layout, ns, cfg) as store:
            diff_bytes, diff_blocks, diff_rows = _fill(store, seg_keys, master_blocks, mirror_blocks)
            store.check_invariants()
            report.update(_bytes_figures(diff_bytes, num_agents, seg_bytes))
            report["diff_block_fraction"] = sum(diff_blocks) / (len(diff_blocks) * nb)
            rpb = layout.bytes_per_block // (spec.num_kv_heads * spec.head_dim * 2)
            report["diff_row_fraction"] = sum(diff_rows) / (len(diff_rows) * nb * rpb)
            progress("[bench shared] restore: fused vs dense ...")
            report.update(_restore_figures(store, seg_keys, mirror_blocks, nb, layout.bytes_per_block, repeats))
            progress("[bench shared] moving every segment to the SSD tier ...")
            for k in seg_keys:
                assert store.move_segment(k, "ssd")
            store.check_invariants()
            report["bytes_ratio_ssd"] = (num_agents * (num_agents - 1) * seg_bytes) / store.stored_bytes()["diff_bytes"]
            report["bit_exact_ssd"] = _restore_exact(store, seg_keys, mirror_blocks, nb, layout.bytes_per_block)
    lossy_cfg = SharedConfig(dram_blocks=num_agents * nb, diff_mode="lossy", error_bound_abs=error_bound_abs)
    with SharedStore(layout, ns, lossy_cfg) as store:
        lossy_bytes, _, _ = _fill(store, seg_keys, master_blocks, mirror_blocks)
        report["error_bound_abs"] = error_bound_abs
        report["bytes_ratio_lossy"] = _bytes_figures(lossy_bytes, num_agents, seg_bytes)["bytes_ratio"]
        report["lossy_max_err"] = _lossy_max_err(store, seg_keys, mirror_blocks, nb, layout, spec.kv_dtype)
    report["bit_exact"] = report["bit_exact_fused"] and report["bit_exact_dense"] and report["bit_exact_ssd"]
    report["targets"] = {**TARGETS, "bit_exact": True, "lossy_max_err<=bound": True}
    report["targets_met"] = {
        "bytes_ratio": report["bytes_ratio"] >= TARGETS["bytes_ratio"],
        "fused_vs_dense": report["fused_vs_dense"] >= TARGETS["fused_vs_dense"],
        "bit_exact": report["bit_exact"],
        "lossy_max_err<=bound": report["lossy_max_err"] <= error_bound_abs,
    }
    return report


def _fill(store: SharedStore, seg_keys: list[SegmentKey], masters: list[torch.Tensor],
          mirrors: dict[tuple[int, int], torch.Tensor]) -> tuple[dict[int, int], list[int], list[int]]:
    """Put every master (its producer) and mirror; returns diff bytes per agent, diff blocks and rows per mirror."""
    for j, k in enumerate(seg_keys):
        assert store.put_segment(AgentId(f"agent{j}"), k, list(masters[j])).role == "master"
    per_agent: dict[int, int] = {}
    blocks, rows = [], []
    for (a, j), blk in sorted(mirrors.items()):
        res = store.put_segment(AgentId(f"agent{a}"), seg_keys[j], list(blk))
        assert res is not None and res.role == "mirror", "mirror refused: raise the diff budget"
        per_agent[a] = per_agent.get(a, 0) + res.stored_bytes
        blocks.append(res.num_diff_blocks)
        rows.append(res.num_diff_rows)
    return per_agent, blocks, rows


def _bytes_figures(per_agent: dict[int, int], num_agents: int, seg_bytes: int) -> dict[str, float]:
    full = (num_agents - 1) * seg_bytes
    ratios = [full / b for b in per_agent.values()]
    return {"full_copy_bytes_per_agent": full, "mirror_bytes_per_agent": sum(per_agent.values()) / len(per_agent),
            "bytes_ratio": full * len(per_agent) / sum(per_agent.values()), "bytes_ratio_min_agent": min(ratios)}


def _requests(seg_keys: list[SegmentKey], mirrors: dict[tuple[int, int], torch.Tensor], nb: int
              ) -> tuple[list[RestoreRequest], list[torch.Tensor]]:
    reqs, expected = [], []
    for i, ((a, j), blk) in enumerate(sorted(mirrors.items())):
        reqs.append(RestoreRequest(AgentId(f"agent{a}"), seg_keys[j], tuple(range(i * nb, (i + 1) * nb))))
        expected.append(blk)
    return reqs, expected


def _restore_figures(store: SharedStore, seg_keys: list[SegmentKey], mirrors: dict[tuple[int, int], torch.Tensor],
                     nb: int, bpb: int, repeats: int) -> dict[str, Any]:
    reqs, expected = _requests(seg_keys, mirrors, nb)
    dense_src = torch.cat(expected)
    dst = torch.zeros_like(dense_src)
    staging = torch.zeros(2 * dense_src.shape[0], bpb, dtype=torch.uint8)
    nbytes = dst.numel()
    best = {"fused": float("inf"), "dense": float("inf"), "memcpy": float("inf")}
    exact = {"fused": True, "dense": True}
    for _ in range(repeats):  # interleaved, so machine noise hits every path alike
        for mode in ("fused", "dense", "memcpy"):
            dst.zero_()
            start = time.perf_counter()
            if mode == "memcpy":
                dst.copy_(dense_src)
            else:
                assert all(store.restore_round(reqs, dst, mode=mode, staging=staging))  # type: ignore[arg-type]
            best[mode] = min(best[mode], time.perf_counter() - start)
            if mode != "memcpy":
                exact[mode] = exact[mode] and torch.equal(dst, dense_src)
    return {"restore_bytes": nbytes, "fused_gbps": gbps(nbytes, best["fused"]),
            "dense_gbps": gbps(nbytes, best["dense"]), "memcpy_gbps": gbps(nbytes, best["memcpy"]),
            "fused_vs_dense": best["dense"] / best["fused"], "fused_vs_memcpy": best["memcpy"] / best["fused"],
            "bit_exact_fused": exact["fused"], "bit_exact_dense": exact["dense"]}


def _restore_exact(store: SharedStore, seg_keys: list[SegmentKey], mirrors: dict[tuple[int, int], torch.Tensor],
                   nb: int, bpb: int) -> bool:
    reqs, expected = _requests(seg_keys, mirrors, nb)
    dst = torch.zeros(len(reqs) * nb, bpb, dtype=torch.uint8)
    return all(store.restore_round(reqs, dst)) and torch.equal(dst, torch.cat(expected))


def _lossy_max_err(store: SharedStore, seg_keys: list[SegmentKey], mirrors: dict[tuple[int, int], torch.Tensor],
                   nb: int, layout: KVLayout, dtype: str) -> float:
    reqs, expected = _requests(seg_keys, mirrors, nb)
    dst = torch.zeros(len(reqs) * nb, layout.bytes_per_block, dtype=torch.uint8)
    assert all(store.restore_round(reqs, dst))
    tdt = getattr(torch, dtype)
    return float((dst.view(tdt).float() - torch.cat(expected).view(tdt).float()).abs().max())


def print_report(report: dict[str, Any]) -> None:
    print(f"real KV: {report['model']}; {report['num_agents']} agents, segments of {report['segment_tokens']} "
          f"tokens, recomputed {report['recompute_fraction']:.1%} of positions ({report['granularity']})")
    print(f"  bytes per agent: full copies {report['full_copy_bytes_per_agent'] / 2**20:.2f} MiB, mirrors "
          f"{report['mirror_bytes_per_agent'] / 2**20:.3f} MiB -> {report['bytes_ratio']:.1f}x less "
          f"(worst agent {report['bytes_ratio_min_agent']:.1f}x; on SSD {report['bytes_ratio_ssd']:.1f}x; "
          f"lossy bound {report['error_bound_abs']:g}: {report['bytes_ratio_lossy']:.1f}x, "
          f"max err {report['lossy_max_err']:.4g})")
    print(f"  differing blocks {report['diff_block_fraction']:.1%}, differing rows {report['diff_row_fraction']:.1%}")
    print(f"  restore {report['restore_bytes'] / 2**20:.1f} MiB: fused {report['fused_gbps']:.2f} GB/s, "
          f"dense reconstruct-then-copy {report['dense_gbps']:.2f} GB/s -> {report['fused_vs_dense']:.2f}x; "
          f"memcpy of full copies {report['memcpy_gbps']:.2f} GB/s")
    print(f"  bit-exact lossless restores (fused, dense, SSD): {report['bit_exact']}")
    print("targets met: " + ", ".join(f"{k}={'yes' if v else 'NO'}" for k, v in report["targets_met"].items()))
