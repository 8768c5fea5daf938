"""``kvtier replay --help`` is a short reference: under 120 lines, pointing to
docs/replay.md, where the long explanations live; no flag is left out of both."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvtier.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[1]
REPLAY_DOC = (ROOT / "docs" / "replay.md").read_text()


def _replay_help(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("COLUMNS", "80")  # argparse wraps to the terminal: pin an ordinary one
    with pytest.raises(SystemExit) as done:
        main(["replay", "--help"])
    assert done.value.code == 0
    return capsys.readouterr().out


def test_replay_help_is_short_and_points_to_the_docs(capsys, monkeypatch) -> None:
    text = _replay_help(capsys, monkeypatch)
    lines = text.splitlines()
    assert len(lines) < 120, f"kvtier replay --help prints {len(lines)} lines: move detail to docs/replay.md"
    assert "docs/replay.md" in text


def test_every_replay_flag_is_in_the_help_or_the_docs(capsys, monkeypatch) -> None:
    text = _replay_help(capsys, monkeypatch)
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    flags = [s for action in sub.choices["replay"]._actions for s in action.option_strings]
    assert len(flags) > 40, flags
    missing = [f for f in flags if f not in text and f not in REPLAY_DOC]
    assert not missing, f"flags in neither kvtier replay --help nor docs/replay.md: {missing}"
