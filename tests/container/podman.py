"""Thin wrappers over the podman and podman-compose CLIs for the container tests.

Every container or compose project these tests start carries the run id
(KVTAG_TEST_RUN_ID, set by scripts/test_container.sh) in a label or its project name,
so the script's exit trap can remove whatever a failed run leaves behind.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.net import free_port

REPO = Path(__file__).resolve().parents[2]
RUN_ID = os.environ.get("KVTAG_TEST_RUN_ID") or f"kvtagtest{os.getpid()}"
RUN_LABEL = "kvtag.test.run"
IMAGE = os.environ.get("KVTAG_TEST_IMAGE", "localhost/kvtag-store:test")
MOONCAKE_IMAGE = os.environ.get("KVTAG_TEST_MOONCAKE_IMAGE", "localhost/kvtag-store:test-mooncake")
ETCD_IMAGE = os.environ.get("KVTAG_TEST_ETCD_IMAGE", "localhost/kvtag-store:test-etcd")
BASE_IMAGE = os.environ.get("KVTAG_BASE_IMAGE", "localhost/kvtag-base:bookworm")
GRPC_PORT = 50051
METRICS_PORT = 9464


def podman(*args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise RuntimeError(f"podman {' '.join(args)} failed ({result.returncode}): {result.stderr.strip()}")
    return result


def ensure_image(image: str, target: str) -> None:
    """Build the image from the repository's Dockerfile unless the script already did."""
    if podman("image", "exists", image, check=False).returncode == 0:
        return
    podman(
        "build", "--format", "docker", "--target", target, "--build-arg", f"BASE_IMAGE={BASE_IMAGE}",
        "--tag", image, str(REPO),
        timeout=600,
    )  # fmt: skip


def inspect(name: str) -> dict[str, Any]:
    data: list[dict[str, Any]] = json.loads(podman("inspect", name).stdout)
    return data[0]


def inspect_network(name: str) -> dict[str, Any]:
    data: list[dict[str, Any]] = json.loads(podman("network", "inspect", name).stdout)
    return data[0]


def image_config(image: str) -> dict[str, Any]:
    data: list[dict[str, Any]] = json.loads(podman("image", "inspect", image).stdout)
    config: dict[str, Any] = data[0]["Config"]
    return config


def wait_healthy(name: str, timeout_s: float = 60) -> None:
    """Run the image's own HEALTHCHECK (podman here has no systemd timer to run it) until it passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = inspect(name)["State"]
        if not state["Running"]:
            raise AssertionError(f"{name} exited ({state['ExitCode']}) before healthy:\n{logs(name)}")
        if podman("healthcheck", "run", name, check=False, timeout=30).returncode == 0:
            return
        time.sleep(0.5)
    raise AssertionError(f"{name} not healthy after {timeout_s}s:\n{logs(name)}")


def logs(name: str) -> str:
    result = podman("logs", name, check=False)
    return (result.stdout + result.stderr)[-4000:]


def stop(name: str, grace_s: int = 15) -> int:
    """SIGTERM (the image's STOPSIGNAL), wait for the exit, return the exit code."""
    podman("stop", "--time", str(grace_s), name, timeout=grace_s + 30)
    code: int = inspect(name)["State"]["ExitCode"]
    return code


@dataclass
class Deployment:
    """A running kvtag service reachable from the host, and how to stop it."""

    name: str  # the kvtag container
    grpc_port: int
    metrics_port: int
    backend: str
    capacity_bytes: int  # what GetStats must report: the memory capacity or the storage segment
    stack: ComposeProject | None = None

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"


def run_service(
    image: str, env: dict[str, str], capacity_bytes: int, extra: tuple[str, ...] = ()
) -> Deployment:
    """`podman run --init -p 127.0.0.1:P:50051 ...` of the image; never --network host. `extra`: more
    `podman run` options (volumes)."""
    name = f"{RUN_ID}-{uuid.uuid4().hex[:8]}"
    grpc_port, metrics_port = free_port(), free_port()
    env_args = [arg for key, value in env.items() for arg in ("--env", f"{key}={value}")]
    podman(
        "run", "--detach", "--init", "--name", name, "--label", f"{RUN_LABEL}={RUN_ID}",
        "--publish", f"127.0.0.1:{grpc_port}:{GRPC_PORT}",
        "--publish", f"127.0.0.1:{metrics_port}:{METRICS_PORT}",
        *env_args, *extra, image,
    )  # fmt: skip
    return Deployment(
        name=name,
        grpc_port=grpc_port,
        metrics_port=metrics_port,
        backend="memory",
        capacity_bytes=capacity_bytes,
    )


def remove(name: str) -> None:
    podman("rm", "--force", "--time", "0", name, check=False)


class ComposeProject:
    """One `podman-compose -p PROJECT -f FILE [-f OVERLAY...]` stack, torn down with its networks."""

    def __init__(self, file: str, project: str, env: dict[str, str], overlays: tuple[str, ...] = ()) -> None:
        self.files = [str(REPO / f) for f in (file, *overlays)]
        self.project = project
        self.env = {**os.environ, **env}

    def compose(self, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            ["podman-compose", "-p", self.project, *(a for f in self.files for a in ("-f", f)), *args],
            capture_output=True,
            text=True,
            env=self.env,
            cwd=REPO,
            timeout=timeout,
        )
        if result.returncode != 0:
            raise RuntimeError(f"podman-compose {' '.join(args)} failed: {result.stdout}\n{result.stderr}")
        return result

    def container(self, service: str) -> str:
        names = podman(
            "ps", "--all", "--format", "{{.Names}}",
            "--filter", f"label=io.podman.compose.project={self.project}",
            "--filter", f"label=com.docker.compose.service={service}",
        ).stdout.split()  # fmt: skip
        if len(names) != 1:
            raise AssertionError(f"expected one {service} container in {self.project}, found {names}")
        return names[0]

    def down(self) -> None:
        """Remove the containers, the project's networks (podman-compose 1.0 keeps networks) and its
        volumes."""
        ids = podman(
            "ps", "--all", "--quiet", "--filter", f"label=io.podman.compose.project={self.project}"
        ).stdout.split()
        if ids:
            podman("rm", "--force", "--time", "10", *ids, check=False, timeout=60)
        networks = podman(
            "network", "ls", "--quiet", "--filter", f"label=io.podman.compose.project={self.project}"
        ).stdout.split()
        if networks:
            podman("network", "rm", "--force", *networks, check=False)
        # compose.yaml's disk tier volume (PROJECT_kvtag-disk): a test's cache must not outlive it.
        volumes = podman(
            "volume", "ls", "--quiet", "--filter", f"label=io.podman.compose.project={self.project}"
        ).stdout.split()
        volumes += [v for v in (f"{self.project}_kvtag-disk",) if v not in volumes]
        podman("volume", "rm", "--force", *volumes, check=False)
