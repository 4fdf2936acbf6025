"""CLI/environment options of the Mooncake backend, importable without Mooncake installed.

The serve command adds these flags unconditionally and calls `build` only for
`--backend mooncake`, so the import of the Mooncake wheel stays lazy.
Precedence, the service's one rule (kvtag_store.config): a flag, then its
KVTAG_MOONCAKE_* environment variable, then the JSON file named by
--mooncake-config (keys are the flag names without the `--mooncake-` prefix,
e.g. {"master": "10.0.0.5:50051", "local-buffer": "256MiB"}), then the default.
Sizes are read by config.parse_size (64MiB = 67,108,864 bytes, 64MB = 64,000,000).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

from kvtag_store.backends.base import BlockBackend, CensusStore
from kvtag_store.backends.mooncake.client import MooncakeSettings
from kvtag_store.config import env_name as _flag_env_name
from kvtag_store.config import format_size
from kvtag_store.config import parse_size as parse_size

# The defaults are MooncakeSettings' own, written there once; the flags only spell them.
_DEFAULT = MooncakeSettings(master="", metrics="")
# name -> (default, help). Names are the flag suffixes; env is KVTAG_MOONCAKE_<NAME upper, _>.
_OPTIONS: dict[str, tuple[str | None, str]] = {
    "master": (None, "Mooncake master RPC address HOST:PORT (required for --backend mooncake)"),
    "metrics": (
        None,
        "master metrics/health address HOST:PORT (default: the master host, port 9003); with HA "
        "masters, every master's, comma-separated: the leader's figures are read",
    ),
    "local-hostname": (
        _DEFAULT.local_hostname,
        "address this process's transfer engine advertises to the cluster",
    ),
    "protocol": (_DEFAULT.protocol, "transfer protocol: tcp or rdma"),
    "device-names": (_DEFAULT.device_names, "RDMA device names for --mooncake-protocol rdma"),
    "local-buffer": (
        format_size(_DEFAULT.local_buffer_bytes),
        "local transfer buffer; the largest block is a quarter of it",
    ),
    "segment-size": (
        format_size(_DEFAULT.segment_bytes),
        "memory this process contributes to the cluster (0: a pure client)",
    ),
    "lease-ttl-ms": (
        str(_DEFAULT.lease_ttl_ms),
        "the master's --default_kv_lease_ttl; pinned blocks are renewed every third",
    ),
    "shm-staging": (
        format_size(_DEFAULT.shm_staging_bytes),
        "per tenant, the shared-memory arena (in --shm-dir) same-host clients' values pass through "
        "on their way to and from Mooncake",
    ),
}


def env_name(option: str) -> str:
    """local-buffer -> KVTAG_MOONCAKE_LOCAL_BUFFER (the name config.env_name gives the flag)."""
    return _flag_env_name(f"--mooncake-{option}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the --mooncake-* flags (each also read from a KVTAG_MOONCAKE_* environment variable)."""
    group = parser.add_argument_group("mooncake backend")
    for option, (default, text) in _OPTIONS.items():
        shown = f" [default: {default}]" if default else ""
        group.add_argument(
            f"--mooncake-{option}", default=None, help=f"{text}; env {env_name(option)}{shown}"
        )
    group.add_argument(
        "--mooncake-config",
        default=None,
        help="JSON file of the options above (keys without the --mooncake- prefix); "
        f"env {env_name('config')}",
    )


def resolve(args: argparse.Namespace) -> dict[str, str]:
    """The effective option values, by the precedence in the module docstring."""
    config_path = getattr(args, "mooncake_config", None) or os.environ.get(env_name("config"))
    from_file: dict[str, Any] = {}
    if config_path:
        with open(config_path, encoding="utf-8") as handle:
            from_file = json.load(handle)
        unknown = set(from_file) - set(_OPTIONS)
        if unknown:
            raise ValueError(f"unknown keys in {config_path}: {sorted(unknown)}; known: {sorted(_OPTIONS)}")
    values: dict[str, str] = {}
    for option, (default, _) in _OPTIONS.items():
        value = getattr(args, "mooncake_" + option.replace("-", "_"), None)
        if value is None:
            value = os.environ.get(env_name(option))
        if value is None and option in from_file:
            value = str(from_file[option])
        if value is None:
            value = default
        if value is not None:
            values[option] = value
    return values


def settings_from(args: argparse.Namespace) -> MooncakeSettings:
    """MooncakeSettings from flags/env/file; raises ValueError naming what is missing or malformed."""
    values = resolve(args)
    master = values.get("master")
    if not master:
        raise ValueError(
            f"--backend mooncake needs --mooncake-master HOST:PORT (or {env_name('master')}, "
            'or "master" in --mooncake-config)'
        )
    metrics = values.get("metrics")
    if not metrics:
        if master.startswith("etcd://"):
            raise ValueError(
                "an HA Mooncake cluster (--mooncake-master etcd://...) needs --mooncake-metrics naming "
                "every master's metrics address, comma-separated (HOST:PORT,HOST:PORT): GetStats "
                "follows whichever leads"
            )
        metrics = f"{master.rpartition(':')[0] or master}:9003"
    return MooncakeSettings(
        master=master,
        metrics=metrics,
        local_hostname=values["local-hostname"],
        protocol=values["protocol"],
        device_names=values["device-names"],
        local_buffer_bytes=parse_size(values["local-buffer"]),
        segment_bytes=parse_size(values["segment-size"]),
        lease_ttl_ms=int(values["lease-ttl-ms"]),
        shm_dir=getattr(args, "shm_dir", None) or None,
        shm_staging_bytes=parse_size(values["shm-staging"]),
    )


def build(
    args: argparse.Namespace, shm_groups: Mapping[str, int] | None = None
) -> tuple[BlockBackend, CensusStore]:
    """Connect to the Mooncake cluster named by the flags; `shm_groups` (--shm-group) own the tenants'
    staging arena files."""
    from kvtag_store.backends.mooncake.backend import MooncakeBackend
    from kvtag_store.backends.mooncake.census import MooncakeCensus
    from kvtag_store.backends.mooncake.client import connect, probe_master_metrics

    settings = dataclasses.replace(settings_from(args), shm_groups=dict(shm_groups or {}))
    client = connect(settings)
    try:
        probe_master_metrics(settings.metrics)
    except Exception:
        client.close()
        raise
    backend = MooncakeBackend(client, settings)
    census = MooncakeCensus(client, backend.breaker)
    backend.close_first(census.close)
    return backend, census
