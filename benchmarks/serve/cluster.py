"""The benchmark's stores: one Mooncake cluster (master + a storage process) shared by kvtag's Mooncake
backend and vLLM's MooncakeStoreConnector, and kvtag-store processes over memory or that cluster.

Mooncake's transfer engine listens on every interface, so everything here refuses to start outside a
private network namespace where loopback is the only interface (`bench_serve.py` re-executes itself
under `unshare -n`). The binaries are the service environment's (.venv): the service never runs in
the vLLM environment.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from tests.net import free_port
from tests.store_process import REPO, StoreProcess

SERVICE_BIN = REPO / ".venv" / "bin"
LEASE_TTL_MS = 30000


def in_private_netns() -> bool:
    return [name for _, name in socket.if_nameindex()] == ["lo"]


def _wait(check: object, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not ready after {timeout_s} s")
        time.sleep(0.2)


def _master_metrics(address: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=2).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, _, value = line.partition(" ")
            try:
                out[name] = float(value)
            except ValueError:
                continue
    return out


@dataclass
class Cluster:
    """mooncake_master and one mooncake_client storage process contributing `segment_bytes`."""

    workdir: Path
    segment_bytes: int
    master_port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def master(self) -> str:
        return f"127.0.0.1:{self.master_port}"

    @property
    def metrics(self) -> str:
        return f"127.0.0.1:{self.metrics_port}"

    def _spawn(self, name: str, *args: str) -> None:
        log = open(self.workdir / f"{name}.log", "ab")  # noqa: SIM115 - owned by the process
        env = {**os.environ, "GLOG_minloglevel": "2"}
        self.procs.append(subprocess.Popen([str(SERVICE_BIN / name), *args], stdout=log, stderr=log, env=env))

    def capacity(self) -> int:
        try:
            return int(_master_metrics(self.metrics).get("master_total_capacity_bytes", 0))
        except OSError:
            return 0

    def start(self) -> Cluster:
        if not in_private_netns():
            raise RuntimeError("Mooncake listens on all interfaces: run inside `unshare -n` with lo up")
        self._spawn(
            "mooncake_master",
            "--rpc_address=127.0.0.1",
            f"--rpc_port={self.master_port}",
            "--metrics_host=127.0.0.1",
            f"--metrics_port={self.metrics_port}",
            # A read lease outlives a load on a starved machine (at 10 s the peer's loads expired mid-read).
            f"--default_kv_lease_ttl={LEASE_TTL_MS}",
            # A storage node is dropped (with every object it holds) after this long without a heartbeat;
            # on a starved 2-core machine 10 s was missed once and both Mooncake systems lost their blocks.
            "--client_ttl=60",
        )
        _wait(lambda: self.capacity() == 0 and _healthy(self.metrics), 30, "mooncake_master")
        self._spawn(
            "mooncake_client",
            "--host=127.0.0.1",
            "--metadata_server=P2PHANDSHAKE",
            f"--master_server_address={self.master}",
            f"--global_segment_size={self.segment_bytes}",
            "--protocol=tcp",
            f"--port={free_port()}",
        )
        _wait(lambda: self.capacity() >= self.segment_bytes, 60, "the storage segment")
        return self

    def peer_config(self, path: Path) -> Path:
        """MOONCAKE_CONFIG_PATH for vLLM's MooncakeStoreConnector: a pure client of this cluster
        (`standalone-store`: the storage process owns the pool), TCP, P2P handshake metadata."""
        path.write_text(
            json.dumps(
                {
                    "metadata_server": "P2PHANDSHAKE",
                    "master_server_address": self.master,
                    "protocol": "tcp",
                    "device_name": "",
                    "mode": "standalone-store",
                    "global_segment_size": 0,
                    "local_buffer_size": 256 << 20,
                }
            )
        )
        return path

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.kill()
            proc.wait(10)
        self.procs.clear()


def _healthy(address: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{address}/health", timeout=1) as answer:
            return bool(answer.status == 200)
    except OSError:
        return False


def memory_store(workdir: Path, name: str, metrics: str, capacity: int, *args: str) -> StoreProcess:
    """kvtag's default store (`make run`), sized to the run: a store touches its whole capacity at
    start, so more would only take memory from the engines."""
    return StoreProcess(
        workdir / f"{name}.log",
        "--capacity",
        str(capacity),
        f"--metrics-listen={metrics}",
        *args,
        process_group=True,
    )


def mooncake_store(workdir: Path, name: str, metrics: str, cluster: Cluster, *args: str) -> StoreProcess:
    """kvtag-store over the cluster (docs/mooncake.md's flags)."""
    return StoreProcess(
        workdir / f"{name}.log",
        f"--metrics-listen={metrics}",
        "--backend=mooncake",
        f"--mooncake-master={cluster.master}",
        f"--mooncake-metrics={cluster.metrics}",
        "--mooncake-local-buffer=256MiB",
        f"--mooncake-lease-ttl-ms={LEASE_TTL_MS}",
        *args,
        process_group=True,
    )


def rpc_seconds(metrics: str) -> dict[str, list[float]]:
    """The store's server-side time per RPC method: [calls, seconds] from kvtag_rpc_duration_seconds."""
    text = urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10).read().decode()
    out: dict[str, list[float]] = {}
    for line in text.splitlines():
        for suffix, index in (("_count", 0), ("_sum", 1)):
            head = "kvtag_rpc_duration_seconds" + suffix + "{"
            if line.startswith(head):
                method = line[len(head) :].split('method="', 1)[1].split('"', 1)[0]
                out.setdefault(method, [0.0, 0.0])[index] += float(line.rsplit(" ", 1)[1])
    return out
