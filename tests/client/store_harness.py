"""Test harness: a real `kvtag-store serve` subprocess that tests can kill, pause and restart."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import grpc
from kvtag.v1 import store_pb2 as pb
from kvtag.v1 import store_pb2_grpc


def _kvtag_store() -> Path:
    """The service CLI: $KVTAG_STORE_BIN, beside this interpreter, or the repo's service venv (.venv)."""
    if os.environ.get("KVTAG_STORE_BIN"):
        return Path(os.environ["KVTAG_STORE_BIN"])
    beside = Path(sys.executable).with_name("kvtag-store")
    if beside.exists():
        return beside
    return Path(__file__).resolve().parents[2] / ".venv" / "bin" / "kvtag-store"


KVTAG_STORE = _kvtag_store()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class StoreProcess:
    """One `kvtag-store serve` process; can be killed, stopped (SIGSTOP) and restarted on its port."""

    def __init__(self, port: int, args: list[str], log_path: Path) -> None:
        self.port = port
        self.args = args
        self.log_path = log_path
        self.endpoint = f"127.0.0.1:{port}"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 20.0) -> None:
        command = [str(KVTAG_STORE), "serve", "--listen", self.endpoint, "--metrics-listen", "", *self.args]
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        self.wait_ready(timeout_s)

    def wait_ready(self, timeout_s: float) -> None:
        """Poll a real RPC (GetStats): channel_ready_future leaves a polling thread behind on close."""
        deadline = time.monotonic() + timeout_s
        with grpc.insecure_channel(self.endpoint) as channel:
            stub = store_pb2_grpc.KvStoreStub(channel)  # type: ignore[no-untyped-call]
            while True:
                assert self.process is not None and self.process.poll() is None, self.log_path.read_text()
                try:
                    stub.GetStats(pb.GetStatsRequest(), timeout=0.5)
                    return
                except grpc.RpcError:
                    if time.monotonic() > deadline:
                        raise AssertionError(f"kvtag-store not ready: {self.log_path.read_text()}") from None
                    time.sleep(0.05)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGCONT)
            self.process.kill()
            self.process.wait(timeout=10)

    def pause(self) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGCONT)
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)


def namespace(tenant: str = "") -> pb.NamespaceDescriptor:
    return pb.NamespaceDescriptor(
        model_name="test/tiny-llama",
        weights_fingerprint="sha256:0123",
        kv_dtype="float32",
        kv_layout="attn:1x4096",
        block_size=16,
        parallel_sharding="tp=1/rank=0",
        tenant=tenant,
    )


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str) -> float:
    """Poll `condition` until true; return the seconds it took, fail after timeout_s."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.02)
    return time.monotonic() - start
