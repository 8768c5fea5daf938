"""Fault injection for synchronous loads: the kvtier connector whose DRAM -> engine copies
all fail (the mover's ``fault_hook`` raises on the ``dram->hbm`` link), as a copy that
failed its checks would.

Loaded by vLLM in the engine process through ``kv_connector_module_path``
(``tests/engine`` on ``PYTHONPATH``). Nothing else changes: the blocks of a failed load
are reported as load errors and vLLM recomputes them.
"""

from __future__ import annotations

from typing import Any

from kvtier_vllm.connector import KVTierConnector


def _fail_loads(job: Any) -> None:
    if job is not None and job.link == "dram->hbm":
        raise RuntimeError("injected: the DRAM -> engine copy failed")


class FailingLoadConnector(KVTierConnector):
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        super().register_kv_caches(kv_caches)
        assert self._worker is not None
        self._worker.mover.fault_hook = _fail_loads
