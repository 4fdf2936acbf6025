"""`kv_connector_extra_config` parsing: every key the connector reads, its default and its check."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

KEY_SCHEMES = ("canonical", "vllm")
# "kvtag": the bytes pass through the kvtag store. "MooncakeStoreConnector": the companion mode, vLLM's
# own connector moves them and kvtag keeps the modes apart (companion.py).
DATA_PATHS = ("kvtag", "MooncakeStoreConnector")
LOOKAHEAD_CHOICES = ("auto", "off")


class ConnectorConfigError(ValueError):
    """An extra_config value kvtag cannot use; the message names the key and the accepted values."""


@dataclass(frozen=True, slots=True)
class KvtagConfig:
    endpoint: str = "127.0.0.1:50051"
    key_scheme: str = "canonical"
    data_path: str = "kvtag"
    lookahead: str = "auto"
    audit: bool = False
    rpc_timeout_ms: int = 1000
    # How long the scheduler's step waits for a Lookup before it schedules other requests and asks
    # again next step (get_num_new_matched_tokens answers None meanwhile).
    lookup_wait_ms: int = 20
    reconnect_interval_ms: int = 2000
    lease_ms: int = 30000
    tenant: str = ""
    model_name: str = ""
    weights_fingerprint: str = ""
    engine_id: str = ""
    max_pending_save_bytes: int = 256 * 1024 * 1024
    save_batch_blocks: int = 64
    recompute_on_load_failure: bool = True
    # Security (docs/security.md): TLS files, and a file holding the bearer token ($KVTAG_TOKEN if unset).
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    token_file: str = ""


_FIELDS: dict[str, type] = {
    "endpoint": str,
    "key_scheme": str,
    "data_path": str,
    "lookahead": str,
    "audit": bool,
    "rpc_timeout_ms": int,
    "lookup_wait_ms": int,
    "reconnect_interval_ms": int,
    "lease_ms": int,
    "tenant": str,
    "model_name": str,
    "weights_fingerprint": str,
    "engine_id": str,
    "max_pending_save_bytes": int,
    "save_batch_blocks": int,
    "recompute_on_load_failure": bool,
    "tls_ca": str,
    "tls_cert": str,
    "tls_key": str,
    "token_file": str,
}


def _coerce(key: str, value: Any, kind: type) -> Any:
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConnectorConfigError(f"kv_connector_extra_config[{key!r}] must be a boolean, got {value!r}")
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int | str):
            raise ConnectorConfigError(
                f"kv_connector_extra_config[{key!r}] must be an integer, got {value!r}"
            )
        try:
            number = int(value)
        except ValueError as exc:
            raise ConnectorConfigError(
                f"kv_connector_extra_config[{key!r}] must be an integer, got {value!r}"
            ) from exc
        if number < 0:
            raise ConnectorConfigError(f"kv_connector_extra_config[{key!r}] must be >= 0, got {number}")
        return number
    if not isinstance(value, str):
        raise ConnectorConfigError(f"kv_connector_extra_config[{key!r}] must be a string, got {value!r}")
    return value


def parse(extra: Mapping[str, Any] | None) -> KvtagConfig:
    """Read kvtag's keys from extra_config; unknown keys are ignored (MultiConnector shares the dict)."""
    values: dict[str, Any] = {}
    for key, kind in _FIELDS.items():
        if extra is not None and key in extra and extra[key] is not None:
            values[key] = _coerce(key, extra[key], kind)
    config = KvtagConfig(**values)
    if config.key_scheme not in KEY_SCHEMES:
        raise ConnectorConfigError(
            f"kv_connector_extra_config['key_scheme'] must be one of {KEY_SCHEMES}, got {config.key_scheme!r}"
        )
    if config.data_path not in DATA_PATHS:
        raise ConnectorConfigError(
            f"kv_connector_extra_config['data_path'] must be one of {DATA_PATHS}, got {config.data_path!r}"
        )
    if config.lookahead not in LOOKAHEAD_CHOICES:
        raise ConnectorConfigError(
            f"kv_connector_extra_config['lookahead'] must be one of {LOOKAHEAD_CHOICES}, "
            f"got {config.lookahead!r}"
        )
    if config.rpc_timeout_ms == 0:
        raise ConnectorConfigError("kv_connector_extra_config['rpc_timeout_ms'] must be > 0")
    if not config.endpoint:
        raise ConnectorConfigError("kv_connector_extra_config['endpoint'] must be host:port, got ''")
    if bool(config.tls_cert) != bool(config.tls_key):
        raise ConnectorConfigError(
            "kv_connector_extra_config['tls_cert'] and ['tls_key'] go together (a client certificate "
            "and its key, for a store that requires mutual TLS)"
        )
    return config
