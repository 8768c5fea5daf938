"""Fault suite plumbing: the figures every fault test reports, printed once at
the end of the run (faults injected and survived, bad inputs tried, blocks lost
or served wrong, RSS growth). Tests also assert their own figures; this only
aggregates them so CI logs show the totals."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # fault_support, the crash child
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # hints_support

from fault_support import FIGURES, NOTES


@pytest.fixture(scope="session")
def figures():
    """The suite-wide :data:`fault_support.FIGURES` counter."""
    return FIGURES


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    if not FIGURES and not NOTES:
        return
    tr = terminalreporter
    tr.section("kvtier fault suite figures")
    for name in ("faults_injected", "faults_survived", "bad_inputs_tried", "blocks_verified",
                 "blocks_lost", "blocks_served_wrong"):
        tr.write_line(f"{name:>22}: {FIGURES.get(name, 0)}")
    for name in sorted(set(FIGURES) - {"faults_injected", "faults_survived", "bad_inputs_tried", "blocks_verified",
                                       "blocks_lost", "blocks_served_wrong"}):
        tr.write_line(f"{name:>22}: {FIGURES[name]}")
    for line in NOTES:
        tr.write_line(line)
