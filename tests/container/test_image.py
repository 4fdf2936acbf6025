"""What the image itself declares and carries, checked on the built images."""

from __future__ import annotations

import json

import pytest

from . import podman as pm

pytestmark = pytest.mark.slow  # real podman containers


def test_image_runs_as_non_root_and_declares_ports_health_and_stop_signal(image: str) -> None:
    config = pm.image_config(image)
    assert config["User"] == "10001:10001", "a numeric user, so hosts and runtimes can verify it is not root"
    assert set(config["ExposedPorts"]) == {f"{pm.GRPC_PORT}/tcp", f"{pm.METRICS_PORT}/tcp"}
    assert config["StopSignal"] == "SIGTERM"
    health = pm.podman("image", "inspect", "--format", "{{json .HealthCheck}}", image).stdout
    assert "kvtag-store health" in " ".join(json.loads(health)["Test"])
    who = pm.podman("run", "--rm", "--entrypoint", "id", image).stdout
    assert who.startswith("uid=10001(kvtag) gid=10001(kvtag)"), who


def test_image_carries_no_vllm_torch_or_build_tools(image: str) -> None:
    probe = (
        "import importlib.util, json; "
        "print(json.dumps({m: importlib.util.find_spec(m) is not None "
        "for m in ['kvtag_store', 'kvtag', 'vllm', 'torch', 'pip', 'setuptools', 'mooncake']}))"
    )
    found = json.loads(pm.podman("run", "--rm", "--entrypoint", "python3", image, "-c", probe).stdout)
    assert found == {
        "kvtag_store": True,
        "kvtag": True,
        "vllm": False,
        "torch": False,
        "pip": False,
        "setuptools": False,
        "mooncake": False,
    }


def test_mooncake_image_adds_the_mooncake_client_and_cluster_binaries(mooncake_image: str) -> None:
    check = (
        "from mooncake.store import MooncakeDistributedStore; "
        "import shutil; print(shutil.which('mooncake_master'), shutil.which('mooncake_client'))"
    )
    out = pm.podman("run", "--rm", "--entrypoint", "python3", mooncake_image, "-c", check).stdout.split()
    assert out == ["/usr/local/bin/mooncake_master", "/usr/local/bin/mooncake_client"]
