"""`vllm serve` as the README types it: vLLM's OpenAI-compatible HTTP server from the vLLM env's `vllm`
console script, the connector chosen by plugin name alone, bound to 127.0.0.1.

Two fresh servers share one strict store: the second one's hit is read from vLLM's own Prometheus
counter and the response's `usage.prompt_tokens_details.cached_tokens`. Sessions open when a server
starts (diagnose lists it, and a third server in another mode is refused, before any request) and
end when it is SIGTERMed.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

import pytest

from tests.net import free_port, wait_until
from tests.store_process import StoreProcess, kill_group

from .harness import prompt, shared_memory_segments

pytestmark = pytest.mark.slow

VLLM = Path(sys.executable).with_name("vllm")  # the console script of the vLLM env running this suite
BLOCK = 32
START_TIMEOUT_S = 300.0
# --shutdown-timeout as in the README: vLLM's default (0) SIGKILLs the engine process right after
# SIGTERM, before it shuts its connectors down.
SHUTDOWN_TIMEOUT_S = 20


class Server:
    """One `vllm serve` process (its own process group, killed whole on exit) on 127.0.0.1."""

    def __init__(
        self, model: Path, store: StoreProcess, work_dir: Path, engine_id: str, **extra: Any
    ) -> None:
        self.model = str(model)
        self.engine_id = engine_id
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = work_dir / f"{engine_id}.log"
        transfer = {
            "kv_connector": "KvtagConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"endpoint": store.endpoint, "engine_id": engine_id, **extra},
        }
        self.command = [
            str(VLLM),
            "serve",
            self.model,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dtype",
            "float32",
            "--enforce-eager",
            "--block-size",
            str(BLOCK),
            "--max-model-len",
            "1024",
            "--enable-prefix-caching",
            "--enable-prompt-tokens-details",
            "--shutdown-timeout",
            str(SHUTDOWN_TIMEOUT_S),
            "--kv-transfer-config",
            json.dumps(transfer),
        ]
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Server:
        env = {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                self.command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._healthy():
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"vllm serve not healthy after {START_TIMEOUT_S} s:\n{self.log_tail()}")
            time.sleep(0.5)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        if self.proc is None:
            return
        # Shut down as an operator would (SIGTERM): a killed server leaves its shared memory behind.
        if self.proc.poll() is None:
            self.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=SHUTDOWN_TIMEOUT_S + 10)
        kill_group(self.proc)  # whatever of its group is still there

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as answer:
                return bool(answer.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def log_tail(self, lines: int = 40) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def complete(self, tokens: list[int], max_tokens: int = 4) -> dict[str, Any]:
        body = {
            "model": self.model,
            "prompt": tokens,
            "max_tokens": max_tokens,
            "temperature": 0,
            "return_token_ids": True,
        }
        request = urllib.request.Request(
            self.url + "/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=120) as answer:
            result: dict[str, Any] = json.load(answer)
        return result

    def counter(self, name: str) -> float:
        """A Prometheus counter from /metrics, summed over its label sets."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as answer:
            text = answer.read().decode()
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith((name + "{", name + " "))
        )

    def terminate(self) -> None:
        """SIGTERM to the server's main process (what `kill PID`, systemd or Kubernetes send)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)

    def wait_exit(self) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout=SHUTDOWN_TIMEOUT_S + 30)


def engine_sessions(store: StoreProcess, engine_id: str) -> list[tuple[str, bool]]:
    """(engine id, live) of every session diagnose lists for one engine's roles."""
    found = [
        (engine["engine_id"], bool(engine.get("live", False)))
        for namespace in store.diagnose().get("namespaces", [])
        for mode in namespace.get("modes", [])
        for engine in mode.get("engines", [])
        if engine["engine_id"].startswith(engine_id + "/")
    ]
    return sorted(found)


def stored_blocks(store: StoreProcess) -> int:
    return sum(
        int(mode.get("counters", {}).get("stored", 0))
        for namespace in store.diagnose().get("namespaces", [])
        for mode in namespace.get("modes", [])
    )


def test_the_vllm_console_script_reports_the_cpu_builds_version() -> None:
    done = subprocess.run([str(VLLM), "--version"], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    expected = importlib.metadata.version("vllm-cpu") + "+cpu"
    assert done.stdout.strip().splitlines()[-1] == expected == importlib.metadata.version("vllm")


def test_two_fresh_http_servers_share_blocks_vllm_reports_the_hits_and_another_mode_is_refused_at_start(
    models: dict[str, Path], work_dir: Path, start_store: Callable[..., StoreProcess]
) -> None:
    store = start_store("--policy", "strict")
    segments = shared_memory_segments()
    tokens = prompt(71, 3 * BLOCK + 5)  # 3 full blocks and 5 tokens
    with Server(models["llama"], store, work_dir, "http-a") as first:
        # The sessions open at start-up: diagnose lists both roles before any request.
        assert engine_sessions(store, "http-a") == [("http-a/scheduler", True), ("http-a/worker", True)]
        cold = first.complete(tokens)
        assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert first.counter("vllm:external_prefix_cache_hits_total") == 0
        wait_until(lambda: stored_blocks(store) >= 3, 30, "the first server's 3 blocks in the store", 0.2)

        first.terminate()
        ended_after = wait_until(
            lambda: not any(live for _, live in engine_sessions(store, "http-a")),
            10,
            "the SIGTERMed server's sessions to end (the store's session TTL is 30 s)",
            0.2,
        )
        assert engine_sessions(store, "http-a") == [("http-a/scheduler", False), ("http-a/worker", False)]
        assert first.wait_exit() == 0, first.log_tail()
    print(f"sessions of the SIGTERMed server ended {ended_after:.1f} s after SIGTERM")

    with Server(models["llama"], store, work_dir, "http-b") as second:
        warm = second.complete(tokens)
        hit = (len(tokens) - 1) // BLOCK * BLOCK
        assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == hit, warm["usage"]
        assert second.counter("vllm:external_prefix_cache_hits_total") == hit
        assert second.counter("vllm:prefix_cache_hits_total") == 0, "the hit came from the store, not locally"
        assert warm["choices"][0]["token_ids"] == cold["choices"][0]["token_ids"], "greedy tokens differ"
        log = second.log_path.read_text(errors="replace")
        assert "kvtag connector (SCHEDULER)" in log and "kvtag connector (WORKER)" in log

        # A server hashing another way (vLLM's own block hashes) is refused as it starts, not at
        # its first request: the log has the field diff and diagnose lists both roles as refused.
        with Server(models["llama"], store, work_dir, "http-c", key_scheme="vllm") as other:
            log = other.log_path.read_text(errors="replace")
            assert "refused engine 'http-c/scheduler'" in log and "refused engine 'http-c/worker'" in log
            assert "key_scheme: store has 'canonical', this engine has 'vllm'" in log
            refused = [
                r["engine_id"]
                for namespace in store.diagnose().get("namespaces", [])
                for r in namespace.get("refused", [])
            ]
            assert sorted(refused) == ["http-c/scheduler", "http-c/worker"]
            assert engine_sessions(store, "http-c") == []
            assert other.complete(tokens)["choices"][0]["token_ids"] == cold["choices"][0]["token_ids"]
    assert shared_memory_segments() <= segments, "a server left SharedMemory segments in /dev/shm"
