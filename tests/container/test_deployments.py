"""The image under `podman run` and the Mooncake compose stack, probed from the host with real kvtag RPCs.

Each test runs once per deployment (see conftest.py). Both run with KVTAG_POLICY=strict.
The last test stops the service, so it stays last in this file.
"""

from __future__ import annotations

import os
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kvtag.v1 import store_pb2 as pb
from kvtag_proto.errors import parse_error

from . import kvtag_calls as kc
from . import podman as pm

pytestmark = pytest.mark.slow  # real podman containers


def test_health_service_reports_serving_on_the_published_port(deployment: pm.Deployment) -> None:
    with kc.channel(deployment.target) as chan:
        answer = health_pb2_grpc.HealthStub(chan).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert answer.status == health_pb2.HealthCheckResponse.SERVING


def test_stats_name_the_configured_backend_and_its_capacity(deployment: pm.Deployment) -> None:
    with kc.channel(deployment.target) as chan:
        stats = kc.stub(chan).GetStats(pb.GetStatsRequest(), timeout=10)
    assert stats.backend == deployment.backend
    assert stats.capacity_bytes == deployment.capacity_bytes, stats


def test_put_then_get_returns_the_stored_bytes(deployment: pm.Deployment) -> None:
    values = {b"block-0": os.urandom(4096), b"block-1": os.urandom(4096)}
    with kc.channel(deployment.target) as chan:
        kv = kc.stub(chan)
        session = kc.open_session(kv, "engine-a", "container-put-get", lookahead=1).session_id
        put = kv.Put(
            pb.PutRequest(
                session_id=session,
                items=[pb.PutItem(block=pb.BlockRef(key=k), value=v) for k, v in values.items()],
            ),
            timeout=10,
        )
        assert [r.status for r in put.results] == [pb.STORED, pb.STORED], put
        again = kv.Put(
            pb.PutRequest(
                session_id=session, items=[pb.PutItem(block=pb.BlockRef(key=b"block-0"), value=b"other")]
            ),
            timeout=10,
        )
        assert again.results[0].status == pb.ALREADY_PRESENT, "a second put must never overwrite"
        keys = [*values, b"never-stored"]
        got = kv.Get(pb.GetRequest(session_id=session, blocks=[pb.BlockRef(key=k) for k in keys]), timeout=10)
    assert [r.status for r in got.results] == [pb.HIT, pb.HIT, pb.MISS]
    assert [r.value for r in got.results[:2]] == list(values.values())


def test_session_in_another_mode_is_refused_under_strict_policy(deployment: pm.Deployment) -> None:
    with kc.channel(deployment.target) as chan:
        kv = kc.stub(chan)
        kc.open_session(kv, "engine-a", "container-strict", lookahead=1)
        with pytest.raises(grpc.RpcError) as refused:
            kc.open_session(kv, "engine-b", "container-strict", lookahead=0)
    error = parse_error(refused.value)
    assert error is not None, f"refusal carries no kvtag details: {refused.value}"
    assert error.code == grpc.StatusCode.FAILED_PRECONDITION
    assert error.reason == "MODE_REFUSED"
    assert error.mode_refusal is not None
    diffs = {d.field: (d.established, d.requested) for d in error.mode_refusal.diffs}
    assert diffs == {"lookahead_tokens": ("1", "0")}


def test_diagnose_reports_the_established_mode_and_the_refused_engine(deployment: pm.Deployment) -> None:
    with kc.channel(deployment.target) as chan:
        kv = kc.stub(chan)
        opened = kc.open_session(kv, "engine-a", "container-diagnose", lookahead=1)
        with pytest.raises(grpc.RpcError):
            kc.open_session(kv, "engine-b", "container-diagnose", lookahead=0)
        report = kv.Diagnose(pb.DiagnoseRequest(namespace_id=opened.namespace_id), timeout=10)
    assert [ns.namespace_id for ns in report.namespaces] == [opened.namespace_id]
    ns = report.namespaces[0]
    assert ns.policy == pb.POLICY_STRICT
    assert ns.established_mode_id == opened.mode_id
    assert [r.engine_id for r in ns.refused] == ["engine-b"]
    live = [e.engine_id for m in ns.modes for e in m.engines if e.live]
    assert live == ["engine-a"]


def test_metrics_endpoint_counts_stored_bytes_and_refusals(deployment: pm.Deployment) -> None:
    with kc.channel(deployment.target) as chan:
        kv = kc.stub(chan)
        session = kc.open_session(kv, "engine-m", "container-metrics", lookahead=1).session_id
        kv.Put(
            pb.PutRequest(
                session_id=session, items=[pb.PutItem(block=pb.BlockRef(key=b"m"), value=b"x" * 1000)]
            ),
            timeout=10,
        )
        with pytest.raises(grpc.RpcError):
            kc.open_session(kv, "engine-n", "container-metrics", lookahead=0)
    with urllib.request.urlopen(deployment.metrics_url, timeout=10) as answer:
        text = answer.read().decode()
    samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    assert float(samples["kvtag_put_bytes_total"]) >= 1000
    assert float(samples['kvtag_sessions_refused_total{reason="MODE_REFUSED"}']) >= 1


def published_host_ips(container: str) -> set[str]:
    bindings = pm.inspect(container)["HostConfig"]["PortBindings"] or {}
    return {binding["HostIp"] for ports in bindings.values() for binding in ports or []}


def test_only_kvtag_is_published_and_only_on_loopback(deployment: pm.Deployment) -> None:
    assert published_host_ips(deployment.name) == {"127.0.0.1"}
    if deployment.stack is None:
        return
    # Mooncake listens on every interface of its network namespace: the master and the
    # storage node must have no published port and no network but the stack's internal one.
    internal = f"{deployment.stack.project}_mooncake"
    assert pm.inspect_network(internal)["internal"] is True
    for service in ("mooncake-master", "mooncake-storage"):
        container = deployment.stack.container(service)
        assert published_host_ips(container) == set(), f"{service} publishes ports"
        assert set(pm.inspect(container)["NetworkSettings"]["Networks"]) == {internal}


def test_sigterm_stops_the_service_with_exit_code_0(deployment: pm.Deployment) -> None:
    code = pm.stop(deployment.name)
    assert code == 0, f"exit code {code} after SIGTERM:\n{pm.logs(deployment.name)}"
    assert "stopped cleanly" in pm.logs(deployment.name)
