"""Opens the kvtag session a connector role uses, for the namespace and mode it derived."""

from __future__ import annotations

import logging
from typing import Any

from kvtag.v1 import store_pb2 as pb

from .config import KvtagConfig

logger = logging.getLogger("kvtag.connector")


def open_client(
    config: KvtagConfig,
    *,
    engine_id: str,
    namespace: pb.NamespaceDescriptor,
    mode: pb.HashingMode,
    probe_keys: list[bytes],
    labels: dict[str, str],
) -> Any:
    """A StoreClient for this role. It never raises on an unreachable store: calls degrade to misses."""
    from kvtag_client.store import StoreClient

    client = StoreClient(
        config.endpoint,
        engine_id=engine_id,
        namespace=namespace,
        mode=mode,
        probe_keys=probe_keys,
        labels=labels,
        rpc_timeout_s=config.rpc_timeout_ms / 1000.0,
        reconnect_interval_s=config.reconnect_interval_ms / 1000.0,
    )
    client.open()
    logger.info(
        "kvtag %s: endpoint %s, state %s, mode lookahead=%d scheme=%s",
        engine_id,
        config.endpoint,
        getattr(client.state, "name", client.state),
        mode.lookahead_tokens,
        mode.key_scheme,
    )
    return client
