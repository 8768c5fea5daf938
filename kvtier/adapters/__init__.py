"""Agent-framework adapters: a few lines in the user's code, and kvtier's hints flow.

* :mod:`kvtier.adapters.openai_agents` — run hooks for the OpenAI Agents SDK
  (``openai-agents``);
* :mod:`kvtier.adapters.langgraph` — a LangChain callback handler for LangGraph
  (``langgraph``, ``langchain-core``).

Install with ``pip install kvtier[agents]``. Each turns the framework's own
lifecycle callbacks (agent start and end, handoffs, tool start and end) into
the SDK's hint events (:class:`kvtier.sdk.HintClient`) and tags the agent's
model requests with the same session and agent ids
(``kv_transfer_params``), so the engine connector holds and orders each
agent's KV across its tool waits.

What both do alike (the session's events, its agents' and its own end, the
merge of ``kv_transfer_params`` into a request body) is
:mod:`kvtier.adapters._session`, which imports no framework.

Owns: the mapping from a framework's callbacks to hint events.
Must not: be imported by ``import kvtier`` (each module imports its framework),
change what the framework sends beyond ``kv_transfer_params``, or fail the
user's run (a hint that cannot be sent is dropped and counted by the client).
"""
