"""Observation for the remote-tier test: the kvtier connector, unchanged, except
that the name of every object its worker writes to the remote store is
appended to the file ``KVTIERTEST_REMOTE_NAMES`` (one per line). The test
alters those objects in the store to check that a damaged value is a miss.

Loaded by vLLM in the engine process through ``kv_connector_module_path``
(``tests/engine`` on ``PYTHONPATH``).
"""

from __future__ import annotations

import os
from typing import Any

from kvtier_vllm.connector import KVTierConnector


class RemoteNamesConnector(KVTierConnector):
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        super().register_kv_caches(kv_caches)
        worker = self._worker
        assert worker is not None and worker._remote is not None, "the remote test needs the remote tier"
        tier, path = worker._remote, os.environ["KVTIERTEST_REMOTE_NAMES"]
        put_many = tier.put_many

        def recorded_put_many(items, **kwargs):
            n = put_many(items, **kwargs)
            with open(path, "a") as f:
                f.writelines(tier.object_name(key) + "\n" for key, _, _ in items[:n])
            return n

        tier.put_many = recorded_put_many
