"""The server subprocesses the benchmarks start: the reference gRPC bytes server (bench_service.py
--serve-bytes runs it), and the handle on each server (log, address, CPU time and page faults)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
from collections.abc import Iterator, Sequence
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

ECHO_SERVICE = "kvtagbench.Bytes"


def serve_bytes(listen: str, workers: int, max_message_bytes: int) -> None:
    """A plain gRPC service with no protobuf: raw bytes handlers on the kvtag server's thread-pool model."""
    blobs: dict[int, bytes] = {}

    def echo(request: bytes, context: Any) -> bytes:
        return request

    def upload(request: bytes, context: Any) -> bytes:
        return b""

    def download(request: bytes, context: Any) -> bytes:
        size = int(request)
        blob = blobs.get(size)
        if blob is None:  # first call per size builds it; the benchmark warms every size up first
            blob = blobs[size] = os.urandom(size)
        return blob

    handlers = {
        name: grpc.unary_unary_rpc_method_handler(fn)
        for name, fn in (("Echo", echo), ("Upload", upload), ("Download", download))
    }
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=workers),
        options=[
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.so_reuseport", 0),
        ],
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(ECHO_SERVICE, handlers),))
    server.add_insecure_port(listen)
    server.start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()
    server.stop(grace=1).wait()


# ---- subprocess plumbing --------------------------------------------------------------------------


@dataclass
class Server:
    """A server subprocess with its log, address and CPU-time reader."""

    name: str
    proc: subprocess.Popen[bytes]
    address: str
    log_path: Path

    def cpu_and_faults(self) -> tuple[float, int]:
        """utime + stime of the server process, all threads (10 ms ticks), and its minor page faults."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks = int(fields[11]) + int(fields[12])
        return ticks / os.sysconf("SC_CLK_TCK"), int(fields[7])

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@contextlib.contextmanager
def start_server(
    name: str, argv: Sequence[str], port: int, log_dir: Path, env: dict[str, str] | None = None
) -> Iterator[Server]:
    log_path = log_dir / f"{name}.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            list(argv),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
    server = Server(name, proc, f"127.0.0.1:{port}", log_path)
    try:
        yield server
    finally:
        server.stop()


def wait_ready(server: Server, channel: grpc.Channel, timeout: float = 30.0) -> None:
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout)
    except grpc.FutureTimeoutError:
        raise SystemExit(
            f"{server.name} did not start within {timeout:.0f} s:\n{server.log_tail()}"
        ) from None
    if server.proc.poll() is not None:
        raise SystemExit(f"{server.name} exited with {server.proc.returncode}:\n{server.log_tail()}")


def channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]
