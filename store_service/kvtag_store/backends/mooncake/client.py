"""How kvtag reaches a Mooncake cluster: the client's interface, its settings, joining, the master's metrics.

Every other module of this package names the client only through `MooncakeClient`, so none of
them imports the backend (and the wheel is imported only when a client is really opened).
"""

from __future__ import annotations

import json
import socket
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvtag_store.backends.base import BackendUnavailable


class MooncakeClient(Protocol):
    """The part of mooncake.store.MooncakeDistributedStore kvtag uses (the wheel ships no stubs)."""

    def put_parts(self, key: str, *parts: Any) -> int: ...
    def put_batch(self, keys: list[str], values: list[Any]) -> int: ...
    def put(self, key: str, value: Any, config: Any = ...) -> int: ...
    def get(self, key: str) -> bytes: ...
    def get_batch(self, keys: list[str]) -> list[bytes]: ...
    def batch_get_replica_desc(self, keys: list[str]) -> dict[str, list[Any]]: ...
    def batch_is_exist(self, keys: list[str]) -> list[int]: ...
    def batch_remove(self, keys: list[str], force: bool = ...) -> list[int]: ...
    def batch_put_from_multi_buffers(
        self, keys: list[str], all_buffer_ptrs: list[list[int]], all_sizes: list[list[int]]
    ) -> list[int]: ...
    def batch_get_into_multi_buffers(
        self, keys: list[str], all_buffer_ptrs: list[list[int]], all_sizes: list[list[int]]
    ) -> list[int]: ...
    def register_buffer(self, buffer_ptr: int, size: int) -> int: ...
    def unregister_buffer(self, buffer_ptr: int) -> int: ...
    def get_into_ranges(
        self,
        buffer_ptrs: list[int],
        all_keys: list[list[str]],
        all_dst_offsets: list[list[list[int]]],
        all_src_offsets: list[list[list[int]]],
        all_sizes: list[list[list[int]]],
    ) -> list[list[list[int]]]: ...
    def close(self) -> int: ...


@dataclass(frozen=True, slots=True)
class MooncakeSettings:
    """Resolved connection settings (see mooncake.options for the flags that fill them)."""

    master: str
    metrics: str
    local_hostname: str = "127.0.0.1"
    protocol: str = "tcp"
    device_names: str = ""
    local_buffer_bytes: int = 64 << 20
    segment_bytes: int = 0
    lease_ttl_ms: int = 10_000
    # Where same-host clients map the staging arenas (the service's --shm-dir); None: inline only.
    shm_dir: str | None = None
    shm_staging_bytes: int = 256 << 20
    # tenant -> gid of its staging arena file (--shm-group), mode 0660 instead of 0600.
    shm_groups: Mapping[str, int] = field(default_factory=dict)


def connect(settings: MooncakeSettings) -> MooncakeClient:
    """Open a Mooncake client (P2P handshake metadata, never HTTP metadata)."""
    from mooncake.store import MooncakeDistributedStore

    _probe_master(settings.master)
    client = MooncakeDistributedStore()
    rc = client.setup(
        settings.local_hostname,
        "P2PHANDSHAKE",
        settings.segment_bytes,
        settings.local_buffer_bytes,
        settings.protocol,
        settings.device_names,
        settings.master,
    )
    if rc != 0:
        raise BackendUnavailable(
            f"cannot join the Mooncake cluster at master {settings.master} (setup returned {rc}); "
            "check that mooncake_master runs there and that this host can reach it"
        )
    return client  # type: ignore[no-any-return]


def pinned_config() -> Any:
    """How kvtag's own records are put (census records, mode-directory slots): never evicted (a
    forgotten record would let another mode win), and a second copy on another storage node
    survives the loss of one."""
    from mooncake.store import ReplicateConfig

    config = ReplicateConfig()
    config.with_hard_pin = True
    config.replica_num = 2
    return config


def _probe_master(master: str, timeout_s: float = 3.0) -> None:
    """Fail in milliseconds when nothing listens at the master address: Mooncake's setup would
    retry for about a minute and a half before giving up. An HA cluster is named by its etcd
    endpoints (`etcd://HOST:PORT[;HOST:PORT...]`, the masters elect their leader there): the first
    endpoint is probed."""
    if master.startswith("etcd://"):
        master = master.removeprefix("etcd://").split(";")[0].split(",")[0]
    host, _, port = master.rpartition(":")
    try:
        socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout=timeout_s).close()
    except (OSError, ValueError) as exc:
        raise BackendUnavailable(
            f"Mooncake master {master} unreachable ({exc}); "
            "start mooncake_master there or fix --mooncake-master"
        ) from exc


def read_master_metrics(address: str, timeout_s: float = 2.0) -> dict[str, float]:
    """Unlabelled samples of the master's Prometheus text endpoint (http://ADDRESS/metrics).

    `address` may name several masters' metrics endpoints, comma-separated (an HA cluster): the
    samples are the leader's, since a standby answers /metrics too, with zeros. The leader is the
    one whose /health says it leads and serves; the last one found is asked first.
    """
    addresses = metrics_addresses(address)
    if len(addresses) == 1:
        return _samples(addresses[0], timeout_s)
    return _samples(_leader(address, addresses, timeout_s), timeout_s)


def metrics_addresses(address: str) -> list[str]:
    """The HOST:PORT entries of a --mooncake-metrics value."""
    return [a.strip() for a in address.split(",") if a.strip()]


def probe_master_metrics(address: str, timeout_s: float = 2.0) -> None:
    """At start-up: at least one of the named metrics endpoints answers (a wrong --mooncake-metrics is
    a start-up error, not a surprise at the first scrape; one master of several may be down)."""
    failures: list[str] = []
    for one in metrics_addresses(address):
        try:
            _samples(one, timeout_s)
            return
        except BackendUnavailable as exc:
            failures.append(str(exc))
    raise BackendUnavailable("; ".join(failures) or "--mooncake-metrics names no address")


# --mooncake-metrics value -> the address that led when last asked.
_leaders: dict[str, str] = {}


def _leader(key: str, addresses: list[str], timeout_s: float) -> str:
    known = _leaders.get(key)
    ordered = ([known] if known else []) + [a for a in addresses if a != known]
    for one in ordered:
        if _leads(one, timeout_s):
            _leaders[key] = one
            return one
    raise BackendUnavailable(
        f"no Mooncake master among {', '.join(addresses)} leads and serves now (an election may be "
        "under way; retry in seconds); check --mooncake-metrics names every master"
    )


def _leads(address: str, timeout_s: float) -> bool:
    """The master's /health (JSON) says it is the leader and ready; a master without HA (no role
    field) counts as leading."""
    try:
        with urllib.request.urlopen(f"http://{address}/health", timeout=timeout_s) as response:
            health = json.loads(response.read().decode())
    except (OSError, ValueError):
        return False
    if not isinstance(health, dict):
        return False
    return health.get("role", "leader") == "leader" and health.get("service_ready", True) is True


def _samples(address: str, timeout_s: float) -> dict[str, float]:
    try:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=timeout_s) as response:
            text = response.read().decode()
    except OSError as exc:
        raise BackendUnavailable(
            f"Mooncake master metrics at {address} unreachable ({exc}); check --mooncake-metrics"
        ) from exc
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or "{" in line:
            continue
        name, _, number = line.partition(" ")
        try:
            samples[name] = float(number)
        except ValueError:
            continue
    return samples
