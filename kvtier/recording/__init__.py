"""Recording served traffic as AgentX / Weka traces that ``kvtier replay`` and aiperf read.

Owns: the one place kvtier writes traces of live traffic, from either source
it sees, into the schema of ``../shared/traces/README.md``:

* :class:`~kvtier.recording.requests.RequestRecorder`: the requests an engine
  serves (the vLLM connector's ``record_path``): one trace per (session,
  agent), anonymous global block ids, written by a background thread;
* :class:`~kvtier.recording.hints.HintRecorder`: the hint events ``kvtier serve``
  applied (``--record``): one trace per session with its sub-agents nested,
  plus a side file of every event.

Both write through :mod:`~kvtier.recording.traces` (file names, atomic
replacement, stop reasons, token totals). Must not import an engine or grpc,
or block the caller: each recorder bounds what it holds and what it writes.
Nothing is imported eagerly.
"""
