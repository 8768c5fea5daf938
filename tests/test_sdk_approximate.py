"""``approximate_segments``: how an agent framework asks the connector for approximate reuse
of shared segments, and how the connector reads it back (malformed: no approximation)."""

from __future__ import annotations

import pytest

from kvtier.sdk.handles import (
    APPROXIMATE_SEGMENTS_PARAM,
    MAX_APPROXIMATE_SPANS,
    approximate_segments,
    is_approximate_salt,
    request_approximate_segments,
    tag_request,
)


def test_spans_and_the_salt_go_into_the_request_and_come_back() -> None:
    body = tag_request({"model": "m", "prompt": "x"}, "s1", "a1")
    out = approximate_segments(body, [(64, 128), (256, 32)], cache_salt="round-3")
    assert out["cache_salt"] == "round-3\x1fkvtier-approximate" and is_approximate_salt(out["cache_salt"])
    assert out["kv_transfer_params"]["kvtier_session_id"] == "s1"  # earlier params kept
    assert request_approximate_segments(out["kv_transfer_params"]) == [(64, 128), (256, 32)]
    assert "cache_salt" not in body and APPROXIMATE_SEGMENTS_PARAM not in body["kv_transfer_params"]  # not modified
    # no spans: an approximate-mode request (keyed with the others) that declares no segment
    assert request_approximate_segments(approximate_segments({}, [])["kv_transfer_params"]) == []


@pytest.mark.parametrize("spans", [[(-1, 4)], [(0, 0)], [(True, 4)], [(0.5, 4)]])
def test_bad_spans_are_refused(spans: list) -> None:
    with pytest.raises(ValueError, match="approximate_segments: span"):
        approximate_segments({}, spans)


def test_an_empty_salt_is_refused() -> None:
    with pytest.raises(ValueError, match="cache_salt"):
        approximate_segments({}, [(0, 32)], cache_salt="")


def test_a_tenants_salt_is_kept_and_marked() -> None:
    """The body's own salt (a tenant's) stays in front of the marker: tenants stay apart."""
    out = approximate_segments({"cache_salt": "tenant-a"}, [(0, 32)])
    assert out["cache_salt"] == "tenant-a\x1fkvtier-approximate"
    assert approximate_segments(out, [(0, 32)])["cache_salt"] == out["cache_salt"]  # marked once
    assert approximate_segments({}, [])["cache_salt"] == "kvtier-approximate"
    assert not is_approximate_salt("tenant-a") and not is_approximate_salt(None)
    assert not is_approximate_salt("kvtier-approximate-not")


def test_too_many_spans_are_refused_both_ways() -> None:
    spans = [(32 * i, 32) for i in range(MAX_APPROXIMATE_SPANS + 1)]
    with pytest.raises(ValueError, match="at most"):
        approximate_segments({}, spans)
    assert request_approximate_segments({APPROXIMATE_SEGMENTS_PARAM: [list(s) for s in spans]}) is None


@pytest.mark.parametrize("params", [None, {}, {APPROXIMATE_SEGMENTS_PARAM: "0:32"},
                                    {APPROXIMATE_SEGMENTS_PARAM: [[0, 32, 1]]},
                                    {APPROXIMATE_SEGMENTS_PARAM: [[0, -32]]},
                                    {APPROXIMATE_SEGMENTS_PARAM: [[False, 32]]}])
def test_absent_or_malformed_params_ask_for_nothing(params) -> None:
    assert request_approximate_segments(params) is None
