"""Two containers on one host: a client container in the store's IPC namespace (so the same /dev/shm)
uses the shared-memory data path; one with its own /dev/shm falls back to the inline path and still
works."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from . import podman as pm

# Runs inside the client container: the client library from the mounted source, the image's Python.
CLIENT_SCRIPT = """
import hashlib, json, logging
logging.basicConfig(level=logging.WARNING)
from kvtag.v1 import store_pb2 as pb
from kvtag_client.store import StoreClient
namespace = pb.NamespaceDescriptor(model_name="m", weights_fingerprint="w", kv_dtype="float32",
    kv_layout="attn:1x4096", block_size=16, parallel_sharding="tp=1/rank=0", tenant="containers")
mode = pb.HashingMode(key_scheme="canonical", scheme_version="1", hash_algorithm="sha256",
    hash_block_size=16)
client = StoreClient("127.0.0.1:50051", engine_id="engine-container", namespace=namespace, mode=mode,
    probe_keys=[b"p1", b"p2"], rpc_timeout_s=10.0)
assert client.open(), client.state
items = [(0, f"block-{i}".encode(), hashlib.shake_128(str(i).encode()).digest(64 << 10), b"")
         for i in range(8)]
statuses = client.put(items)
values = client.get([(g, k) for g, k, _, _ in items])
print(json.dumps({
    "data_path": client.data_path,
    "statuses": statuses,
    "exact": values == [v for _, _, v, _ in items],
}))
client.close()
"""


@pytest.fixture
def store(image: str) -> Iterator[pm.Deployment]:
    # A container's /dev/shm is 64 MiB by default: room for the 64 MiB capacity plus headroom.
    deployment = pm.run_service(
        image, {"KVTAG_CAPACITY": "64MiB"}, 64 << 20, extra=("--shm-size", "256m", "--ipc", "shareable")
    )
    try:
        pm.wait_healthy(deployment.name)
        yield deployment
    finally:
        pm.remove(deployment.name)


def _client(image: str, store: pm.Deployment, *ipc: str) -> dict[str, object]:
    """Run the client script in a second container of the image, in the store's network namespace."""
    result = pm.podman(
        "run", "--rm", "--label", f"{pm.RUN_LABEL}={pm.RUN_ID}",
        "--network", f"container:{store.name}", *ipc,
        "--volume", f"{pm.REPO / 'client'}:/src/client:ro,Z", "--env", "PYTHONPATH=/src/client",
        "--entrypoint", "/opt/kvtag/bin/python", image, "-c", CLIENT_SCRIPT,
        timeout=180,
    )  # fmt: skip
    report: dict[str, object] = json.loads(result.stdout.strip().splitlines()[-1])
    report["log"] = result.stderr
    return report


def test_client_container_sharing_dev_shm_uses_the_shared_memory_path(
    image: str, store: pm.Deployment
) -> None:
    report = _client(image, store, "--ipc", f"container:{store.name}")
    assert report["data_path"] == "shared_memory", report["log"]
    assert report["statuses"] == [1] * 8 and report["exact"] is True, report
    assert "shared-memory path unavailable" not in pm.logs(store.name)


def test_client_container_with_its_own_dev_shm_falls_back_to_inline(image: str, store: pm.Deployment) -> None:
    report = _client(image, store)
    assert report["data_path"] == "inline"
    assert "shared-memory path unavailable" in str(report["log"]), report["log"]
    assert report["exact"] is True, report
