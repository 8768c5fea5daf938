"""The soak of the real server, short: ``bench/soak_serve.py`` for 2.5 minutes.

``vllm serve`` with kvtier (DRAM, SSD and, where ``mooncake_master`` is installed,
Mooncake's remote tier), six concurrent agent sessions with tool waits, a tenth of the
requests aborted by the client, an eighth of the sessions abandoned. What must hold, from
the harness's own verdict and figures:

* after every drain the block pool's free blocks are back to their idle value and kvtier
  holds no block;
* every request is accounted for (each one not aborted finished in vLLM's counts, none
  failed, none still live in the connector, only aborted ones never reached the engine);
* every sampled output equals a plain engine's (no connector) for the same prompt;
* RSS is sampled throughout, and rises no faster than the warm-up's own rise (a short run
  only measures warm-up: see the last test; the long soak measures the slow leak).

The run behind the README's table and plot is the same command with ``--minutes 120``
(see docs/operations.md).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SHORT_RUN_SLOPE_LIMIT_MIB_PER_MIN = 120.0


@pytest.fixture(scope="module")
def soak(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("soak")
    out = tmp / "soak.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "soak_serve.py"), "--minutes", "2.5",
                           "--sample-s", "5", "--drain-s", "50", "--workdir", str(tmp / "work"),
                           "--json", str(out)], capture_output=True, text=True, timeout=900, check=False)
    assert out.exists(), f"the soak wrote no results (rc={proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}"
    return json.loads(out.read_text()), proc.stdout


def test_after_every_drain_the_pool_is_back_to_idle_and_nothing_is_held(soak) -> None:
    result, _ = soak
    idle = result["idle"]
    assert idle["free_blocks"] == result["hbm_blocks"] and idle["held_blocks"] == 0
    assert len(result["drains"]) >= 3
    for d in result["drains"]:
        assert (d["free_blocks"], d["held_blocks"]) == (idle["free_blocks"], 0), d


def test_every_request_is_accounted_for_and_none_failed(soak) -> None:
    result, _ = soak
    c = result["client"]
    assert c["sent"] > 200 and c["aborted_by_client"] > 5 and c["sessions_abandoned"] > 5, c
    assert c["failed"] == 0, result["client_errors"]
    assert result["live_requests_at_end"] == 0
    assert result["verdict"]["aborts_accounted"], (c, result["server_finished"], result["kvtier_counters"]["requests"])


def test_sampled_outputs_equal_a_plain_engines(soak) -> None:
    result, _ = soak
    assert result["outputs_checked"] >= 30
    assert result["outputs_differing"] == 0, result["mismatches"]


def test_rss_of_the_live_run_rises_no_faster_than_its_warm_up(soak) -> None:
    """The live run's RSS slope, fitted over its second half. A 2.5-minute run is all warm-up:
    the server's RSS rises for about five minutes (LMDB pages, the remote segment, allocator
    arenas filling; about 50 MiB a minute at this point of the 30-minute run), so this catches a
    gross leak, one that more than doubles that rise (a request's KV kept each time would), not a
    slow one. The slow one is the long soak's: ``bench/soak_serve.py --minutes 120`` states its
    rate per hour after the warm-up, and its TTFT at the end against after the warm-up
    (docs/operations.md)."""
    result, _ = soak
    samples = [(s["t_s"] / 60, s["rss_mib"]) for s in result["samples"]]
    assert all(rss > 0 for _, rss in samples) and len(samples) >= 20
    half = samples[len(samples) // 2:]
    mt, mr = sum(t for t, _ in half) / len(half), sum(r for _, r in half) / len(half)
    slope = sum((t - mt) * (r - mr) for t, r in half) / sum((t - mt) ** 2 for t, _ in half)
    assert slope < SHORT_RUN_SLOPE_LIMIT_MIB_PER_MIN, (slope, half)
