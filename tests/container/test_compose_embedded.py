"""compose.yaml (the embedded default) comes up healthy, stores and serves a block, stops cleanly,
and keeps its cache across a container restart (the disk tier on the named volume)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kvtag.v1 import store_pb2 as pb

from tests.net import free_port

from . import kvtag_calls as kc
from . import podman as pm

pytestmark = pytest.mark.slow  # real podman containers


@pytest.fixture(scope="module")
def embedded_stack(image: str) -> Iterator[tuple[pm.ComposeProject, pm.Deployment]]:
    grpc_port, metrics_port = free_port(), free_port()
    stack = pm.ComposeProject(
        "compose.yaml",
        f"{pm.RUN_ID}-embedded",
        {"KVTAG_IMAGE": image, "KVTAG_GRPC_PORT": str(grpc_port), "KVTAG_METRICS_PORT": str(metrics_port)},
    )
    try:
        stack.compose("up", "--detach")
        name = stack.container("kvtag")
        pm.wait_healthy(name)
        yield (
            stack,
            pm.Deployment(
                name=name,
                grpc_port=grpc_port,
                metrics_port=metrics_port,
                backend="memory",
                capacity_bytes=1 << 30,
            ),
        )
    finally:
        stack.down()


def test_embedded_compose_service_round_trips_a_block_and_stops_with_exit_code_0(
    embedded_stack: tuple[pm.ComposeProject, pm.Deployment],
) -> None:
    _, deployment = embedded_stack
    bindings = pm.inspect(deployment.name)["HostConfig"]["PortBindings"]
    assert {b["HostIp"] for ports in bindings.values() for b in ports} == {"127.0.0.1"}
    with kc.channel(deployment.target) as chan:
        kv = kc.stub(chan)
        session = kc.open_session(kv, "engine-a", "compose-embedded", lookahead=1).session_id
        kv.Put(
            pb.PutRequest(
                session_id=session, items=[pb.PutItem(block=pb.BlockRef(key=b"k"), value=b"v" * 100)]
            ),
            timeout=10,
        )
        got = kv.Get(pb.GetRequest(session_id=session, blocks=[pb.BlockRef(key=b"k")]), timeout=10)
        stats = kc.stub(chan).GetStats(pb.GetStatsRequest(), timeout=10)
    assert (got.results[0].status, got.results[0].value) == (pb.HIT, b"v" * 100)
    assert (stats.backend, stats.capacity_bytes) == ("memory", deployment.capacity_bytes)
    assert pm.stop(deployment.name) == 0, pm.logs(deployment.name)


def test_a_restarted_container_serves_the_blocks_stored_before_from_the_disk_volume(
    embedded_stack: tuple[pm.ComposeProject, pm.Deployment],
) -> None:
    _, deployment = embedded_stack
    if not pm.inspect(deployment.name)["State"]["Running"]:
        pm.podman("start", deployment.name)
    pm.wait_healthy(deployment.name)
    blocks = {b"restart-%d" % i: bytes([i]) * (64 << 10) for i in range(32)}
    with kc.channel(deployment.target) as chan:
        kv = kc.stub(chan)
        session = kc.open_session(kv, "engine-a", "compose-restart", lookahead=1).session_id
        put = kv.Put(
            pb.PutRequest(
                session_id=session,
                items=[pb.PutItem(block=pb.BlockRef(key=k), value=v) for k, v in blocks.items()],
            ),
            timeout=10,
        )
    assert {r.status for r in put.results} == {pb.STORED}
    assert pm.stop(deployment.name) == 0, pm.logs(deployment.name)
    pm.podman("start", deployment.name)
    pm.wait_healthy(deployment.name)
    with kc.channel(deployment.target) as chan:
        kv = kc.stub(chan)
        wrong = kc.open_session(kv, "engine-legacy", "compose-restart", lookahead=0).session_id
        refs = [pb.BlockRef(key=k) for k in blocks]
        stale = kv.Get(pb.GetRequest(session_id=wrong, blocks=refs), timeout=10)
        session = kc.open_session(kv, "engine-a", "compose-restart", lookahead=1).session_id
        got = kv.Get(pb.GetRequest(session_id=session, blocks=refs), timeout=30)
        stats = kv.GetStats(pb.GetStatsRequest(), timeout=10)
    assert [r.status for r in got.results] == [pb.HIT] * len(blocks), pm.logs(deployment.name)
    assert [r.value for r in got.results] == list(blocks.values())
    assert all(not r.value for r in stale.results), "a wrong-mode read returns no bytes after a restart"
    disk = {t.tier: t for t in stats.tiers}["disk"]
    assert not disk.degraded, disk.degraded_reason
