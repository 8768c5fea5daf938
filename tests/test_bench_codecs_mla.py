"""``rq4`` / ``rq3`` on MLA latents (issue 40): the per-part measures, the verdict, and
that the decision in ``kvtier.tiers.rq`` is the one the committed measurement gives."""

from __future__ import annotations

import doctest
import json
from pathlib import Path

import numpy as np
import pytest

from kvtier.benchmarks import codecs_mla
from kvtier.errors import ConfigError
from kvtier.layout import KVLayout
from kvtier.tiers import rq

ROOT = Path(__file__).resolve().parents[1]
MLA = KVLayout(2, 1, 576, "bfloat16", 16, arrangement="mla")


def test_doctest() -> None:
    assert doctest.testmod(codecs_mla).failed == 0


def test_error_measures_keep_the_parts_apart() -> None:
    blocks, meta = codecs_mla.synthetic_mla_sample(2)
    exact = codecs_mla.as_f32(blocks, meta)
    same = codecs_mla.errors(exact, exact, 512)
    assert all(same[p]["rel_mse"] == 0 and same[p]["attn_tv"] == 0 for p in codecs_mla.PARTS)
    half = codecs_mla.errors(exact, exact * 0.5, 512)
    for part in codecs_mla.PARTS:
        assert half[part]["rel_mse"] == pytest.approx(0.25) and half[part]["attn_logit_rel_err"] == pytest.approx(0.5)
        assert half[part]["cosine_min"] == pytest.approx(1, abs=1e-5) and half[part]["attn_tv"] > 0
    # noise on the rope part only: the nope figures stay exact, the whole latent sees part of it
    noisy = exact.copy()
    noisy[..., 512:] += np.random.default_rng(1).standard_normal(noisy[..., 512:].shape).astype(np.float32) * 0.3
    got = codecs_mla.errors(exact, noisy, 512)
    assert got["nope"]["rel_mse"] == 0 and got["nope"]["attn_logit_rel_err"] == 0
    assert got["rope"]["rel_mse"] > got["whole"]["rel_mse"] > 0
    assert got["rope"]["attn_logit_rel_err"] > got["whole"]["attn_logit_rel_err"] > 0


def test_codecs_on_synthetic_latents_through_the_value_path() -> None:
    report = codecs_mla.run(*codecs_mla.synthetic_mla_sample(4))
    assert report["vector_dim"] == 64 and report["layout"] == MLA.describe()
    rows = {(r["codec"], r["part"]): r for r in report["results"]}
    assert set(rows) == {(c, p) for c in ("rq4", "rq3") for p in codecs_mla.PARTS}
    for part in codecs_mla.PARTS:  # every part near the quantizer's distortion (0.0095 / 0.0345)
        assert 0.007 < rows["rq4", part]["rel_mse"] < 0.0115 and 0.028 < rows["rq3", part]["rel_mse"] < 0.037
    assert rows["rq4", "whole"]["ratio"] > 3.6 and rows["rq3", "whole"]["ratio"] > 4.7


def test_the_rope_part_is_coded_with_a_scale_of_its_own() -> None:
    # a rope part 1000x the nope part: with one scale per latent the nope part would be lost
    x = np.random.default_rng(2).standard_normal((16, 576)).astype(np.float32)
    x[:, 512:] *= 1000
    payload = rq.encode_payload(x.tobytes(), "float32", 576, 4, seed=3)
    assert payload is not None and rq._SUB.unpack_from(payload)[2] == 6  # log2 of 64-wide vectors
    out = np.empty_like(x)
    rq.decode_payload(payload, 4, out)
    nope_err = ((out[:, :512] - x[:, :512]) ** 2).sum() / (x[:, :512] ** 2).sum()
    assert nope_err < 0.0115
    assert rq.vector_dim(576) == 64 and rq.vector_dim(128) == 128 and rq.vector_dim(96) == 32


def test_verdict_names_the_figures_that_are_worse() -> None:
    gqa = {"rq4": {"rel_mse": 0.01, "cosine_min": 0.95, "attn_logit_rel_err": 0.1, "attn_tv": 0.04}}
    row = {"codec": "rq4", "part": "rope", **gqa["rq4"]}
    assert codecs_mla.verdict([row], gqa) == {"rq4": {"within": True, "worse": []}}
    assert codecs_mla.verdict([{**row, "rel_mse": 0.0109}], gqa)["rq4"]["within"]  # within 10%
    bad = codecs_mla.verdict([{**row, "rel_mse": 0.0111, "cosine_min": 0.94}], gqa)["rq4"]
    assert not bad["within"] and len(bad["worse"]) == 2
    assert bad["worse"][0].startswith("rope rel_mse 0.0111 vs GQA 0.0100")
    assert codecs_mla.verdict([{**row, "cosine_min": 0.999}], gqa)["rq4"]["within"]  # higher cosine is better


def _save(path: Path, blocks: np.ndarray, meta: dict) -> Path:
    np.savez(path, blocks=blocks, meta=np.array(json.dumps(meta)))
    return path


def test_sample_file_round_trip_and_bad_files(tmp_path: Path) -> None:
    blocks, meta = codecs_mla.synthetic_mla_sample(2)
    got, got_meta = codecs_mla.load_mla_sample(_save(tmp_path / "ok.npz", blocks, meta))
    assert np.array_equal(got, blocks) and got_meta == meta
    cases = {
        tmp_path / "missing.npz": "not a readable",
        _save(tmp_path / "gqa.npz", blocks, {**meta, "order": "layer, kv_head, kv, token, dim"}): "meta.order",
        _save(tmp_path / "rank.npz", blocks, {**meta, "kv_lora_rank": 256}): "kv_lora_rank",
        _save(tmp_path / "field.npz", blocks, {k: v for k, v in meta.items() if k != "qk_rope_head_dim"}):
            "meta.qk_rope_head_dim",
        _save(tmp_path / "shape.npz", blocks[:, :100], meta): "blocks",
    }
    for path, what in cases.items():
        with pytest.raises(ConfigError, match=what):
            codecs_mla.load_mla_sample(path)


def test_the_decision_in_the_code_is_the_committed_measurement() -> None:
    """bench/out/codecs-mla.json (bench/codec_mla_results.py) decides whether rq accepts MLA:
    its verdict follows from its own figures, its GQA reference is the current codecs.json,
    and kvtier.tiers.rq accepts the measured layout exactly when every figure is within."""
    data = json.loads((ROOT / "bench" / "out" / "codecs-mla.json").read_text())
    assert codecs_mla.verdict(data["results"], data["gqa"]["codecs"], data["tolerance"]) == data["verdict"]
    gqa = json.loads((ROOT / "bench" / "out" / "codecs.json").read_text())
    engine = {r["codec"]: r for r in gqa["results"] if r["sample"] == "engine"}
    for codec, figures in data["gqa"]["codecs"].items():
        assert figures == {f: engine[codec][f] for f in codecs_mla.FIGURES}, "rerun bench/codec_mla_results.py"
    arrangement, layers, heads, width, dtype, block = data["sample"]["layout"].split(":")  # mla:L2:H1:D576:...
    layout = KVLayout(int(layers[1:]), int(heads[1:]), int(width[1:]), dtype, int(block[1:]), arrangement=arrangement)
    assert layout.arrangement == "mla" and layout.head_dim == sum(rq.MLA_LATENT_DIMS)
    assert (data["sample"]["kv_lora_rank"], data["sample"]["qk_rope_head_dim"]) == rq.MLA_LATENT_DIMS
    accepted = rq.layout_problem(layout) is None
    for codec, v in data["verdict"].items():
        assert v["within"] == accepted == data["accepted"][codec], f"{codec}: the code and the measurement disagree"
