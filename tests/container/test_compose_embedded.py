"""compose.yaml (the embedded default) comes up healthy, stores and serves a block, and stops cleanly."""

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
