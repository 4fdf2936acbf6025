"""kvtag's vLLM KV connector.

Use `kv_connector="KvtagConnector"` with `kv_connector_module_path="kvtag_client.connector"`.
"""

from .connector import KvtagConnector

__all__ = ["KvtagConnector"]
