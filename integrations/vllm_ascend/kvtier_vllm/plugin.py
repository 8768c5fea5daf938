"""The ``vllm.general_plugins`` entry point: registers the connector name ``kvtier``.

Owns: :func:`register`, which vLLM calls in every process it starts (it
must be idempotent and cheap: it registers a lazy loader, it does not import
the connector). Must not fail an engine that does not use kvtier: a vLLM
outside the tested range only gets a warning here; selecting the connector
then fails with the version message.
"""

from __future__ import annotations

import logging

CONNECTOR_NAME = "kvtier"
CONNECTOR_MODULE = "kvtier_vllm.connector"
CONNECTOR_CLASS = "KVTierConnector"

log = logging.getLogger(__name__)


def register() -> None:
    """Register ``kvtier`` with vLLM's ``KVConnectorFactory`` (once per process), and
    ``KVTierConnector`` too: ``MultiConnector`` reports a child's stats under its
    class name, and vLLM's stats logger looks that name up in the registry."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from .version import check_vllm_version

    try:
        check_vllm_version()
    except RuntimeError as exc:
        log.warning("%s", exc)
    for name in (CONNECTOR_NAME, CONNECTOR_CLASS):
        if name not in KVConnectorFactory._registry:
            KVConnectorFactory.register_connector(name, CONNECTOR_MODULE, CONNECTOR_CLASS)
