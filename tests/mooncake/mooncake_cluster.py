"""Start and stop a real Mooncake cluster (master + storage process) for tests and the benchmark.

Only inside a private network namespace: Mooncake's transfer engine listens on
every interface and cannot be told otherwise, so `require_private_netns`
refuses to start anything where more than loopback exists.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from kvtag_store.backends.mooncake.client import MooncakeSettings

from tests.net import free_port, wait_until

BIN = Path(sys.prefix) / "bin"


def in_private_netns() -> bool:
    """True when loopback is the only interface of this process's network namespace."""
    return [name for _, name in socket.if_nameindex()] == ["lo"]


def require_private_netns() -> None:
    if not in_private_netns():
        raise RuntimeError(
            "Mooncake processes listen on all interfaces; run inside `unshare -n` with `ip link set lo up` "
            "(scripts/test_mooncake.sh does)"
        )


def metrics(address: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=2).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, _, value = line.partition(" ")
            with contextlib.suppress(ValueError):
                out[name] = float(value)
    return out


@dataclass
class MooncakeCluster:
    """One master and any number of storage processes, each a real Mooncake binary."""

    workdir: Path
    lease_ttl_ms: int = 2000
    master_port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    master: subprocess.Popen[bytes] | None = None
    storage: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def master_address(self) -> str:
        return f"127.0.0.1:{self.master_port}"

    @property
    def metrics_address(self) -> str:
        return f"127.0.0.1:{self.metrics_port}"

    @property
    def metrics_flag(self) -> str:
        """What a kvtag replica's --mooncake-metrics names (every master's, for an HA cluster)."""
        return self.metrics_address

    def start_master(self) -> None:
        require_private_netns()
        log = open(self.workdir / "master.log", "ab")  # noqa: SIM115 - owned by the process
        self.master = subprocess.Popen(
            [
                str(BIN / "mooncake_master"),
                "--rpc_address=127.0.0.1",
                f"--rpc_port={self.master_port}",
                "--metrics_host=127.0.0.1",
                f"--metrics_port={self.metrics_port}",
                f"--default_kv_lease_ttl={self.lease_ttl_ms}",
                "--client_ttl=3",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        wait_until(self._healthy, 15, "mooncake_master /health")

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.metrics_address}/health", timeout=1) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    def capacity(self) -> int:
        return int(metrics(self.metrics_address).get("master_total_capacity_bytes", 0))

    def start_storage(
        self, segment_bytes: int = 64 << 20, attempts: int = 3, mount_timeout_s: float = 15
    ) -> subprocess.Popen[bytes]:
        """A storage process (Mooncake's standalone client) contributing one segment.

        About one start in 25 the process never mounts its segment and its log loops on "Client
        not available"; such a process is killed and a new one started on a fresh port.
        """
        require_private_netns()
        before = self.capacity()
        for attempt in range(1, attempts + 1):
            log_path = self.workdir / f"storage{len(self.storage)}.log"
            log = open(log_path, "ab")  # noqa: SIM115 - owned by the process
            proc = subprocess.Popen(
                [
                    str(BIN / "mooncake_client"),
                    "--host=127.0.0.1",
                    "--metadata_server=P2PHANDSHAKE",
                    f"--master_server_address={self.master_address}",
                    f"--global_segment_size={segment_bytes}",
                    "--protocol=tcp",
                    f"--port={free_port()}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
            try:
                wait_until(
                    lambda: self.capacity() >= before + segment_bytes,
                    mount_timeout_s,
                    "the storage segment to mount",
                )
            except AssertionError:  # wait_until's timeout
                proc.kill()
                proc.wait(5)
                print(
                    f"storage node never mounted (attempt {attempt}, log {log_path}); retrying",
                    file=sys.stderr,
                )
                if attempt == attempts:
                    raise
                continue
            self.storage.append(proc)
            return proc
        raise AssertionError("unreachable")

    def kill_storage(self) -> None:
        for proc in self.storage:
            proc.kill()
            proc.wait(5)
        self.storage.clear()

    def kill_master(self) -> None:
        if self.master is not None:
            self.master.kill()
            self.master.wait(5)
            self.master = None

    def stop(self) -> None:
        self.kill_storage()
        self.kill_master()


def mooncake_env() -> dict[str, str]:
    """Environment for child processes: quiet Mooncake logs."""
    env = dict(os.environ)
    env.setdefault("GLOG_minloglevel", "2")
    return env


def settings_for(c: MooncakeCluster, local_buffer: int = 32 << 20) -> MooncakeSettings:
    """Client settings for a kvtag backend over this cluster."""
    return MooncakeSettings(
        master=c.master_address,
        metrics=c.metrics_address,
        local_buffer_bytes=local_buffer,
        lease_ttl_ms=c.lease_ttl_ms,
    )
