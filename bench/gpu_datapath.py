"""The connector's device data path against a plain pinned copy, and what it costs the model's compute.

Caches shaped like vLLM's for a real model (default: Llama-3.1-8B, 32 layers
of ``[2, blocks, 16, 8, 128]`` bf16, 2 MiB per 16-token block) live on the
device. N blocks are stored and loaded through kvtier's worker path, the
functions ``KVTierWorker`` itself calls (``BlockIO.copy_out`` into a run of
its ``StagingRing``, pinned when an accelerator is present, in
``wait_for_save``; ``BlockIO.scatter`` from a run for a load finished in
``get_finished``, waiting on its event before the run is reused; the tier
reads on the host are not timed), and every loaded byte is compared with what
was stored. Baseline, measured in the same run: one contiguous device buffer
of the same bytes copied to and from pinned host memory with
``copy_(non_blocking=True)`` (the transfer rate the link gives). Then a bf16
matmul loop on the default stream is timed alone and while a thread keeps
storing and loading through kvtier: its slowdown is what a forward pass would
lose while kvtier moves KV.

Needs torch only (and kvtier's integration package on the path, no vLLM):

    python bench/gpu_datapath.py                     # CUDA (or NPU) when present, else CPU
    python bench/gpu_datapath.py --device cpu --layers 2 --cache-blocks 64 --blocks 8   # the CI smoke run

Targets (issue 22), checked on an accelerator only (on the CPU both paths are
memcpy and the figures are a smoke test): store and load >= 0.8x the pinned
copy at 1 MiB+ per block; the concurrent matmul slowed by <= 10%.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "integrations" / "vllm_ascend"))
from kvtier_vllm.blockio import BlockIO  # noqa: E402  (no vLLM import)
from kvtier_vllm.staging import StagingRing  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "npu":  # pragma: no cover - needs Ascend hardware
        torch.npu.synchronize(device)  # type: ignore[attr-defined]


def _default_device() -> str:
    if torch.cuda.is_available():
        return "cuda"
    if hasattr(torch, "npu") and torch.npu.is_available():  # type: ignore[attr-defined]  # pragma: no cover
        return "npu"
    return "cpu"


def _best(fn, repeats: int, device: torch.device) -> float:
    """Best wall seconds of ``repeats`` runs of ``fn`` (after one warm-up), device work included."""
    fn()
    _sync(device)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device or _default_device())
    dtype = DTYPES[args.dtype]
    shape = (2, args.cache_blocks, args.block_tokens, args.kv_heads, args.head_dim)
    gen = torch.Generator(device="cpu").manual_seed(0)
    caches = {f"model.layers.{i}.self_attn": torch.randn(shape, generator=gen).to(dtype).to(device)
              for i in range(args.layers)}
    io = BlockIO(caches, num_blocks=args.cache_blocks, side_stream=args.stream == "side",
                 device_staging_bytes=args.device_staging_mib << 20)
    n = args.blocks
    if 2 * n > args.cache_blocks:
        raise SystemExit(f"--blocks {n}: needs --cache-blocks >= {2 * n} (stores from one half, loads into the other)")
    nbytes = n * io.bytes_per_block
    src = list(range(0, 2 * n, 2))  # scattered, as a request's blocks are
    dst = list(range(1, 2 * n, 2))

    # kvtier's worker path, through a staging ring as the worker builds it
    ring = StagingRing(2 * nbytes, io.bytes_per_block, pin=device.type != "cpu")
    stored = ring.take(n)
    loaded = ring.take(n)
    assert stored is not None and loaded is not None and len(stored) == len(loaded) == n

    def store() -> None:
        ready = io.copy_out(src, stored.rows)
        if ready is not None:
            ready.synchronize()  # what the worker's copy thread waits on before reading the rows

    def load() -> None:
        done = io.scatter(dst, loaded.rows)  # the engine thread's part of a load (get_finished)
        if done is not None:
            done.synchronize()  # before the run is reused (the worker polls the event instead)

    store()
    loaded.rows.copy_(stored.rows)  # the tier read (DRAM slots or SSD values) into the load's run
    load()
    _sync(device)
    verified = all(torch.equal(t[:, src].cpu(), t[:, dst].cpu()) for t in caches.values())
    kv_store_s = _best(store, args.repeats, device)
    kv_load_s = _best(load, args.repeats, device)

    # baseline: the same bytes, contiguous, to and from pinned host memory
    pin = device.type != "cpu"
    dev_buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host_buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    base_store_s = _best(lambda: host_buf.copy_(dev_buf, non_blocking=True), args.repeats, device)
    base_load_s = _best(lambda: dev_buf.copy_(host_buf, non_blocking=True), args.repeats, device)

    # concurrent matmul on the default stream, alone and while kvtier moves blocks
    m = args.matmul
    mm_dtype = dtype if device.type != "cpu" else torch.float32
    a = torch.randn((m, m), generator=gen).to(mm_dtype).to(device)
    b = torch.randn((m, m), generator=gen).to(mm_dtype).to(device)

    def matmuls() -> None:
        for _ in range(args.matmul_iters):
            torch.mm(a, b)

    alone_s = _best(matmuls, args.repeats, device)
    stop = threading.Event()
    moved = [0]

    def mover() -> None:
        while not stop.is_set():
            store()
            load()
            moved[0] += 2 * nbytes

    thread = threading.Thread(target=mover, daemon=True)
    thread.start()
    try:
        time.sleep(0.05)
        busy_s = _best(matmuls, args.repeats, device)
    finally:
        stop.set()
        thread.join()
    gib = 1 << 30
    return {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
        "torch": torch.__version__,
        "cache_shape_per_layer": list(shape),
        "layers": args.layers,
        "dtype": args.dtype,
        "stream": "side" if io.stream is not None else "engine",
        "device_staging_bytes": io.device_staging_bytes,
        "blocks_moved": n,
        "bytes_per_block": io.bytes_per_block,
        "bytes_moved": nbytes,
        "verified": verified,
        "kvtier_store_gibps": nbytes / kv_store_s / gib,
        "kvtier_load_gibps": nbytes / kv_load_s / gib,
        "pinned_store_gibps": nbytes / base_store_s / gib,
        "pinned_load_gibps": nbytes / base_load_s / gib,
        "store_vs_pinned": base_store_s / kv_store_s,
        "load_vs_pinned": base_load_s / kv_load_s,
        "matmul_alone_s": alone_s,
        "matmul_during_transfers_s": busy_s,
        "matmul_slowdown": busy_s / alone_s - 1.0,
        "bytes_moved_during_matmul": moved[0],
        "targets": {"store_ge_0.8x_pinned": base_store_s / kv_store_s >= 0.8,
                    "load_ge_0.8x_pinned": base_load_s / kv_load_s >= 0.8,
                    "matmul_slowdown_le_10pct": busy_s / alone_s - 1.0 <= 0.10,
                    "checked": device.type != "cpu"},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="Prints a table and, with --json, writes the figures.")
    ap.add_argument("--device", help="cuda, cuda:1, npu, cpu (default: an accelerator when present)")
    ap.add_argument("--layers", type=int, default=32, help="layers (default 32, Llama-3.1-8B)")
    ap.add_argument("--cache-blocks", type=int, default=2048, help="blocks per layer cache (default 2048)")
    ap.add_argument("--blocks", type=int, default=256, help="blocks stored and loaded per operation (default 256)")
    ap.add_argument("--block-tokens", type=int, default=16, help="tokens per block (default 16)")
    ap.add_argument("--kv-heads", type=int, default=8, help="KV heads (default 8)")
    ap.add_argument("--head-dim", type=int, default=128, help="head dimension (default 128)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16", help="cache dtype (default bfloat16)")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per figure, the best is kept (default 5)")
    ap.add_argument("--matmul", type=int, default=8192, help="matmul size M (M x M @ M x M; default 8192)")
    ap.add_argument("--matmul-iters", type=int, default=20, help="matmuls per timed run (default 20)")
    ap.add_argument("--stream", choices=("side", "engine"), default="side",
                    help="copy on a stream of kvtier's own (side, the connector's default) or on the default "
                         "stream, where the matmuls run (engine); no streams on the CPU")
    ap.add_argument("--device-staging-mib", type=int, default=64,
                    help="device staging buffer between the caches and host rows (MiB, default 64, as the "
                         "connector's device_staging_mib)")
    ap.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = ap.parse_args(argv)
    for name in ("layers", "cache_blocks", "blocks", "block_tokens", "kv_heads", "head_dim", "repeats", "matmul",
                 "matmul_iters", "device_staging_mib"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be > 0")
    print(f"[gpu_datapath] device {args.device or _default_device()}: allocating {args.layers} layer caches ...",
          file=sys.stderr, flush=True)
    r = run(args)
    print(f"device {r['device_name']} ({r['device']}), torch {r['torch']}; {r['layers']} layers "
          f"{r['cache_shape_per_layer']} {r['dtype']}; {r['blocks_moved']} blocks of "
          f"{r['bytes_per_block'] / (1 << 20):.2f} MiB = {r['bytes_moved'] / (1 << 20):.0f} MiB per operation; "
          f"copies on the {r['stream']} stream, {r['device_staging_bytes'] >> 20} MiB device staging; "
          f"loaded bytes verified: {r['verified']}")
    print(f"{'':24}{'kvtier path':>14}{'pinned copy':>14}{'ratio':>8}")
    print(f"{'store (device->host)':24}{r['kvtier_store_gibps']:>10.2f} GiB/s{r['pinned_store_gibps']:>8.2f} GiB/s"
          f"{r['store_vs_pinned']:>7.2f}x")
    print(f"{'load (host->device)':24}{r['kvtier_load_gibps']:>10.2f} GiB/s{r['pinned_load_gibps']:>8.2f} GiB/s"
          f"{r['load_vs_pinned']:>7.2f}x")
    print(f"matmul {args.matmul}^3 x {args.matmul_iters}: alone {r['matmul_alone_s'] * 1e3:.1f} ms, while kvtier "
          f"moves blocks {r['matmul_during_transfers_s'] * 1e3:.1f} ms: slowdown {r['matmul_slowdown'] * 100:+.1f}%")
    t = r["targets"]
    if t["checked"]:
        print("targets: " + ", ".join(f"{k}={'yes' if v else 'NO'}" for k, v in t.items() if k != "checked"))
    else:
        print("targets: not checked on the CPU (both paths are memcpy here; run on an accelerator)")
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=2) + "\n")
    return 0 if r["verified"] else 1


if __name__ == "__main__":
    sys.exit(main())
