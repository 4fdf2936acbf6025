"""Fixtures: the kvtag image run by podman, and the Mooncake compose stack, each reachable on loopback.

Both deployments are parametrised under one module-scoped fixture, so every check in
test_deployments.py runs against each, and each is started once.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest

from tests.net import free_port

from . import podman as pm


@pytest.fixture(scope="session", autouse=True)
def podman_available() -> None:
    missing = [tool for tool in ("podman", "podman-compose") if shutil.which(tool) is None]
    if missing:
        pytest.fail(f"{', '.join(missing)} not found: run scripts/test_container.sh (make test-container)")


@pytest.fixture(scope="session")
def image() -> str:
    pm.ensure_image(pm.IMAGE, "embedded")
    return pm.IMAGE


@pytest.fixture(scope="session")
def mooncake_image() -> str:
    pm.ensure_image(pm.MOONCAKE_IMAGE, "mooncake")
    return pm.MOONCAKE_IMAGE


def _single_container(image: str) -> Iterator[pm.Deployment]:
    deployment = pm.run_service(image, {"KVTAG_POLICY": "strict", "KVTAG_CAPACITY": "64MiB"}, 64 << 20)
    try:
        pm.wait_healthy(deployment.name)
        yield deployment
    finally:
        pm.remove(deployment.name)


def _mooncake_stack(mooncake_image: str) -> Iterator[pm.Deployment]:
    grpc_port, metrics_port = free_port(), free_port()
    stack = pm.ComposeProject(
        "compose.mooncake.yaml",
        f"{pm.RUN_ID}-mooncake",
        {
            "KVTAG_MOONCAKE_IMAGE": mooncake_image,
            "KVTAG_POLICY": "strict",
            "KVTAG_GRPC_PORT": str(grpc_port),
            "KVTAG_METRICS_PORT": str(metrics_port),
            "KVTAG_MOONCAKE_SEGMENT": "128MB",
        },
    )
    try:
        stack.compose("up", "--detach")
        name = stack.container("kvtag")
        pm.wait_healthy(stack.container("mooncake-master"))
        pm.wait_healthy(name, timeout_s=90)
        yield pm.Deployment(
            name=name,
            grpc_port=grpc_port,
            metrics_port=metrics_port,
            backend="mooncake",
            # kvtag contributes no segment (segment size 0): all capacity is the storage node's.
            capacity_bytes=128 << 20,
            stack=stack,
        )
    finally:
        stack.down()


@pytest.fixture(scope="module", params=["podman-run", "compose-mooncake"])
def deployment(request: pytest.FixtureRequest) -> Iterator[pm.Deployment]:
    if request.param == "podman-run":
        yield from _single_container(request.getfixturevalue("image"))
    else:
        yield from _mooncake_stack(request.getfixturevalue("mooncake_image"))
