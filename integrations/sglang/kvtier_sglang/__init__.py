"""kvtier's SGLang integration: a HiCache storage backend for ``--hicache-storage-backend dynamic``.

``import kvtier_sglang`` imports sglang's ``HiCacheStorage`` base class when
sglang is installed (and falls back to a contract stand-in when it is not); it
imports nothing else from sglang. See ``integrations/sglang/README.md``.
"""

from .backend import EXTRA_CONFIG_KEYS, SGLANG_BASE_CLASS, KVTierHiCacheStorage

__all__ = ["EXTRA_CONFIG_KEYS", "SGLANG_BASE_CLASS", "KVTierHiCacheStorage"]
