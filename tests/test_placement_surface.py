"""The placement package stands alone, and the replay's engine surfaces do what
:mod:`kvtier.placement.surface` says (the ``vllm`` surfaces are checked against
the real engine in ``tests/engine/test_vllm_agents.py``)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvtier.errors import ConfigError
from kvtier.placement.surface import SURFACES, surface
from kvtier.replay.model import Agent, Request, Session, Workload
from kvtier.replay.profiles import DEFAULT_PROFILE, parse_profile
from kvtier.replay.sim import SimConfig, Simulator
from kvtier.placement import make_placement


def test_the_placement_package_imports_no_simulator_and_no_engine() -> None:
    code = ("import sys, kvtier.placement, kvtier.placement.agent, kvtier.placement.surface; "
            "bad = [m for m in sys.modules if m.startswith(('kvtier.replay', 'vllm', 'sglang', 'torch'))]; "
            "print(bad); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_an_unknown_surface_names_the_setting() -> None:
    assert surface("vllm") is SURFACES["vllm"] and surface("vllm-write-through") is SURFACES["vllm-write-through"]
    with pytest.raises(ConfigError, match="--surface='sglang': unknown engine surface; valid: full, vllm, vllm-write-through"):
        surface("sglang")


def _two_agents() -> Workload:
    """Agent a waits on a tool while b's long prompt needs most of HBM."""
    a = (Request(0, 4 * 64 + 5, 4, tuple(range(1, 5)), 0.0, "start", "tool_use", 0.0),
         Request(1, 6 * 64 + 5, 4, tuple(range(1, 7)), 30.0, "tool", "end_turn", 0.0))
    b = (Request(0, 5 * 64 + 5, 4, tuple(range(100, 105)), 0.0, "start", "tool_use", 0.0),
         Request(1, 9 * 64 + 5, 4, tuple(range(100, 109)), 5.0, "tool", "end_turn", 0.0))
    return Workload("w", 64, (Session("a", (Agent("root", None, "main", a),)),
                              Session("b", (Agent("root", None, "main", b),))), False)


@pytest.mark.parametrize("name", ["full", "vllm", "vllm-write-through"])
def test_every_policy_runs_on_every_surface(name: str) -> None:
    for policy in ("lru-dram", "ttl", "minwaste", "tokencake", "kvflow", "kvtier"):
        cfg = SimConfig(hbm_blocks=16, dram_blocks=8, ssd_blocks=32, conc=2, surface=name)
        result = Simulator(_two_agents(), cfg, make_placement(policy), parse_profile(DEFAULT_PROFILE)).run()
        assert len(result.records) == 4, (policy, name)


def test_the_vllm_surface_prefetches_into_dram_not_hbm() -> None:
    """With HBM and DRAM this small, part of the last agent's context is on SSD
    only when kvtier prefetches it back before the agent's predicted return. On
    the full surface it lands in HBM; on vLLM's, where a connector cannot fill
    HBM before a request exists, in DRAM, and the request loads it from there."""
    last = {}
    for name in ("full", "vllm-write-through"):
        cfg = SimConfig(hbm_blocks=12, dram_blocks=8, ssd_blocks=32, conc=2, surface=name)
        result = Simulator(_two_agents(), cfg, make_placement("kvtier"), parse_profile(DEFAULT_PROFILE)).run()
        assert result.counters["prefetch_on_time"] == 1, name
        rec = max(result.records, key=lambda r: r.finish_s)
        last[name] = (rec.hit_hbm_tokens, rec.hit_dram_tokens, rec.hit_ssd_tokens)
        if name == "vllm-write-through":
            assert result.counters["offloaded_blocks"] == 0 and result.counters["discarded_blocks"] == 0
    assert last == {"full": (256, 0, 0), "vllm-write-through": (128, 128, 0)}
