"""``kvtier analyze-trace``: sizes and infinite-cache hit rates under the definitions people compare."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.cli import main
from kvtier.replay.analysis import analyze
from kvtier.replay.model import Agent, Request, Session, Workload
from kvtier.replay.readers import load_trace

TRACES = Path(__file__).resolve().parents[1].parent / "shared" / "traces"
MOONCAKE = TRACES / "mooncake_fast25" / "conversation_trace.jsonl"


def _req(i: int, n_in: int, ids: tuple[int, ...], at: float, partial: int | None = None) -> Request:
    return Request(i, n_in, 1, ids, 0.0, "start", "", at, partial_block=partial)


def test_hit_rates_by_hand() -> None:
    # Block size 10. Sent in time order: a (t=0), c (t=1), b (t=2), whatever the session order.
    a = _req(0, 35, (1, 2, 3), 0.0, partial=9)   # nothing seen: 0 hits
    b = _req(0, 40, (1, 2, 7, 3), 2.0)          # leading run 1, 2 (3 is seen but after a miss)
    c = _req(0, 31, (1, 2, 3), 1.0, partial=9)  # 3 full hits; with the partial id 4 of 4 listed ids
    w = Workload("w", 10, tuple(Session(n, (Agent("root", None, "main", (r,)),), 0.0)
                                for n, r in (("a", a), ("b", b), ("c", c))), True)
    r = analyze(w)
    assert (r["requests"], r["sessions"], r["input_tokens"], r["distinct_blocks"]) == (3, 3, 106, 4)
    assert r["token_hit_rate"] == pytest.approx((30 + 20) / 106)
    assert r["block_hit_rate"] == pytest.approx(5 / 10)
    assert r["request_mean_hit_rate"] == pytest.approx((0 / 4 + 4 / 4 + 2 / 4) / 3)


def _aiperf_definition(path: Path) -> float:
    """aiperf analyze-trace's cache_hit_rate, written from its documented definition: per line, the leading
    run of hash_ids seen on earlier lines over all hash_ids listed, averaged over lines in file order."""
    seen: set[int] = set()
    rates = []
    for line in path.read_text().splitlines():
        ids = json.loads(line)["hash_ids"]
        if not ids:
            continue
        run = next((k for k, h in enumerate(ids) if h not in seen), len(ids))
        rates.append(run / len(ids))
        seen.update(ids)
    return sum(rates) / len(rates)


@pytest.mark.skipif(not MOONCAKE.exists(), reason=f"public traces not found under {TRACES}")
def test_mooncake_request_mean_matches_the_aiperf_definition(tmp_path: Path, capsys) -> None:
    # aiperf 0.13.0's `aiperf analyze-trace` prints 0.384 here (tests/test_interop_aiperf.py runs it).
    expected = _aiperf_definition(MOONCAKE)
    assert round(expected, 3) == 0.384
    out = tmp_path / "a.json"
    assert main(["analyze-trace", str(MOONCAKE), "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["request_mean_hit_rate"] == pytest.approx(expected, abs=1e-12)
    # kvtier's own figures count full blocks only (engines cache nothing else) and weigh by size.
    assert 0.36 < report["token_hit_rate"] < report["block_hit_rate"] < expected
    assert report["requests"] == 12031 and "request_mean_hit_rate  0.3843" in capsys.readouterr().out
    # Dropping the partial-block ids (re-blocking does) moves the aiperf-style mean below aiperf's.
    assert analyze(load_trace(MOONCAKE).reblock(1024))["request_mean_hit_rate"] < expected


def test_bad_path_is_one_line(tmp_path: Path, capsys) -> None:
    assert main(["analyze-trace", str(tmp_path / "missing.json")]) == 2
    assert "missing.json" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["analyze-trace", str(empty)]) == 2
