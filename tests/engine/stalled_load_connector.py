"""Fault injection for load deadlines: the kvtier connector whose loads from the SSD stall
(the mover's ``fault_hook`` sleeps ``KVTIERTEST_LOAD_STALL_S`` seconds, default 10, on the
``ssd->hbm`` link before the load reads anything), as a hung disk or a remote get that
does not return would.

Loaded by vLLM in the engine process through ``kv_connector_module_path``
(``tests/engine`` on ``PYTHONPATH``). Nothing else changes: with ``load_deadline_s``
shorter than the stall, the load is reported failed at its deadline and vLLM recomputes
its blocks.
"""

from __future__ import annotations

import os
import time
from typing import Any

from kvtier_vllm.connector import KVTierConnector


def _stall_ssd_loads(job: Any) -> None:
    if job is not None and job.link == "ssd->hbm":
        time.sleep(float(os.environ.get("KVTIERTEST_LOAD_STALL_S", "10")))


class StalledLoadConnector(KVTierConnector):
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        super().register_kv_caches(kv_caches)
        assert self._worker is not None
        self._worker.mover.fault_hook = _stall_ssd_loads
