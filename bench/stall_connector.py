"""The kvtier connector with one switch, for ``bench/chaos_serve.py`` and the engine test's
stalled-load step: while the file named by ``CHAOS_STALL_SSD_READS_FILE`` exists, every read
from the SSD tier (a load into the engine, a copy up into DRAM) waits before it reads
anything, as on a disk that has hung, and goes on once the file is removed or after
``CHAOS_STALL_MAX_S`` seconds (default 120). Without the file it is the kvtier connector.

Loaded by the engine through ``kv_connector_module_path`` (``bench/`` on ``PYTHONPATH``).
Must not change anything else: the stall is the mover's ``fault_hook``, which runs on the
worker's ``ssd-read`` lane before the job.
"""

from __future__ import annotations

import os
import time
from typing import Any

from kvtier_vllm.connector import KVTierConnector

STALL_LINKS = ("ssd->hbm", "ssd->dram")
MAX_STALL_S = 120.0  # unless CHAOS_STALL_MAX_S says otherwise


def _stall_while_switched_on(job: Any) -> None:
    path = os.environ.get("CHAOS_STALL_SSD_READS_FILE")
    if not path or job is None or job.link not in STALL_LINKS:
        return
    end = time.monotonic() + float(os.environ.get("CHAOS_STALL_MAX_S", MAX_STALL_S))
    while os.path.exists(path) and time.monotonic() < end:
        time.sleep(0.05)


class StallSwitchConnector(KVTierConnector):
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        super().register_kv_caches(kv_caches)
        assert self._worker is not None
        self._worker.mover.fault_hook = _stall_while_switched_on
