"""A Mooncake cluster whose master runs in HA: etcd and two masters, the leader chosen through etcd.

Clients and storage nodes name the cluster by its etcd endpoint (`etcd://HOST:PORT`); with
`--enable_oplog` the masters replicate object metadata, so a new leader still knows the objects.
Like MooncakeCluster, only inside a private network namespace.
"""

from __future__ import annotations

import base64
import json
import shutil
import socket
import subprocess
import threading
import time
import urllib.request
from dataclasses import dataclass, field

from tests.mooncake.mooncake_cluster import BIN, MooncakeCluster, metrics, require_private_netns
from tests.net import free_port, wait_until


@dataclass
class HaMooncakeCluster(MooncakeCluster):
    """etcd, two HA masters (the first started leads) and storage processes."""

    etcd_port: int = field(default_factory=free_port)
    etcd: subprocess.Popen[bytes] | None = None
    masters: list[tuple[subprocess.Popen[bytes], int]] = field(
        default_factory=list
    )  # (process, metrics port)

    # Every master's metrics port, the killed ones included (a deployment's flag names them all).
    all_metrics_ports: list[int] = field(default_factory=list)
    # When (time.monotonic) the master left after kill_leader first said it leads and serves, and
    # when it first counted a storage segment (a storage node re-mounted: objects are readable).
    serving_at: float | None = None
    mounted_at: float | None = None

    @property
    def master_address(self) -> str:
        return f"etcd://127.0.0.1:{self.etcd_port}"

    @property
    def metrics_flag(self) -> str:
        return ",".join(f"127.0.0.1:{port}" for port in self.all_metrics_ports)

    def start_master(self) -> None:
        require_private_netns()
        etcd = shutil.which("etcd")
        assert etcd, "etcd is not installed (scripts/install_mooncake.sh installs etcd-server)"
        log = open(self.workdir / "etcd.log", "ab")  # noqa: SIM115 - owned by the process
        self.etcd = subprocess.Popen(
            [
                etcd,
                f"--data-dir={self.workdir / 'etcd-data'}",
                f"--listen-client-urls=http://127.0.0.1:{self.etcd_port}",
                f"--advertise-client-urls=http://127.0.0.1:{self.etcd_port}",
                f"--listen-peer-urls=http://127.0.0.1:{free_port()}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        wait_until(self._etcd_listening, 20, "etcd to listen")
        for n in range(2):
            metrics_port = self.metrics_port if n == 0 else free_port()
            log = open(self.workdir / f"master{n}.log", "ab")  # noqa: SIM115 - owned by the process
            proc = subprocess.Popen(
                [
                    str(BIN / "mooncake_master"),
                    "--enable_ha=true",
                    "--enable_oplog=true",
                    f"--etcd_endpoints=127.0.0.1:{self.etcd_port}",
                    "--rpc_address=127.0.0.1",
                    f"--rpc_port={self.master_port if n == 0 else free_port()}",
                    "--metrics_host=127.0.0.1",
                    f"--metrics_port={metrics_port}",
                    f"--default_kv_lease_ttl={self.lease_ttl_ms}",
                    "--client_ttl=3",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
            self.masters.append((proc, metrics_port))
            self.all_metrics_ports.append(metrics_port)
            if n == 0:
                # It leads once it has found no master view and no oplog in etcd (seconds). /health
                # answers before that, so wait for etcd to name it: a second master started earlier
                # could win the election, and the metrics read here would be a follower's.
                wait_until(self._healthy, 60, "the first HA mooncake_master /health")
                wait_until(self._first_leads, 60, "the first HA mooncake_master to lead")

    def _first_leads(self) -> bool:
        """etcd's master view names the first master's RPC port (etcd's v3 JSON gateway)."""
        key = base64.b64encode(b"mooncake-store/mooncake_cluster/master_view").decode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.etcd_port}/v3/kv/range", data=json.dumps({"key": key}).encode()
        )
        try:
            with urllib.request.urlopen(request, timeout=2) as reply:
                kvs = json.load(reply).get("kvs", [])
        except OSError:
            return False
        return any(f":{self.master_port}".encode() in base64.b64decode(kv.get("value", "")) for kv in kvs)

    def _etcd_listening(self) -> bool:
        try:
            socket.create_connection(("127.0.0.1", self.etcd_port), timeout=1).close()
        except OSError:
            return False
        return True

    def kill_leader(self) -> None:
        """Kill the first master (the leader) and point the metrics at the one left, which is then
        watched (every 20 ms, for up to 60 s) for `serving_at` and `mounted_at`: Mooncake's own
        share of a failover, apart from what kvtag adds."""
        proc, _ = self.masters.pop(0)
        proc.kill()
        proc.wait(5)
        self.metrics_port = self.masters[0][1]
        self.serving_at = self.mounted_at = None
        threading.Thread(target=self._watch_new_leader, args=(self.metrics_address,), daemon=True).start()

    def _watch_new_leader(self, address: str) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and self.masters and self.mounted_at is None:
            try:
                if self.serving_at is None:
                    with urllib.request.urlopen(f"http://{address}/health", timeout=1) as reply:
                        health = json.load(reply)
                    if health.get("role") == "leader" and health.get("service_ready") is True:
                        self.serving_at = time.monotonic()
                elif metrics(address).get("master_total_capacity_bytes", 0) > 0:
                    self.mounted_at = time.monotonic()
            except (OSError, ValueError):
                pass
            time.sleep(0.02)

    def stop(self) -> None:
        self.kill_storage()
        for proc, _ in self.masters:
            proc.kill()
            proc.wait(5)
        self.masters.clear()
        if self.etcd is not None:
            self.etcd.kill()
            self.etcd.wait(5)
            self.etcd = None
