"""Real vLLM engines for the end-to-end suite, each in its own process (the store: tests.store_process).

Engines always run in a fresh interpreter (engine_runner.py): a "warm" run must not share any
in-process state with the run that stored the blocks. Every process started here is killed, with
its whole process group, when its owner exits; every server binds 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests.store_process import kill_group

RUNNER = Path(__file__).with_name("engine_runner.py")
ENGINE_TIMEOUT_S = 300.0


def kv_transfer_config(endpoint: str, **extra: Any) -> dict[str, Any]:
    """kvtag through kv_connector_module_path, with audit on (the suite asserts zero mismatches)."""
    return {
        "kv_connector": "KvtagConnector",
        "kv_connector_module_path": "kvtag_client.connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"endpoint": endpoint, "audit": True, **extra},
    }


class EngineRun:
    """One engine_runner.py process. `start()` returns at once; `result()` waits for the JSON."""

    def __init__(
        self, job: dict[str, Any], work_dir: Path, name: str, env: dict[str, str] | None = None
    ) -> None:
        self.job = job
        self.name = name
        self.env = env or {}
        self.job_path = work_dir / f"{name}.job.json"
        self.result_path = work_dir / f"{name}.result.json"
        self.log_path = work_dir / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> EngineRun:
        self.job_path.write_text(json.dumps(self.job))
        env = dict(os.environ)
        env.update(
            VLLM_ENABLE_V1_MULTIPROCESSING="0",
            VLLM_CPU_KVCACHE_SPACE="1",
            VLLM_CPU_OMP_THREADS_BIND="nobind",
            HF_HUB_OFFLINE="1",
            TOKENIZERS_PARALLELISM="false",
        )
        env.update(self.env)
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, str(RUNNER), str(self.job_path), str(self.result_path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        return self

    def log_tail(self, lines: int = 40) -> str:
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def wait_ready(self, barrier: str, timeout_s: float = ENGINE_TIMEOUT_S) -> None:
        """Waits until the runner reaches a `wait_for` barrier."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        while not Path(barrier + ".ready").exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine {self.name} exited before {barrier}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine {self.name} did not reach {barrier}:\n{self.log_tail()}")
            time.sleep(0.1)

    def result(self, timeout_s: float = ENGINE_TIMEOUT_S) -> dict[str, Any]:
        assert self.proc is not None
        try:
            rc = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise TimeoutError(f"engine {self.name} ran over {timeout_s} s:\n{self.log_tail()}") from None
        if rc != 0 or not self.result_path.exists():
            raise RuntimeError(f"engine {self.name} failed (exit {rc}):\n{self.log_tail()}")
        result: dict[str, Any] = json.loads(self.result_path.read_text())
        return result

    def kill(self) -> None:
        if self.proc is not None:
            kill_group(self.proc)


def run_engine(job: dict[str, Any], work_dir: Path, name: str) -> dict[str, Any]:
    """Runs one engine process to completion; never leaves it behind."""
    run = EngineRun(job, work_dir, name)
    try:
        return run.start().result()
    finally:
        run.kill()


def shared_memory_segments() -> set[Path]:
    """Python SharedMemory segments on this host (/dev/shm/psm_*): vLLM keeps queues in them, and a
    server killed rather than shut down leaves its own behind (two per `vllm serve`)."""
    return set(Path("/dev/shm").glob("psm_*"))


def prompt(seed: int, length: int) -> list[int]:
    """A deterministic token sequence whose first tokens differ per seed (no shared prefixes)."""
    state = (seed * 2654435761 + 12345) % (2**32)
    tokens = []
    for _ in range(length):
        state = (state * 1103515245 + 12345) % (2**31)
        tokens.append(2 + (state >> 16) % 500)
    return tokens
