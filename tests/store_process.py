"""A real `kvtag-store serve` subprocess on 127.0.0.1 that a test can stop, kill, pause and restart.

Shared by the client, connector and end-to-end suites so that each fault (SIGKILL, SIGSTOP, a restart
on the same port) means the same thing everywhere. The binary is $KVTAG_STORE_BIN or the service venv's
(.venv): the service never runs inside the vLLM venv.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

from tests.net import free_port, wait_until

REPO = Path(__file__).resolve().parents[1]
READY_LINE = b"serving"  # the lifecycle line `serve` logs once its port accepts calls


def store_bin() -> str:
    return os.environ.get("KVTAG_STORE_BIN") or str(REPO / ".venv" / "bin" / "kvtag-store")


def kill_group(proc: subprocess.Popen[bytes], sig: int = signal.SIGKILL) -> None:
    """Signals the whole process group of a child started with start_new_session=True, then reaps it."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


TEST_CAPACITY = "256MiB"


class StoreProcess:
    """One store on a fixed port (a restart keeps the address); every start appends to `log_path`.

    `process_group` runs it in its own session and signals the whole group, for suites whose
    children must not outlive a kill.
    """

    def __init__(
        self, log_path: Path, *args: str, port: int | None = None, process_group: bool = False
    ) -> None:
        self.port = port or free_port()
        self.endpoint = f"127.0.0.1:{self.port}"
        # A store touches its whole capacity up front (docs/operations.md); the suites start dozens, so
        # theirs is 256 MiB unless a test asks for another.
        if not any(a == "--capacity" or a.startswith("--capacity=") for a in args):
            args = ("--capacity", TEST_CAPACITY, *args)
        self.args = list(args)
        self.log_path = log_path
        self.process_group = process_group
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 30.0) -> StoreProcess:
        """Starts `serve` and returns once it has logged that it is serving."""
        command = [store_bin(), "serve", "--listen", self.endpoint, "--metrics-listen", "", *self.args]
        offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, start_new_session=self.process_group
            )
        deadline = time.monotonic() + timeout_s
        while READY_LINE not in self._log_since(offset):
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvtag-store exited with {self.proc.returncode}: {self.log_tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"kvtag-store on {self.endpoint} not serving after {timeout_s} s")
            time.sleep(0.05)
        return self

    def __enter__(self) -> StoreProcess:
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.stop()

    def _log_since(self, offset: int) -> bytes:
        with self.log_path.open("rb") as log:
            log.seek(offset)
            return log.read()

    def log_tail(self, chars: int = 2000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""

    def _signal(self, sig: int) -> None:
        assert self.proc is not None
        if self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            if self.process_group:
                os.killpg(self.proc.pid, sig)
            else:
                self.proc.send_signal(sig)

    def pause(self) -> None:
        """SIGSTOP: connections stay open and nothing answers. Returns once every thread of the store
        has stopped: the signal lands asynchronously, and a call sent in between would be answered."""
        self._signal(signal.SIGSTOP)
        assert self.proc is not None
        pid = self.proc.pid
        wait_until(lambda: self.proc is None or self.proc.poll() is not None or _stopped(pid), 10, "SIGSTOP")

    def resume(self) -> None:
        self._signal(signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL: the abrupt failure a client has to survive."""
        if self.proc is not None:
            if self.process_group:
                kill_group(self.proc)
            else:
                self._signal(signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(timeout=10)
            self.proc = None

    def stop(self) -> None:
        """SIGTERM (after SIGCONT, in case it is paused); SIGKILL if it has not exited in 10 s."""
        if self.proc is not None:
            self._signal(signal.SIGCONT)
            self._signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()
            self.proc = None

    def health(self) -> bool:
        probe = subprocess.run(
            [store_bin(), "health", "--target", self.endpoint, "--timeout", "1"],
            capture_output=True,
            timeout=10,
            check=False,
        )
        return probe.returncode == 0

    def cli(self, *args: str) -> str:
        """`kvtag-store <args> --target <this store>`: its stdout and stderr together."""
        done = subprocess.run(
            [store_bin(), *args, "--target", self.endpoint],
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
        )
        return done.stdout + done.stderr

    def diagnose(self) -> dict[str, Any]:
        answer = subprocess.run(
            [store_bin(), "diagnose", "--target", self.endpoint, "--json"],
            capture_output=True,
            check=True,
            timeout=30,
        )
        result: dict[str, Any] = json.loads(answer.stdout)
        return result


@contextlib.contextmanager
def store_starter(
    log_dir: Path, *, process_group: bool = False, on_exit: Callable[[StoreProcess], None] = StoreProcess.stop
) -> Iterator[Callable[..., StoreProcess]]:
    """Yields start(*serve_args, port=None) -> a started StoreProcess; on exit, on_exit(each one)."""
    started: list[StoreProcess] = []

    def start(*args: str, port: int | None = None) -> StoreProcess:
        log_path = log_dir / f"store-{len(started)}.log"
        store = StoreProcess(log_path, *args, port=port, process_group=process_group)
        started.append(store)
        return store.start()

    try:
        yield start
    finally:
        for store in started:
            on_exit(store)


def _stopped(pid: int) -> bool:
    """Every thread of `pid` in the stopped state (T or t in /proc/PID/task/TID/stat)."""
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
        states = [(task / "stat").read_text().rsplit(")", 1)[1].split()[0] for task in tasks]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return bool(states) and all(state in "Tt" for state in states)
