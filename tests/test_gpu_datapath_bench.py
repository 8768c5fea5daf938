"""CPU smoke run of bench/gpu_datapath.py (issue 22): the accelerator data-path benchmark runs
without vLLM, moves blocks through the worker's own BlockIO calls, verifies every loaded byte and
reports its ratios against a pinned-copy baseline measured in the same run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_datapath.py"


def test_cpu_smoke_run(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--layers", "2", "--cache-blocks", "64",
                           "--blocks", "8", "--repeats", "1", "--matmul", "128", "--matmul-iters", "2",
                           "--json", str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["verified"] is True and r["device"] == "cpu"
    assert r["bytes_per_block"] == 2 * 2 * 16 * 8 * 128 * 2 and r["bytes_moved"] == 8 * r["bytes_per_block"]
    for key in ("store_vs_pinned", "load_vs_pinned", "kvtier_store_gibps", "pinned_load_gibps", "matmul_alone_s"):
        assert r[key] > 0, key
    assert r["targets"]["checked"] is False  # the targets are for an accelerator
    assert r["stream"] == "engine" and r["device_staging_bytes"] == 0  # the CPU has no streams, copies go straight
    assert "kvtier path" in proc.stdout and "slowdown" in proc.stdout
    bad = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--blocks", "40", "--cache-blocks", "64"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert bad.returncode != 0 and "--cache-blocks" in bad.stderr
    bad = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--device-staging-mib", "0"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert bad.returncode != 0 and "--device-staging-mib must be > 0" in bad.stderr
