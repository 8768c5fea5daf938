"""Coverage-guided fuzzing (atheris / libFuzzer) of every parser kvtier exposes to input.

Run one target: ``python tests/fuzz/atheris_targets.py TARGET -runs=N [-seed=S]``
(``tests/test_atheris.py`` runs each in CI). A target returns normally for any
input; an exception other than the parser's documented clean error is a
finding, which libFuzzer reports with the input that caused it (exit != 0).

* ``ssd_header``: the SSD value decoder (``decode_outcome``) on arbitrary
  bytes — never raises (that junk never verifies is a property test in
  ``tests/test_ssd.py``: libFuzzer's comparison tracing can legitimately
  build a valid value).
* ``config``: a YAML or TOML config file of arbitrary bytes — loads, or raises
  ``ConfigError`` (which names the file or setting).
* ``trace``: a trace file (``.json`` / ``.jsonl``) of arbitrary bytes —
  loads, or raises ``TraceError`` (naming the file).
* ``hints``: a ``PublishRequest`` decoded from arbitrary bytes and applied by
  the server's ``HintApplier`` — decodes or raises ``DecodeError``; applying
  never raises.
* ``kv_params``: a request's ``kv_transfer_params`` (JSON of arbitrary bytes, as
  vLLM's API server hands them on, NaN and Infinity included) checked and read
  as the connector does — never raises, a kvtier key is listed exactly when it
  reads as absent, and every value read is within its bounds.
* ``watch``: an ``AgentsView`` (the hint Watch stream's message) decoded from
  arbitrary bytes and made a snapshot as the connector's watcher does — decodes
  or raises ``DecodeError``; every criticality is in [0, 1] and every predicted
  return finite and within the longest tool wait.

Seeds are valid inputs of each parser, so mutations start from real structure.
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile

import atheris

if True:  # imports first; main() instruments every loaded kvtier function
    from google.protobuf.message import DecodeError

    from kvtier.config import load_config
    from kvtier.errors import ConfigError
    from kvtier.hints._gen import hints_pb2 as pb
    from kvtier.hints.apply import HintApplier
    from kvtier.keys import BlockKey, Namespace
    from kvtier.layout import KVLayout
    from kvtier.replay.readers import TraceError, load_trace
    from kvtier.sdk.params import MAX_TOOL_WAIT_S, VALIDATORS, check_request_params, read_param
    from kvtier.sdk.watch import snapshot_of
    from kvtier.tiers.codec import ValueContext, decode_outcome, encode

LAYOUT = KVLayout(1, 1, 64, "bfloat16", 2, arrangement="mla")  # 256-byte blocks
CTX = ValueContext.of(Namespace(model="fuzz", dtype="bfloat16", layout="mla", block_size=2), LAYOUT)
WORKDIR = tempfile.mkdtemp(prefix="kvtier-atheris-")


def ssd_header(data: bytes) -> None:
    decode_outcome(data, bytearray(LAYOUT.bytes_per_block), CTX, key=BlockKey(7))


def _fuzzed_file(data: bytes, stem: str, suffixes: tuple[str, str]) -> str:
    """Write the fuzzer's bytes to ``WORKDIR/stem`` + one of ``suffixes`` (its first
    byte picks which, so format detection is fuzzed too); returns the path."""
    fdp = atheris.FuzzedDataProvider(data)
    path = os.path.join(WORKDIR, stem + suffixes[fdp.ConsumeBool()])
    with open(path, "wb") as f:
        f.write(fdp.ConsumeBytes(fdp.remaining_bytes()))
    return path


def config(data: bytes) -> None:
    try:
        load_config(_fuzzed_file(data, "kvtier", (".yaml", ".toml")), env={})
    except ConfigError as err:
        assert str(err), "a ConfigError must say what is wrong"


def trace(data: bytes) -> None:
    try:
        load_trace(_fuzzed_file(data, "trace", (".json", ".jsonl")))
    except TraceError as err:
        assert str(err), "a TraceError must say what is wrong"


_APPLIER = HintApplier()


def hints(data: bytes) -> None:
    try:
        req = pb.PublishRequest.FromString(data)
    except DecodeError:
        return
    _APPLIER.apply("fuzz", req, skip_invalid=True, now_s=1.0, now_unix_us=1_700_000_000_000_000)
    _APPLIER.apply("fuzz", req, skip_invalid=False, now_s=2.0, now_unix_us=1_700_000_000_000_000)


def kv_params(data: bytes) -> None:
    try:
        params = json.loads(data.decode("utf-8", "surrogatepass"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return
    listed = {p.key for p in check_request_params(params)}
    if not isinstance(params, dict):
        return
    for key in VALIDATORS:
        value = read_param(params, key)
        if key in params and key not in ("kvtier_round_id", "kvtier_shared_tokens"):
            assert (value is None) == (key in listed), (key, params[key])
        if isinstance(value, float):
            assert math.isfinite(value) and abs(value) <= MAX_TOOL_WAIT_S, (key, value)


def watch(data: bytes) -> None:
    try:
        view = pb.AgentsView.FromString(data)
    except DecodeError:
        return
    snap = snapshot_of(view, 100.0)
    for state in snap.agents.values():
        assert 0.0 <= state.criticality <= 1.0, state
        assert state.returns_at_s is None or abs(state.returns_at_s - 100.0) <= MAX_TOOL_WAIT_S, state


def _seeds(target: str) -> list[bytes]:
    if target == "config":
        return [b"\x00tiers:\n  dram:\n    capacity_blocks: 4\n", b"\x01[tiers.dram]\ncapacity_blocks = 4\n"]
    if target == "trace":
        req = b'{"input_tokens": 64, "output_tokens": 8, "hash_ids": [1, 2], "timestamp": 0.5}'
        return [b"\x00[" + req + b"]", b"\x01" + req + b"\n" + req + b"\n"]
    if target == "hints":
        r = pb.PublishRequest(client_id="c")
        r.signals.add(event_id=1, session_start=pb.SessionStart(session_id="s"))
        r.signals.add(event_id=2, agent_spawn=pb.AgentSpawn(session_id="s", agent_id="a"))
        r.commands.add(event_id=3, pin=pb.PinCommand(session_id="s", block_keys=bytes(16), ttl_s=5.0))
        return [r.SerializeToString()]
    if target == "kv_params":
        return [b'{"kvtier_session_id": "s", "kvtier_agent_id": "a", "kvtier_tool_wait_s": 3.5}',
                b'{"kvtier_criticality": NaN, "kvtier_round_id": "r", "kvtier_shared_tokens": 64, "x": [1]}',
                b'{"kvtier_approximate_segments": [[0, 64], [128, 32]], "kvtier_tool_wait_s": Infinity}']
    if target == "watch":
        v = pb.AgentsView()
        v.agents.add(session_id="s", agent_id="a", criticality=0.5, tool_call_in_flight=True, has_prediction=True,
                     tool_returns_in_s=2.5)
        v.rounds.add(session_id="s", round_id="r", agent_ids=["a"])
        return [v.SerializeToString()]
    raw = bytes(range(256)) * (LAYOUT.bytes_per_block // 256)
    return [encode(raw, CTX, codec, key=BlockKey(7)) for codec in ("raw", "zstd", "bplane-zstd")]


TARGETS = {"ssd_header": ssd_header, "config": config, "trace": trace, "hints": hints, "kv_params": kv_params,
           "watch": watch}


def _instrument(obj: object) -> None:
    """Instrument a function, or every method of a class, for coverage."""
    if isinstance(obj, type):
        for attr in list(vars(obj).values()):
            fn = getattr(attr, "__func__", attr)
            if callable(fn) and hasattr(fn, "__code__"):
                atheris.instrument_func(fn)
    elif hasattr(obj, "__code__"):
        atheris.instrument_func(obj)


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in TARGETS:
        raise SystemExit(f"usage: {sys.argv[0]} {{{'|'.join(TARGETS)}}} [libFuzzer flags, e.g. -runs=N]")
    target = sys.argv[1]
    corpus = os.path.join(WORKDIR, f"seeds-{target}")
    os.makedirs(corpus, exist_ok=True)
    for i, seed in enumerate(_seeds(target)):
        with open(os.path.join(corpus, f"seed{i}"), "wb") as f:
            f.write(seed)
    for name, module in list(sys.modules.items()):  # coverage of kvtier's own code only
        if name == "kvtier" or name.startswith("kvtier."):
            for obj in list(vars(module).values()):
                if callable(obj) and getattr(obj, "__module__", None) == name:
                    _instrument(obj)
    atheris.Setup([sys.argv[0], *sys.argv[2:], corpus], TARGETS[target])
    atheris.Fuzz()


if __name__ == "__main__":
    main()
