"""`vllm serve` processes as an operator runs them, one per system and phase, on 127.0.0.1.

Every server gets one OpenMP thread: the machine has two cores, and the second one is left to the
store, the load generator and Mooncake, so a system's figures do not depend on how its store's
threads happen to fight the engine's.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.net import free_port
from tests.store_process import kill_group

VLLM = Path(sys.executable).with_name("vllm")
BLOCK = 32
MAX_MODEL_LEN = 8192
START_TIMEOUT_S = 900.0
SHUTDOWN_TIMEOUT_S = 30
LOCAL_BLOCKS = 1024
COUNTERS = (
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:external_prefix_cache_queries_total",
    "vllm:external_prefix_cache_hits_total",
    "vllm:request_success_total",
    "vllm:num_preemptions_total",
)


@dataclass
class ServerSpec:
    """What differs between systems and scenarios: the connector, its env, the engine flags."""

    name: str
    kv_transfer: dict[str, Any] | None = None
    env: dict[str, str] = field(default_factory=dict)
    speculative: dict[str, Any] | None = None
    extra_args: list[str] = field(default_factory=list)


def kvtag_transfer(endpoint: str, engine_id: str, **extra: Any) -> dict[str, Any]:
    """The README's configuration (the connector by plugin name, kv_both)."""
    return {
        "kv_connector": "KvtagConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"endpoint": endpoint, "engine_id": engine_id, **extra},
    }


def peer_transfer(lookup_port: int) -> dict[str, Any]:
    """vLLM's MooncakeStoreConnector with its documented defaults; only the lookup socket's name is set,
    so a producer and a consumer never share one."""
    return {
        "kv_connector": "MooncakeStoreConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"lookup_rpc_port": lookup_port},
    }


class Server:
    """One `vllm serve` process in its own process group; stopped with SIGTERM, killed whole on exit."""

    def __init__(self, spec: ServerSpec, model: Path, workdir: Path, tag: str) -> None:
        self.spec = spec
        self.model = str(model)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / f"vllm-{tag}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_s = 0.0
        command = [
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
            str(MAX_MODEL_LEN),
            "--max-num-batched-tokens",
            str(MAX_MODEL_LEN),
            "--enable-prefix-caching",
            "--enable-prompt-tokens-details",
            "--shutdown-timeout",
            str(SHUTDOWN_TIMEOUT_S),
            "--disable-uvicorn-access-log",
            # 1,024 blocks (32,768 tokens, 256 MiB) hold any load's working set; capacity overrides it.
            f"--num-gpu-blocks-override={LOCAL_BLOCKS}",
            *spec.extra_args,
        ]
        if spec.kv_transfer is not None:
            command += ["--kv-transfer-config", json.dumps(spec.kv_transfer)]
        if spec.speculative is not None:
            command += ["--speculative-config", json.dumps(spec.speculative)]
        self.command = command

    def start(self) -> Server:
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "VLLM_SERVER_DEV_MODE": "1",  # /reset_prefix_cache, to empty the local cache between runs
            "GLOG_minloglevel": "2",
            "VLLM_HOST_IP": "127.0.0.1",  # loopback is the namespace's only interface
            **self.spec.env,
        }
        self._t0 = time.monotonic()
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                self.command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        return self

    def wait_ready(self) -> Server:
        assert self.proc is not None
        deadline = self._t0 + START_TIMEOUT_S
        while not self._healthy():
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.spec.name}: vllm serve exited {self.proc.returncode}:\n{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.spec.name}: vllm serve not healthy:\n{self.log_tail()}")
            time.sleep(0.5)
        self.started_s = time.monotonic() - self._t0
        return self

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as answer:
                return bool(answer.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def log_tail(self, lines: int = 40) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def counters(self) -> dict[str, float]:
        """vLLM's Prometheus counters, each summed over its label sets."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as answer:
            text = answer.read().decode()
        out = dict.fromkeys(COUNTERS, 0.0)
        for line in text.splitlines():
            for name in COUNTERS:
                if line.startswith((name + "{", name + " ")):
                    out[name] += float(line.rsplit(" ", 1)[1])
        return out

    def reset_local_cache(self) -> None:
        """Empties vLLM's local prefix cache (not the connector's store), retrying while blocks are held."""
        deadline = time.monotonic() + 60
        while True:
            request = urllib.request.Request(self.url + "/reset_prefix_cache", data=b"", method="POST")
            with urllib.request.urlopen(request, timeout=30) as answer:
                if json.load(answer).get("success"):
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.spec.name}: the prefix cache never reset")
            time.sleep(0.5)

    def complete(self, prompt: str | list[int], max_tokens: int) -> dict[str, Any]:
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        request = urllib.request.Request(
            self.url + "/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=600) as answer:
            result: dict[str, Any] = json.load(answer)
        return result

    def stop(self) -> None:
        """SIGTERM (the connector finishes its saves within --shutdown-timeout), then SIGKILL the group."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=SHUTDOWN_TIMEOUT_S + 30)
        kill_group(self.proc)
        self.proc = None

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
