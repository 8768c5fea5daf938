"""``kvtier bench codecs`` (issue 24): the measures, the KV sample file's checks, the CLI."""

from __future__ import annotations

import doctest
import json
from pathlib import Path

import numpy as np
import pytest

from kvtier.benchmarks import codecs
from kvtier.cli import main
from kvtier.errors import ConfigError


def test_doctest() -> None:
    assert doctest.testmod(codecs).failed == 0


def test_lossless_codecs_are_exact_and_lossy_ones_bounded() -> None:
    report = codecs.run(*codecs.synthetic_sample(4), repeats=1)
    rows = {r["codec"]: r for r in report["results"]}
    for name in ("raw", "zstd", "bplane-zstd"):
        assert rows[name]["rel_mse"] == 0 and rows[name]["attn_tv"] == 0 and not rows[name]["lossy"]
    assert rows["rq4"]["rel_mse"] < 0.0115 and rows["rq3"]["rel_mse"] < 0.037
    assert rows["rq4"]["ratio"] > 3.7 and rows["rq3"]["ratio"] > 4.8
    assert rows["bplane-zstd"]["ratio"] > 1.2
    # the outlier channels: without the rotation the same quantizer loses far more
    assert rows["rq4-norot"]["rel_mse"] > 5 * rows["rq4"]["rel_mse"]
    assert rows["rq4-norot"]["attn_logit_rel_err"] > 2 * rows["rq4"]["attn_logit_rel_err"]
    assert all(r["memcpy_gbps"] > 0 for r in rows.values())


def test_error_measures() -> None:
    blocks, meta = codecs.synthetic_sample(2)
    exact = codecs._as_f32(blocks, meta)
    same = codecs.errors(exact, exact)
    assert same["rel_mse"] == 0 and same["cosine_min"] == pytest.approx(1, abs=1e-6) and same["attn_tv"] == 0
    worse = codecs.errors(exact, exact * 0.5)
    assert worse["rel_mse"] == pytest.approx(0.25) and worse["attn_logit_rel_err"] == pytest.approx(0.5)
    assert worse["cosine_min"] == pytest.approx(1, abs=1e-5) and worse["attn_tv"] > 0


def _save(path: Path, blocks: np.ndarray, meta: dict) -> Path:
    np.savez(path, blocks=blocks, meta=np.array(json.dumps(meta)))
    return path


def test_sample_file_round_trip_and_bad_files(tmp_path: Path) -> None:
    blocks, meta = codecs.synthetic_sample(2)
    got, got_meta = codecs.load_sample(_save(tmp_path / "ok.npz", blocks, meta))
    assert np.array_equal(got, blocks) and got_meta == meta
    (tmp_path / "junk.npz").write_text("not a zip")
    cases = {
        tmp_path / "missing.npz": "not a readable",
        tmp_path / "junk.npz": "not a readable",
        _save(tmp_path / "order.npz", blocks, {**meta, "order": "token, dim"}): "meta.order",
        _save(tmp_path / "field.npz", blocks, {k: v for k, v in meta.items() if k != "head_dim"}): "meta.head_dim",
        _save(tmp_path / "shape.npz", blocks[:, :100], meta): "blocks",
    }
    np.savez(tmp_path / "nometa.npz", blocks=blocks)
    cases[tmp_path / "nometa.npz"] = "no 'meta'"
    for path, what in cases.items():
        with pytest.raises(ConfigError, match=what) as info:
            codecs.load_sample(path)
        assert "--kv" in str(info.value)


def test_cli_writes_the_table_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sample = _save(tmp_path / "kv.npz", *codecs.synthetic_sample(2, seed=3))
    out = tmp_path / "codecs.json"
    assert main(["bench", "codecs", "--kv", str(sample), "--repeats", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert {r["sample"] for r in report["results"]} == {"engine", "synthetic-outliers"}
    assert set(report["targets_met"]) == {"engine:rq4_decode>=1.5GB/s", "synthetic-outliers:rq4_decode>=1.5GB/s"}
    text = capsys.readouterr().out
    assert "rq4-norot" in text and "targets met" in text
