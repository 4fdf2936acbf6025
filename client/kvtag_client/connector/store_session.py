"""Opens the kvtag session a connector role uses, for the namespace and mode it derived, and closes
it at interpreter exit if the connector was never shut down."""

from __future__ import annotations

import atexit
import logging
import os
import weakref
from typing import TYPE_CHECKING, Any

from kvtag.v1 import store_pb2 as pb

from .config import ConnectorConfigError, KvtagConfig

if TYPE_CHECKING:
    from kvtag_client.store import StoreClient

logger = logging.getLogger("kvtag.connector")


def open_client(
    config: KvtagConfig,
    *,
    engine_id: str,
    namespace: pb.NamespaceDescriptor,
    mode: pb.HashingMode,
    probe_keys: list[bytes],
    labels: dict[str, str],
    moves_bytes: bool = True,
) -> StoreClient:
    """A StoreClient for this role. It never raises on an unreachable store or a refused token: calls
    degrade to misses. A TLS or token file that cannot be read is a configuration error.
    `moves_bytes` False (the companion): control calls only, so the store's shared-memory arena is
    neither offered nor mapped, and an outage leaves the peer's data path serving."""
    from kvtag_proto.channels import ChannelConfigError, ChannelSecurity

    from kvtag_client.store import StoreClient

    security = ChannelSecurity(
        tls_ca=config.tls_ca, tls_cert=config.tls_cert, tls_key=config.tls_key, token_file=config.token_file
    )
    try:
        client = StoreClient(
            config.endpoint,
            engine_id=engine_id,
            namespace=namespace,
            mode=mode,
            probe_keys=probe_keys,
            labels=labels,
            rpc_timeout_s=config.rpc_timeout_ms / 1000.0,
            reconnect_interval_s=config.reconnect_interval_ms / 1000.0,
            security=security,
            data_path="auto" if moves_bytes else "inline",
        )
    except ChannelConfigError as exc:
        raise ConnectorConfigError(f"kv_connector_extra_config: {exc}") from None
    if not moves_bytes:
        client.session.outage_effect = (
            "the peer keeps loading and saving under this mode's prefix, and usage counts wait"
        )
    _track(client)
    client.open()
    logger.info(
        "kvtag %s: endpoint %s (%s), state %s, mode lookahead=%d scheme=%s",
        engine_id,
        config.endpoint,
        "TLS" if security.tls else "plaintext",
        client.state.name,
        mode.lookahead_tokens,
        mode.key_scheme,
    )
    return client


def recompute_failed_loads(config: KvtagConfig, kv_transfer_config: Any) -> None:
    """A block that cannot be loaded is a cache miss, not a failed request: vLLM's policy becomes
    'recompute' (unless recompute_on_load_failure is off). The scheduler reads it right after
    constructing its connector, on either data path."""
    if config.recompute_on_load_failure and kv_transfer_config.kv_load_failure_policy == "fail":
        kv_transfer_config.kv_load_failure_policy = "recompute"
        logger.info(
            "kvtag: kv_load_failure_policy set to 'recompute' (blocks that fail to load are recomputed)"
        )


# ---- ending sessions with the process -------------------------------------------------------------


_clients: weakref.WeakSet[StoreClient] = weakref.WeakSet()
_hooks_pid = 0  # the process whose exit hook is installed; a forked child installs its own


def _track(client: StoreClient) -> None:
    """Close `client` at interpreter exit if nothing closed it before (a connector's shutdown())."""
    global _hooks_pid, _clients
    if _hooks_pid != os.getpid():
        _hooks_pid = os.getpid()
        _clients = weakref.WeakSet()  # a forked child must not close its parent's sessions
        atexit.register(end_sessions)
    _clients.add(client)


def end_sessions() -> None:
    """Close every store client this process opened and has not closed yet."""
    for client in list(_clients) if _hooks_pid == os.getpid() else []:
        try:
            client.close()
        except Exception:  # ending sessions is best effort: the store's TTL is the fallback
            logger.debug("kvtag: closing a store session at exit failed", exc_info=True)
