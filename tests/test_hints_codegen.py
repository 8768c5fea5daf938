"""The checked-in gRPC stubs match the .proto, and the hint plane stays out of ``import kvtier``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.hints import codegen

ROOT = Path(__file__).resolve().parents[1]


def test_checked_in_stubs_are_fresh():
    pytest.importorskip("grpc_tools", reason="grpcio-tools is a test dependency (pyproject [test])")
    header = (codegen.default_out_dir() / "hints_pb2.py").read_text().splitlines()[0]
    assert f"grpcio-tools {codegen.tools_version()})" in header, (
        f"stubs were generated with another grpcio-tools ({header}); install the pinned version from "
        "pyproject's [test] extra or regenerate with `python -m kvtier.hints.codegen`")
    stale = codegen.stale_files()
    assert not stale, f"stale stubs {stale}: run `python -m kvtier.hints.codegen` after editing the .proto"


def test_generated_grpc_module_imports_inside_the_package():
    from kvtier.hints._gen import hints_pb2, hints_pb2_grpc

    assert hints_pb2_grpc.kvtier_dot_v1_dot_hints__pb2 is hints_pb2
    assert hints_pb2.DESCRIPTOR.name == codegen.PROTO_REL


def test_import_kvtier_does_not_import_grpc():
    code = ("import sys, kvtier, kvtier.agents, kvtier.cli; kvtier.cli.build_parser(); "
            "bad = [m for m in ('grpc', 'google.protobuf', 'torch', 'prometheus_client') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
