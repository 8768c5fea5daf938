"""Fault injection for the backpressure test: the kvtier connector with an SSD writer
``KVTIERTEST_SSD_SLOWDOWN`` times slower than this machine's (default 100).

Loaded by vLLM in the engine process through ``kv_connector_module_path``
(``tests/engine`` on ``PYTHONPATH``). Each SSD ``put_many`` of the worker is
timed and followed by a sleep of ``(slowdown - 1)`` times what it took; no
other behaviour changes.
"""

from __future__ import annotations

import os
import time
from typing import Any

from kvtier_vllm.connector import KVTierConnector


class SlowSSDConnector(KVTierConnector):
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        super().register_kv_caches(kv_caches)
        worker = self._worker
        assert worker is not None and worker._ssd is not None, "the backpressure test needs an SSD tier"
        factor = float(os.environ.get("KVTIERTEST_SSD_SLOWDOWN", "100"))
        put_many = worker._ssd.put_many

        def slow_put_many(items, **kwargs):
            start = time.perf_counter()
            try:
                return put_many(items, **kwargs)
            finally:
                time.sleep((factor - 1.0) * (time.perf_counter() - start))

        worker._ssd.put_many = slow_put_many
