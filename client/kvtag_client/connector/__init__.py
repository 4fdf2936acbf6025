"""kvtag's vLLM KV connector.

Use `kv_connector="KvtagConnector"` with `kv_connector_module_path="kvtag_client.connector"`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .connector import KvtagConnector

__all__ = ["KvtagConnector"]


def __getattr__(name: str) -> Any:
    """KvtagConnector on first use, so the plugin (run in every vLLM process) imports compat alone."""
    if name == "KvtagConnector":
        from .connector import KvtagConnector

        return KvtagConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
