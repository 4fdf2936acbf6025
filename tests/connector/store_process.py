"""A real kvtag-store subprocess on a free 127.0.0.1 port (binary overridable by KVTAG_STORE_BIN)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

DEFAULT_BIN = Path(__file__).resolve().parents[2] / ".venv" / "bin" / "kvtag-store"


def store_bin() -> str:
    return os.environ.get("KVTAG_STORE_BIN", str(DEFAULT_BIN))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class StoreProcess:
    def __init__(self, log_path: Path, *args: str, port: int | None = None) -> None:
        self.port = port or free_port()
        self.args = list(args)
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 20.0) -> None:
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child keeps it
        self.proc = subprocess.Popen(
            [store_bin(), "serve", "--listen", self.endpoint, "--metrics-listen", "", *self.args],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvtag-store exited: {self.log_path.read_text()[-2000:]}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"kvtag-store did not become healthy: {self.log_path.read_text()[-2000:]}")

    def health(self) -> bool:
        done = subprocess.run(
            [store_bin(), "health", "--target", self.endpoint], capture_output=True, timeout=10, check=False
        )
        return done.returncode == 0

    def cli(self, *args: str) -> str:
        done = subprocess.run(
            [store_bin(), *args, "--target", self.endpoint],
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
        )
        return done.stdout + done.stderr

    def pause(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None
