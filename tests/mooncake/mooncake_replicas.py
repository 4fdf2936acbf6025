"""Run real `kvtag-store serve --backend mooncake` processes and talk to them over gRPC."""

from __future__ import annotations

import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from kvtag.v1 import store_pb2 as pb
from kvtag.v1 import store_pb2_grpc

from tests.descriptors import PROBE
from tests.net import free_port

from .mooncake_cluster import MooncakeCluster, mooncake_env

KVTAG_STORE = Path(sys.prefix) / "bin" / "kvtag-store"


@dataclass
class Replica:
    """One kvtag-store process over the cluster, with a stub on its loopback port."""

    cluster: MooncakeCluster
    workdir: Path
    name: str
    extra_args: list[str] = field(default_factory=list)
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None
    channel: grpc.Channel | None = None
    stub: Any = None

    def start(self) -> None:
        log = open(self.workdir / f"{self.name}.log", "ab")  # noqa: SIM115 - owned by the process
        self.process = subprocess.Popen(
            [
                str(KVTAG_STORE),
                "serve",
                f"--listen=127.0.0.1:{self.port}",
                "--metrics-listen=",
                "--backend=mooncake",
                f"--mooncake-master={self.cluster.master_address}",
                f"--mooncake-metrics={self.cluster.metrics_flag}",
                "--mooncake-local-buffer=32MiB",
                f"--mooncake-lease-ttl-ms={self.cluster.lease_ttl_ms}",
                "--workers=4",
                *self.extra_args,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=mooncake_env(),
        )
        limit = 64 << 20
        self.channel = grpc.insecure_channel(
            f"127.0.0.1:{self.port}",
            options=[("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit)],
        )
        grpc.channel_ready_future(self.channel).result(timeout=20)
        self.stub = store_pb2_grpc.KvStoreStub(self.channel)  # type: ignore[no-untyped-call]

    def stop(self) -> None:
        if self.channel is not None:
            self.channel.close()
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def open(
        self, ns: pb.NamespaceDescriptor, hashing: pb.HashingMode, engine: str, probe: list[bytes] = PROBE
    ) -> pb.OpenSessionResponse:
        request = pb.OpenSessionRequest(engine_id=engine, namespace=ns, mode=hashing, probe_keys=probe)
        response: pb.OpenSessionResponse = self.stub.OpenSession(request, timeout=10)
        return response

    def put(self, session_id: str, *pairs: tuple[bytes, bytes]) -> list[int]:
        items = [pb.PutItem(block=pb.BlockRef(key=k), value=v) for k, v in pairs]
        response = self.stub.Put(pb.PutRequest(session_id=session_id, items=items), timeout=15)
        return [r.status for r in response.results]

    def lookup(self, session_id: str, *keys: bytes) -> pb.LookupResponse:
        blocks = [pb.BlockRef(key=k) for k in keys]
        response: pb.LookupResponse = self.stub.Lookup(
            pb.LookupRequest(session_id=session_id, blocks=blocks), timeout=15
        )
        return response

    def get(self, session_id: str, *keys: bytes) -> list[pb.GetResult]:
        blocks = [pb.BlockRef(key=k) for k in keys]
        response = self.stub.Get(pb.GetRequest(session_id=session_id, blocks=blocks), timeout=15)
        return list(response.results)
