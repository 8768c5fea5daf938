"""Every flag of every command, given a bad value: exit status 2, one line on
stderr that names the flag, no traceback, and no output file left behind.

Values are generated from each flag's type (range-checked numbers, output
paths, choices); flags whose value is checked when the command starts
(paths, names) are listed in ``LATER``. A flag added with neither fails
``test_every_flag_has_a_bad_value_case``."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvtier import cliargs
from kvtier.cli import build_parser
from cli_support import cli_error

BAD_BY_TYPE = {
    cliargs.positive_int: ["0", "-3", "x"],
    cliargs.nonnegative_int: ["-1", "1.5"],
    cliargs.positive_float: ["0", "-1", "nan", "inf"],
    cliargs.nonnegative_float: ["-1", "nan"],
    cliargs.fraction: ["1.5", "-0.1"],
    cliargs.port: ["70000", "-1"],
    cliargs.writable_file: ["/nonexistent/dir/out.json"],
}

# flag -> (extra args, bad value, what the message says): values checked when the command runs
LATER: dict[tuple[str, str], tuple[list[str], str, str]] = {
    ("replay", "--trace"): ([], "/nonexistent/trace.json", "does not exist"),
    ("replay", "--profile"): ([], "tpu-v9:llama", "profile"),
    ("replay", "--profile-file"): ([], "/nonexistent/profile.yaml", "profile"),
    ("replay", "--policies"): ([], "lru,lru-2q", "unknown placement policy"),
    ("replay", "--admission"): ([], "sjf", "unknown admission order"),
    ("replay", "--surface"): ([], "sglang", "unknown engine surface"),
    ("replay", "--config"): ([], "/nonexistent/kvtier.yaml", "kvtier.yaml"),
    ("replay", "--cold-codec"): ([], "rq4", "--cold-codec"),  # no --codec-profile to find it in
    ("replay", "--codec-profile"): (["--cold-codec", "rq4"], "/nonexistent/codecs.json", "--codec-profile"),
    ("tune", "--trace"): ([], "/nonexistent/recording", "does not exist"),
    ("tune", "--policies"): ([], "kvtier,lru-2q", "unknown placement policy"),
    ("tune", "--knobs"): ([], "next_use_trust,speed", "unknown knob"),
    ("tune", "--holdout"): ([], "1.5", "--holdout"),
    ("tune", "--profile"): ([], "tpu-v9:llama", "profile"),
    ("bench", "--master"): (["remote", "--metadata-server", "http://127.0.0.1:9/metadata"], "127.0.0.1:9",
                            "tiers.remote.master"),
    ("bench", "--metadata-server"): (["remote"], "http://127.0.0.1:9/metadata", "--metadata-server"),
    ("bench", "--kv"): (["codecs"], "/nonexistent/kv.npz", "--kv"),
    ("route", "--engine"): (["--block-size", "16"], "a=foo", "--engine"),
    ("route", "--weight"): (["--engine", "a=tcp://127.0.0.1:9", "--block-size", "16"], "GPU=x", "--weight"),
    ("route", "--listen"): (["--engine", "a=tcp://127.0.0.1:9", "--block-size", "16"], "nonsense", "--listen"),
    ("serve", "--config"): ([], "/nonexistent/kvtier.yaml", "kvtier.yaml"),
    ("serve", "--token-file"): ([], "/nonexistent/tokens", "--token-file"),
    ("serve", "--tls-cert"): (["--tls-key", "/nonexistent/key.pem"], "/nonexistent/cert.pem", "--tls-cert"),
    ("serve", "--tls-key"): (["--tls-cert", "/nonexistent/cert.pem"], "/nonexistent/key.pem", "--tls-"),
    ("serve", "--record"): ([], "/etc/passwd", "--record"),
    ("serve", "--unix"): (["--listen", "127.0.0.1:0"], "/tmp/kvtier-test.sock", "--unix"),
    ("serve", "--metrics-host"): (["--metrics-port", "0"], "999.999.0.1", "999.999.0.1"),
    ("serve", "--token"): (["--listen", "0.0.0.0:0", "--token", ""], "", "token"),
}
NO_VALUE = {"--help", "--version"}


@pytest.fixture(scope="module")
def tune_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tune needs a trace to start: one generated AgentX trace file (a clone with
    nothing beside it has no real one)."""
    from kvtier.replay.generator import generate_coding_sessions, write_traces

    (path,) = write_traces(tmp_path_factory.mktemp("tune-trace"), generate_coding_sessions(1, seed=3))
    return path


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _flags() -> list[tuple[str, argparse.Action]]:
    out = []
    for name, p in _subparsers().items():
        for action in p._actions:
            if not action.option_strings or action.nargs == 0 or action.option_strings[0] in NO_VALUE:
                continue
            out.append((name, action))
    return out


def _cases() -> list[tuple[str, str, list[str], str, str]]:
    cases = []
    for command, action in _flags():
        flag = action.option_strings[-1]
        if (command, flag) in LATER:
            extra, value, says = LATER[(command, flag)]
            cases.append((command, flag, extra, value, says))
            continue
        if action.choices is not None:
            cases.append((command, flag, [], "bogus-choice", flag))
        kind = action.type
        if kind in BAD_BY_TYPE:
            cases += [(command, flag, [], v, flag) for v in BAD_BY_TYPE[kind]]
        elif getattr(kind, "__name__", "") == "list":
            cases += [(command, flag, [], v, flag) for v in ("0", "x", ",", "nan")]
        elif getattr(kind, "__name__", "") == "listen_address":
            cases += [(command, flag, [], v, flag) for v in ("nonsense", "127.0.0.1:99999", ":80")]
    return cases


def test_every_flag_has_a_bad_value_case() -> None:
    covered = {(c, f) for c, f, *_ in _cases()}
    missing = [(c, a.option_strings[-1]) for c, a in _flags() if (c, a.option_strings[-1]) not in covered]
    assert not missing, f"flags with no bad-value case (give them a checked type or a LATER entry): {missing}"


@pytest.mark.parametrize("command,flag,extra,value,says", _cases())
def test_a_bad_value_is_one_line_naming_the_flag(command: str, flag: str, extra: list[str], value: str, says: str,
                                                  tmp_path: Path, capsys, monkeypatch, tune_trace: Path) -> None:
    monkeypatch.chdir(tmp_path)
    argv = [command]
    if command == "inspect":
        argv.append(str(tmp_path))
    if command == "replay":
        argv += ["--quiet", "--sessions", "1", "--policies", "lru", "--no-references"]
    if command == "tune":
        argv += ["--quiet", "--trace", str(tune_trace), "--candidates", "1", "--rungs", "1"]
    argv += [*extra, f"{flag}={value}" if value.startswith("-") else flag, *([] if value.startswith("-") else [value])]
    if command == "replay" and flag not in ("--json", "--plot"):
        argv += ["--json", str(tmp_path / "out.json")]  # must not be written: the run must stop first
    if command == "tune" and flag not in ("--json", "--plot", "--out"):
        argv += ["--out", str(tmp_path / "out.yaml")]
    rc, lines, err = cli_error(argv, capsys)
    assert rc == 2, (argv, rc, err)
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"kvtier {command}: error: ") and says in lines[0], lines[0]
    assert not any(tmp_path.iterdir()), list(tmp_path.iterdir())  # no partial output
