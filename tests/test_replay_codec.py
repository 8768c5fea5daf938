"""Compressed cold tiers in the replay (``kvtier replay --cold-codec``, kvtier.replay.codec).

Scenarios: raw (or no codec) changes nothing; a lossy codec multiplies what
DRAM and SSD hold, moves fewer bytes per block and, where decoding is faster
than recomputing, computes no more; each block is encoded once; a slow decoder
makes the cost model recompute; bad flags, files and fields are named."""

from __future__ import annotations

import doctest
import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

import kvtier.replay.codec
from kvtier.cli import build_parser, main
from kvtier.errors import ConfigError
from kvtier.placement import make_placement
from kvtier.replay import default_workload
from kvtier.replay.codec import DECODE, ENCODE, ColdCodec, cold_codec, transfer_stages
from kvtier.replay.profiles import get_profile
from kvtier.replay.run import ReplaySpec, reference_point, run_point
from kvtier.replay.sim import SimConfig, Simulator
from cli_support import cli_error

PROFILE = get_profile("h100-80gb", "llama-3.1-8b")
EXAMPLE = {"codecs": [
    {"codec": "raw", "ratio": 1.0, "encode_gbps": 8.0, "decode_gbps": 8.0},
    {"codec": "bplane-zstd", "ratio": 1.5, "encode_gbps": 0.6, "decode_gbps": 1.2},
    {"codec": "rq4", "ratio": 3.76, "encode_gbps": 0.8, "decode_gbps": 1.6, "note": "other fields are ignored"},
    {"codec": "rq3", "ratio": 4.9, "encode_gbps": 0.8, "decode_gbps": 1.6}]}
FAST_CORES = 8  # 12.8 GB/s of decode: faster than recomputing an 8 MiB block of Llama-3.1-8B on an H100


@pytest.fixture
def profile_path(tmp_path: Path) -> Path:
    p = tmp_path / "codecs.json"
    p.write_text(json.dumps(EXAMPLE))
    return p


def _workload():
    return default_workload(seed=1, num_sessions=4, max_requests_per_agent=10)


def _pressure_spec(codec: ColdCodec | None) -> ReplaySpec:
    """HBM at 15% of the working set, DRAM half of HBM, SSD as large as HBM: every tier is full."""
    w = _workload()
    hbm = ReplaySpec(workload=w, profile=PROFILE, hbm_fractions=(0.15,), concs=(4,)).capacities()[0]
    return ReplaySpec(workload=w, profile=PROFILE, concs=(4,), hbm_blocks=(hbm,), dram_blocks=hbm // 2,
                      ssd_blocks=hbm, cold_codec=codec, references=False)


def _figures(row: dict) -> dict:
    """A result row without wall-clock figures and the codec's own fields."""
    drop = {"wall_s", "block_touches_per_s", "cold_codec", "cold_codec_ratio", "cold_codec_tiers", "codec_cores",
            "dram_blocks_effective", "ssd_blocks_effective"}
    return json.loads(json.dumps({k: v for k, v in row.items() if k not in drop}, default=float))


# ------------------------------------------------------------------ identity


@pytest.mark.parametrize("surface", ["full", "vllm", "vllm-write-through"])
def test_raw_gives_the_results_of_no_codec(profile_path: Path, surface: str) -> None:
    raw = cold_codec("raw", profile_path)
    assert raw.identity and raw.capacity_blocks("dram", 123) == 123
    for policy in ("lru-dram", "kvtier", "tokencake"):  # write-through, exclusive DRAM + SSD, swap + prefetch
        none, same = (replace(_pressure_spec(c), surface=surface) for c in (None, raw))
        hbm = none.hbm_blocks[0]
        a, b = run_point(none, policy, 4, hbm), run_point(same, policy, 4, hbm)
        assert _figures(a) == _figures(b), policy
        assert b["cold_codec"] == "raw" and b["dram_blocks_effective"] == b["dram_blocks"]
        assert "cold_codec" not in a and not any(k.startswith("codec_") for k in a["counters"])
    assert reference_point(none, 4, hbm) | {"wall_s": 0} == reference_point(same, 4, hbm) | {"wall_s": 0}


def test_cli_raw_output_equals_the_run_without_the_flags(profile_path: Path, tmp_path: Path, capsys) -> None:
    base = ["replay", "--quiet", "--sessions", "3", "--hbm-fraction", "0.2", "--ssd-blocks", "500",
            "--policies", "lru-dram,kvtier", "--jobs", "1", "--full"]
    assert main([*base, "--json", str(tmp_path / "a.json")]) == 0
    plain = capsys.readouterr().out
    assert main([*base, "--json", str(tmp_path / "b.json"), "--cold-codec", "raw", "--codec-profile",
                 str(profile_path)]) == 0
    with_raw = capsys.readouterr().out
    a, b = (json.loads((tmp_path / n).read_text()) for n in ("a.json", "b.json"))
    assert [_figures(r) for r in a["results"]] == [_figures(r) for r in b["results"]]
    assert [r | {"wall_s": 0} for r in a["references"]] == [r | {"wall_s": 0} for r in b["references"]]
    assert b["cold_codec"]["name"] == "raw" and "cold_codec" not in a
    # the summary's policy lines are the same; the caption says the codec
    assert plain.splitlines()[1:3] == with_raw.splitlines()[1:3]
    assert "cold codec raw (stored as is)" in with_raw.splitlines()[0]


# ------------------------------------------------------------------ capacities and bytes


def test_rq4_multiplies_what_dram_and_ssd_hold(profile_path: Path) -> None:
    rq4 = cold_codec("rq4", profile_path)
    cfg = SimConfig(hbm_blocks=100, dram_blocks=200, ssd_blocks=1000, cold_codec=rq4)
    assert [cfg.tier_blocks(t) for t in ("hbm", "dram", "ssd")] == [100, 752, 3760]  # floor(3.76 x)
    sim = Simulator(_workload(), cfg, make_placement("lru-dram"), PROFILE)
    assert [sim.mgr.capacity_blocks(t) for t in ("hbm", "dram", "ssd")] == [100, 752, 3760]
    ssd_only = replace(cfg, cold_codec=cold_codec("rq4", profile_path, tiers=("ssd",)))
    assert [ssd_only.tier_blocks(t) for t in ("dram", "ssd")] == [200, 3760]
    # the report keeps the byte budgets and states what they hold; the bound gets the blocks the policies get
    spec = _pressure_spec(rq4)
    hbm = spec.hbm_blocks[0]
    row = run_point(spec, "lru-dram", 4, hbm)
    assert (row["dram_blocks"], row["ssd_blocks"]) == (hbm // 2, hbm)
    assert row["dram_blocks_effective"] == math.floor(hbm // 2 * 3.76)
    assert row["ssd_blocks_effective"] == math.floor(hbm * 3.76)
    assert (row["cold_codec"], row["cold_codec_ratio"], row["cold_codec_tiers"]) == ("rq4", 3.76, ["dram", "ssd"])
    ref = reference_point(spec, 4, hbm)
    assert ref["total_blocks"] == hbm + row["dram_blocks_effective"] + row["ssd_blocks_effective"]


def test_under_pressure_rq4_computes_no_more_and_moves_fewer_bytes(profile_path: Path) -> None:
    rq4 = cold_codec("rq4", profile_path, cores=FAST_CORES)
    stored = rq4.stored_bytes(PROFILE.kv_bytes_per_block(64))
    for policy in ("lru-dram", "kvtier"):
        raw_spec, rq4_spec = _pressure_spec(None), _pressure_spec(rq4)
        hbm = raw_spec.hbm_blocks[0]
        raw, comp = run_point(raw_spec, policy, 4, hbm), run_point(rq4_spec, policy, 4, hbm)
        assert comp["prefill_tokens_computed"] <= raw["prefill_tokens_computed"], policy
        assert comp["prefill_tokens_computed"] < raw["prefill_tokens_computed"] * 0.95, policy  # the room pays
        # every block brought to HBM (loads; kvtier's prefetches too) is decoded once on the host and crosses
        # the accelerator link raw; the tiers kept more, so more blocks were loaded
        load_bytes = {r: sum(v for k, v in x["bytes_moved_per_link"].items() if k.endswith("->hbm"))
                      for r, x in (("raw", raw), ("rq4", comp))}
        raw_loaded, rq4_loaded = load_bytes["raw"] // PROFILE.kv_bytes_per_block(64), comp["counters"][
            "codec_decoded_blocks"]
        assert load_bytes["raw"] % PROFILE.kv_bytes_per_block(64) == 0 and raw_loaded > 0
        assert load_bytes["rq4"] == rq4_loaded * PROFILE.kv_bytes_per_block(64)
        assert rq4_loaded >= (comp["prefill_tokens_hit_dram"] + comp["prefill_tokens_hit_ssd"]) // 64 > 0
        assert rq4_loaded > raw_loaded, policy
        # the DRAM <-> SSD hops carry compressed bytes: ratio x fewer per block
        ssd_links = {r: sum(v for k, v in x["bytes_moved_per_link"].items() if "ssd" in k) for r, x in
                     (("raw", raw), ("rq4", comp))}
        assert ssd_links["rq4"] > 0 and ssd_links["rq4"] % stored == 0


def test_a_decoder_slower_than_recompute_is_not_loaded_from(profile_path: Path) -> None:
    """One core at 1.6 GB/s decodes an 8 MiB block in 5.2 ms; the H100 recomputes its 64 tokens
    in about 4.7 ms: the cost model (the policies' should_load) recomputes instead."""
    slow = ColdCodec("slow", ratio=3.76, encode_gbps=0.8, decode_gbps=0.01)
    spec = _pressure_spec(slow)
    row = run_point(spec, "lru-dram", 4, spec.hbm_blocks[0])
    assert row["prefill_tokens_hit_dram"] == row["prefill_tokens_hit_ssd"] == 0
    assert row["counters"].get("codec_decoded_blocks", 0) == 0
    sim = Simulator(_workload(), SimConfig(hbm_blocks=100, dram_blocks=100, cold_codec=slow),
                    make_placement("lru-dram"), PROFILE)
    assert sim.ctx.transfer_time_s(10, "dram->hbm") > PROFILE.recompute_time_s(640, 0)
    assert sim.ctx.transfer_time_s(10, "dram->hbm") == pytest.approx(10 * 8 * 2**20 / 0.01e9, rel=0.01)


# ------------------------------------------------------------------ encode once


def test_each_block_is_encoded_once_when_written_to_dram_and_ssd(profile_path: Path) -> None:
    # lru-dram writes every computed block through to DRAM and to the SSD; both are large
    # enough to drop nothing, so every block written down is in both, encoded once.
    rq4 = cold_codec("rq4", profile_path, cores=FAST_CORES)
    w = _workload()
    sim = Simulator(w, SimConfig(hbm_blocks=1500, dram_blocks=w.num_distinct_blocks(),
                                 ssd_blocks=w.num_distinct_blocks(), conc=4, cold_codec=rq4),
                    make_placement("lru-dram"), PROFILE)
    res = sim.run()
    written = sim.mgr.used_blocks("ssd")
    assert written == sim.mgr.used_blocks("dram") > 0
    assert res.counters["codec_encoded_blocks"] == written  # not 2x: the SSD gets DRAM's compressed copy
    bpb = PROFILE.kv_bytes_per_block(w.block_size)
    assert res.bytes_moved["dram->ssd"] == written * rq4.stored_bytes(bpb)
    # loads decode every block they bring back into HBM, and nothing else decodes
    hits = sum(r.hit_dram_tokens + r.hit_ssd_tokens for r in res.records) // w.block_size
    assert res.counters.get("codec_decoded_blocks", 0) == hits


def test_a_victim_with_a_compressed_copy_below_is_not_encoded_again(profile_path: Path) -> None:
    """kvtier: exclusive DRAM (HBM victims go down) and write-through to the SSD. A block
    computed is encoded for the SSD; when HBM evicts it, its DRAM copy reuses those bytes.
    With an SSD that drops nothing, no block is encoded twice."""
    rq4 = cold_codec("rq4", profile_path, cores=FAST_CORES)
    w = _workload()
    encoded: list = []

    class Recording(Simulator):
        def transfer_s(self, src, dst, num_blocks, num_encode=None):  # type: ignore[override]
            if src == "hbm":
                encoded.append(num_blocks if num_encode is None else num_encode)
            return super().transfer_s(src, dst, num_blocks, num_encode)

    sim = Recording(w, SimConfig(hbm_blocks=1500, dram_blocks=800, ssd_blocks=2 * w.num_distinct_blocks(), conc=4,
                                 cold_codec=rq4), make_placement("kvtier-no-dead"), PROFILE)
    res = sim.run()
    assert res.counters["codec_encoded_blocks"] == sum(encoded)
    assert 0 < res.counters["codec_encoded_blocks"] <= sim.mgr.used_blocks("ssd")
    assert res.bytes_moved["hbm->dram"] > 0  # victims did go down, without a second encode


def test_module_doctest() -> None:
    assert doctest.testmod(kvtier.replay.codec).failed == 0


def test_transfer_stages_per_path_and_tier_choice() -> None:
    both = ColdCodec("c", ratio=4.0, encode_gbps=1.0, decode_gbps=2.0)
    ssd = ColdCodec("c", ratio=4.0, encode_gbps=1.0, decode_gbps=2.0, tiers=("ssd",))
    n, bpb = 3, 1000
    # the codec runs on the host: the accelerator link carries raw bytes, the DRAM <-> SSD hop compressed ones
    assert transfer_stages(both, "hbm", "dram", n, bpb) == [("hbm->dram", 3000), (ENCODE, 3000)]
    assert transfer_stages(both, "hbm", "ssd", n, bpb, num_encode=1) == [
        ("hbm->dram", 3000), (ENCODE, 1000), ("dram->ssd", 750)]
    assert transfer_stages(both, "ssd", "hbm", n, bpb) == [("ssd->dram", 750), (DECODE, 3000), ("dram->hbm", 3000)]
    assert transfer_stages(both, "ssd", "dram", n, bpb) == [("ssd->dram", 750)]  # staging: no codec
    assert transfer_stages(both, "hbm", "dram", n, bpb, num_encode=0) == [("hbm->dram", 3000)]
    # SSD only: DRAM holds raw blocks, so the codec runs between DRAM and the SSD
    assert transfer_stages(ssd, "hbm", "ssd", n, bpb) == [("hbm->dram", 3000), (ENCODE, 3000), ("dram->ssd", 750)]
    assert transfer_stages(ssd, "ssd", "hbm", n, bpb) == [("ssd->dram", 750), (DECODE, 3000), ("dram->hbm", 3000)]
    assert transfer_stages(ssd, "dram", "hbm", n, bpb) == [("dram->hbm", 3000)]
    assert both.service_s(DECODE, 4_000_000_000) == pytest.approx(2.0)
    assert replace(both, cores=4).service_s(ENCODE, 4_000_000_000) == pytest.approx(1.0)


def test_ssd_only_codec_runs_and_decodes_into_dram(profile_path: Path) -> None:
    codec = cold_codec("rq4", profile_path, tiers=("ssd",), cores=FAST_CORES)
    spec = _pressure_spec(codec)
    row = run_point(spec, "kvtier", 4, spec.hbm_blocks[0])
    assert row["dram_blocks_effective"] == row["dram_blocks"] and row["ssd_blocks_effective"] > row["ssd_blocks"]
    assert row["counters"]["codec_encoded_blocks"] > 0


# ------------------------------------------------------------------ report


def test_report_states_codec_ratio_and_blocks_held(profile_path: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "r.json"
    rc = main(["replay", "--quiet", "--sessions", "3", "--hbm-fraction", "0.2", "--dram-blocks", "1000",
               "--ssd-blocks", "2000", "--policies", "lru-dram", "--jobs", "1", "--full", "--json", str(out),
               "--cold-codec", "rq4", "--codec-profile", str(profile_path), "--codec-cores", "4"])
    assert rc == 0
    text = capsys.readouterr().out
    assert ("cold codec rq4 on dram+ssd (ratio 3.76, 4 cores per direction): DRAM holds 3,760 blocks, "
            "SSD holds 7,520 blocks") in text
    header = next(line for line in text.splitlines() if "hbm_blk" in line)  # the --full table's codec columns
    assert header.split()[3:7] == ["codec", "ratio", "dram_blk", "ssd_blk"]
    assert text.splitlines()[-1].split()[3:7] == ["rq4", "3.76", "3760", "7520"]
    report = json.loads(out.read_text())
    assert report["cold_codec"] | {"profile": ""} == {
        "name": "rq4", "ratio": 3.76, "encode_gbps_per_core": 0.8, "decode_gbps_per_core": 1.6, "cores": 4,
        "tiers": ["dram", "ssd"], "profile": "", "identity": False}
    (row,) = report["results"]
    assert (row["dram_blocks"], row["dram_blocks_effective"], row["ssd_blocks_effective"]) == (1000, 3760, 7520)
    assert report["references"][0]["total_blocks"] == row["hbm_blocks"] + 3760 + 7520


def test_fleet_engines_compress_their_cold_tiers(profile_path: Path) -> None:
    spec = replace(_pressure_spec(cold_codec("rq4", profile_path, cores=FAST_CORES)), engines=2,
                   remote_blocks=500)
    row = run_point(spec, "lru-dram", 4, spec.hbm_blocks[0])
    assert row["counters"]["codec_encoded_blocks"] > 0 and row["remote_bytes_written"] > 0
    bpb = PROFILE.kv_bytes_per_block(64)
    assert row["remote_bytes_written"] % bpb == 0  # the remote tier stays raw


def test_help_explains_the_flags() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    text = " ".join(sub.choices["replay"].format_help().split())
    for needle in ("--cold-codec NAME", "floor(capacity x ratio)", "--codec-profile FILE.json",
                   "kvtier bench codecs writes", "--cold-codec-tiers {dram,ssd,ssd}", "--codec-cores N",
                   "encoded once"):
        assert needle in text, needle


# ------------------------------------------------------------------ bad input


def _write(tmp_path: Path, text: str) -> str:
    p = tmp_path / "p.json"
    p.write_text(text)
    return str(p)


@pytest.mark.parametrize("flags,says", [
    (["--cold-codec", "rq4"], ["--cold-codec='rq4'", "needs --codec-profile"]),
    (["--codec-profile", "{good}"], ["--codec-profile=", "give --cold-codec"]),
    (["--cold-codec-tiers", "ssd"], ["--cold-codec-tiers='ssd'", "give --cold-codec"]),
    (["--codec-cores", "4"], ["--codec-cores=4", "give --cold-codec"]),
    (["--cold-codec", "rq4", "--codec-profile", "/nonexistent/codecs.json"],
     ["--codec-profile='/nonexistent/codecs.json'", "no such file"]),
    (["--cold-codec", "rq4", "--codec-profile", "{notjson}"], ["--codec-profile=", "p.json", "not valid JSON"]),
    (["--cold-codec", "rq4", "--codec-profile", "{nolist}"], ["--codec-profile=", "field 'codecs'"]),
    (["--cold-codec", "rq4", "--codec-profile", "{noname}"], ["--codec-profile=", "codecs[1]", "field 'codec'"]),
    (["--cold-codec", "lz77", "--codec-profile", "{good}"],
     ["--cold-codec='lz77'", "not in the codec profile", "raw, bplane-zstd, rq4, rq3"]),
    (["--cold-codec", "rq4", "--codec-profile", "{zero}"], ["--codec-profile=", "p.json", "'rq4'", "field 'ratio'",
                                                            "> 0"]),
    (["--cold-codec", "rq4", "--codec-profile", "{negative}"], ["field 'ratio' is -1"]),
    (["--cold-codec", "rq4", "--codec-profile", "{nodecode}"], ["field 'decode_gbps' is None"]),
    (["--cold-codec", "rq4", "--codec-profile", "{textspeed}"], ["field 'encode_gbps' is 'fast'"]),
    (["--cold-codec", "rq4", "--codec-profile", "{good}", "--cold-codec-tiers", "ssd"],
     ["--cold-codec-tiers='ssd'", "--ssd-blocks"]),
    (["--cold-codec", "rq4", "--codec-profile", "{good}", "--workload", "rounds"], ["--cold-codec='rq4'", "rounds"]),
])
def test_bad_input_is_one_line_naming_the_flag_file_or_field(flags: list[str], says: list[str], tmp_path: Path,
                                                              capsys) -> None:
    rq4 = EXAMPLE["codecs"][2]
    bad = {"good": json.dumps(EXAMPLE), "notjson": "{codecs: [", "nolist": json.dumps({"codecs": {"rq4": {}}}),
           "noname": json.dumps({"codecs": [rq4, {"ratio": 2.0}]}),
           "zero": json.dumps({"codecs": [rq4 | {"ratio": 0}]}),
           "negative": json.dumps({"codecs": [rq4 | {"ratio": -1}]}),
           "nodecode": json.dumps({"codecs": [{k: v for k, v in rq4.items() if k != "decode_gbps"}]}),
           "textspeed": json.dumps({"codecs": [rq4 | {"encode_gbps": "fast"}]})}
    argv = ["replay", "--quiet", "--sessions", "1", "--policies", "lru-dram", "--no-references",
            "--json", str(tmp_path / "out.json")]
    for f in flags:
        argv.append(_write(tmp_path, bad[f[1:-1]]) if f.startswith("{") else f)
    rc, lines, err = cli_error(argv, capsys)
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("kvtier replay: error: "), lines[0]
    for needle in says:
        assert needle in lines[0], (needle, lines[0])
    assert not (tmp_path / "out.json").exists()


def test_the_library_refuses_bad_tiers_and_cores(profile_path: Path) -> None:
    with pytest.raises(ConfigError, match="--cold-codec-tiers"):
        cold_codec("rq4", profile_path, tiers=("hbm",))
    with pytest.raises(ConfigError, match="--codec-cores"):
        cold_codec("rq4", profile_path, cores=0)
