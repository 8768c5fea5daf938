"""kvtier's KV connector for vLLM and vLLM-Ascend (``KVConnectorBase_V1``).

Select it with ``--kv-transfer-config '{"kv_connector": "kvtier", "kv_role": "kv_both"}'``
(the name is registered by the ``vllm.general_plugins`` entry point) or by module
path: ``{"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier_vllm.connector"}``.
See ``integrations/vllm_ascend/README.md``. Importing this package does not import vLLM.
"""

from .plugin import CONNECTOR_CLASS, CONNECTOR_MODULE, CONNECTOR_NAME
from .version import TESTED_RANGE, check_vllm_version

__all__ = ["CONNECTOR_CLASS", "CONNECTOR_MODULE", "CONNECTOR_NAME", "TESTED_RANGE", "check_vllm_version"]
