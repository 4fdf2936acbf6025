"""vLLM general plugin: registers KvtagConnector by name (`kv_connector="KvtagConnector"`, no module path)."""

from __future__ import annotations

CONNECTOR_NAME = "KvtagConnector"


def register() -> None:
    """Entry point `vllm.general_plugins: kvtag`; idempotent (vLLM loads plugins in every process)."""
    from kvtag_client.connector import compat

    compat.register_connector(CONNECTOR_NAME, "kvtag_client.connector", "KvtagConnector")
