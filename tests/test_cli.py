"""The command line: --help everywhere, inspect over a real SSD directory."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import lmdb
import pytest
import torch

from kvtier.cli import build_parser, main
from kvtier.config import load_config
from kvtier.keys import key_to_bytes
from kvtier.store import TieredStore

LAYOUT = {"num_layers": 1, "num_kv_heads": 2, "head_dim": 16, "dtype": "bfloat16", "block_size": 4}


def _subcommands() -> list[list[str]]:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return [[name] for name in sub.choices]


@pytest.mark.parametrize("argv", [[], *_subcommands()])
def test_every_command_has_help(argv: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--help"])
    assert exc.value.code == 0
    assert "usage:" in capsys.readouterr().out


def test_import_kvtier_pulls_no_engine_or_grpc() -> None:
    code = ("import sys, kvtier; bad = [m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'vllm', 'sglang', 'torch_npu', 'grpc')]; print(bad); sys.exit(1 if bad else 0)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


def test_inspect_lists_and_flags_a_corrupt_value(tmp_path: Path, capsys) -> None:
    ssd = tmp_path / "ssd"
    cfg = load_config(env={}, overrides={"layout": LAYOUT, "put_tier": "ssd", "tiers": {
        "hbm": {"enabled": False}, "dram": {"enabled": False},
        "ssd": {"enabled": True, "capacity_blocks": 8, "path": str(ssd), "codec": "auto"}}})
    with TieredStore(cfg) as store:
        keys = store.keys_for(list(range(12)))
        store.put(keys, [torch.randn(256).to(torch.bfloat16) for _ in keys])
    assert main(["inspect", str(ssd)]) == 0
    out = capsys.readouterr().out
    assert "3 blocks" in out
    env = lmdb.open(str(ssd))
    with env.begin(write=True) as txn:
        raw = bytearray(txn.get(key_to_bytes(keys[0])))
        raw[-1] ^= 0x01
        txn.put(key_to_bytes(keys[0]), bytes(raw))
    env.close()
    assert main(["inspect", str(ssd)]) == 1


def test_inspect_of_a_non_tier_directory_names_the_setting(tmp_path: Path, capsys) -> None:
    assert main(["inspect", str(tmp_path)]) == 2
    assert "tiers.ssd.path" in capsys.readouterr().err


def test_replay_cli_writes_json_and_plot(tmp_path: Path, capsys) -> None:
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    rc = main(["replay", "--sessions", "3", "--policies", "lru,lru-dram", "--sweep-conc", "1,2",
               "--hbm-fraction", "0.2", "--json", str(out_json), "--plot", str(out_png), "--quiet"])
    assert rc == 0
    import json

    report = json.loads(out_json.read_text())
    for key in ("trace", "profile", "seed", "kvtier_version"):
        assert key in report
    assert len(report["results"]) == 4  # 2 policies x 2 conc
    required = ("policy", "conc", "hbm_blocks", "ttft_p50_s", "ttft_p99_s", "ttft_p99_later_turns_s",
                "interactivity_p50", "e2e_mean_s", "throughput_per_chip_tok_s", "prefill_tokens_computed",
                "prefill_tokens_hit_hbm", "prefill_tokens_hit_dram", "prefill_tokens_hit_ssd", "bytes_moved")
    for row in report["results"]:
        assert all(k in row for k in required), set(required) - set(row)
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "lru-dram" in capsys.readouterr().out


def test_replay_cli_names_a_truncated_trace(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "broken.json"
    bad.write_text('{"id": "x", "block_size": 64, "requests": [{"t": 0, "type": "n", "in": 100')
    assert main(["replay", "--trace", str(bad), "--quiet"]) == 2
    assert "broken.json" in capsys.readouterr().err


def test_replay_of_written_generator_traces_matches_the_embedded_workload_with_declared_prefix(
        tmp_path: Path) -> None:
    # The generator writes aiperf-valid "local" traces; --shared-prefix declared
    # gives the same figures as the embedded workload, none (the default for
    # files) gives the sessions private prefixes and so more prefill work.
    import json

    from kvtier.replay.generator import DEFAULT_CONFIG, generate_coding_sessions, write_traces

    cfg = replace(DEFAULT_CONFIG, max_requests_per_agent=48)
    write_traces(tmp_path / "gen", generate_coding_sessions(3, seed=0, config=cfg))
    common = ["--policies", "lru", "--conc", "2", "--hbm-fraction", "0.2", "--quiet"]

    def computed(*extra: str) -> int:
        out = tmp_path / f"r{len(list(tmp_path.iterdir()))}.json"
        assert main(["replay", *extra, *common, "--json", str(out)]) == 0
        (row,) = [r for r in json.loads(out.read_text())["results"] if r["policy"] == "lru"]
        return row["prefill_tokens_computed"]

    embedded = computed("--sessions", "3")
    assert computed("--trace", str(tmp_path / "gen"), "--shared-prefix", "declared") == embedded
    assert computed("--trace", str(tmp_path / "gen")) > embedded


def test_bench_shared_engine_refuses_what_it_cannot_run(capsys) -> None:
    """``--engine`` wants whole 32-token blocks, and vLLM (the measurement itself runs in
    tests/engine/test_vllm_engine_shared.py, where vLLM is installed)."""
    import importlib.util

    assert main(["bench", "shared", "--engine", "--segment-tokens", "48"]) == 2
    assert "--segment-tokens=48" in capsys.readouterr().err
    if importlib.util.find_spec("vllm") is None:
        assert main(["bench", "shared", "--engine"]) == 2
        assert "--engine needs vLLM" in capsys.readouterr().err
