"""Diagnose, GetStats, metrics, streaming RPCs, health and reflection through the real server."""

from __future__ import annotations

import dataclasses
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from kvtag.v1 import store_pb2 as pb
from kvtag.v1 import store_pb2_grpc
from kvtag_store.app.server import start_server
from kvtag_store.backends.base import BackendStats, BackendUnavailable
from kvtag_store.backends.memory import MemoryBackend, MemoryCensus
from kvtag_store.config import ServiceConfig

from tests.descriptors import mode

from ..conftest import ServerFactory
from ..helpers import Store

LEGACY = mode(lookahead=0)


def test_cross_mode_miss_names_the_mode_that_held_the_block(store: Store) -> None:
    legacy = store.open("engine-legacy", hashing=LEGACY)
    lookahead = store.open("engine-lookahead")
    store.put(legacy.session_id, (b"legacy-k1", b"v1"), (b"legacy-k2", b"v2"), base=[b"base-1", b"base-2"])
    answer = store.lookup(
        lookahead.session_id, b"la-k1", b"la-k2", b"la-k3", base=[b"base-1", b"base-2", b"base-3"]
    )
    assert list(answer.statuses) == [pb.MISS, pb.MISS, pb.MISS]
    [ns] = store.diagnose().namespaces
    modes = {m.mode_id: m for m in ns.modes}
    mine = modes[lookahead.mode_id]
    assert mine.counters.cross_mode_misses == 2
    assert [(x.held_by_mode_id, x.count) for x in mine.cross_mode_misses] == [(legacy.mode_id, 2)]
    assert mine.counters.misses == 3


def test_diagnose_reports_modes_engines_refusals_and_counters(make_store: ServerFactory) -> None:
    store = make_store(default_policy=pb.POLICY_STRICT)
    first = store.open("engine-a", labels={"vllm": "0.32.0"})
    store.put(first.session_id, (b"k", b"v"))
    store.lookup(first.session_id, b"k", b"missing")
    with pytest.raises(grpc.RpcError):
        store.open("engine-b", hashing=LEGACY)
    [ns] = store.diagnose().namespaces
    assert ns.namespace_id == first.namespace_id
    assert ns.policy == pb.POLICY_STRICT
    assert ns.established_mode_id == first.mode_id
    assert ns.namespace.model_name == "llama-8b"
    [m] = ns.modes
    assert m.mode.lookahead_tokens == 1
    [engine] = m.engines
    assert (engine.engine_id, engine.live, dict(engine.labels)) == ("engine-a", True, {"vllm": "0.32.0"})
    assert (m.counters.hits, m.counters.misses, m.counters.stored) == (1, 1, 1)
    [refused] = ns.refused
    assert refused.engine_id == "engine-b"
    assert [d.field for d in refused.refusal.diffs] == ["lookahead_tokens"]


def test_diagnose_filters_by_namespace(store: Store) -> None:
    opened = store.open()
    assert len(store.stub.Diagnose(pb.DiagnoseRequest(namespace_id=opened.namespace_id)).namespaces) == 1
    assert len(store.stub.Diagnose(pb.DiagnoseRequest(namespace_id="ns-unknown")).namespaces) == 0


def test_stats_report_capacity_usage_and_backend(make_store: ServerFactory) -> None:
    store = make_store(capacity=1 << 20)
    session = store.open().session_id
    store.put(session, (b"a", bytes(1000)))
    stats = store.stats()
    assert (stats.backend, stats.capacity_bytes, stats.used_bytes, stats.keys) == ("memory", 1 << 20, 1000, 1)


def test_limits_are_announced_at_open(make_store: ServerFactory) -> None:
    store = make_store(capacity=8 << 20)
    limits = store.open().limits
    assert limits.max_key_bytes == 256
    assert limits.max_batch_items == 65536
    assert limits.max_message_bytes == 64 << 20
    assert limits.max_value_bytes == 8 << 20


def test_put_stream_and_get_stream_move_a_large_batch_in_order(store: Store) -> None:
    session = store.open().session_id
    values = [bytes([i]) * (3 << 20) for i in range(6)]  # 18 MiB: several messages each way

    def requests() -> object:
        yield pb.PutRequest(
            session_id=session, items=[pb.PutItem(block=pb.BlockRef(key=b"s0"), value=values[0])]
        )
        for i in range(1, 6):
            yield pb.PutRequest(items=[pb.PutItem(block=pb.BlockRef(key=b"s%d" % i), value=values[i])])

    put = store.stub.PutStream(requests(), timeout=30)
    assert [r.status for r in put.results] == [pb.STORED] * 6
    keys = [pb.BlockRef(key=b"s%d" % i) for i in (5, 0, 3)] + [pb.BlockRef(key=b"absent")]
    messages = list(store.stub.GetStream(pb.GetRequest(session_id=session, blocks=keys), timeout=30))
    assert len(messages) > 1
    results = [r for m in messages for r in m.results]
    assert [r.status for r in results] == [pb.HIT, pb.HIT, pb.HIT, pb.MISS]
    assert [r.value for r in results[:3]] == [values[5], values[0], values[3]]


def test_health_is_serving_for_the_server_and_the_kvstore_service(store: Store) -> None:
    with grpc.insecure_channel(store.server.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "kvtag.v1.KvStore"):
            answer = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING


def test_reflection_lists_the_kvstore_service(store: Store) -> None:
    with grpc.insecure_channel(store.server.address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        [answer] = list(stub.ServerReflectionInfo(iter([request]), timeout=5))
        names = {s.name for s in answer.list_services_response.service}
    assert {"kvtag.v1.KvStore", "grpc.health.v1.Health"} <= names


def test_prometheus_metrics_expose_store_and_request_figures() -> None:
    server = start_server(
        MemoryBackend(1 << 20),
        MemoryCensus(),
        ServiceConfig(),
        listen="127.0.0.1:0",
        metrics_listen="127.0.0.1:0",
    )
    try:
        with grpc.insecure_channel(server.address) as channel:
            kvstore = store_pb2_grpc.KvStoreStub(channel)  # type: ignore[no-untyped-call]
            backend = server.service.backend
            assert isinstance(backend, MemoryBackend)
            store = Store(server=server, stub=kvstore, backend=backend)
            session = store.open().session_id
            store.put(session, (b"k", bytes(100)))
            store.lookup(session, b"k", b"missing")
        with urllib.request.urlopen(f"http://{server.metrics_address}/metrics", timeout=5) as response:
            text = response.read().decode()
    finally:
        server.stop(grace=0)
    assert "kvtag_used_bytes 100.0" in text
    assert 'kvtag_lookup_keys_total{status="hit"} 1.0' in text
    assert 'kvtag_lookup_keys_total{status="miss"} 1.0' in text
    assert 'kvtag_put_items_total{status="stored"} 1.0' in text
    assert "kvtag_live_sessions 1.0" in text
    assert "kvtag_backend_up 1.0" in text


class _ErrorsBackend(MemoryBackend):
    """An injected fault: the backend reports errors it met (the memory backend itself meets none)."""

    def stats(self) -> BackendStats:
        return dataclasses.replace(super().stats(), errors={"full": 3, "transfer": 1})


def test_metrics_export_backend_errors_by_kind() -> None:
    server = start_server(
        _ErrorsBackend(1 << 20),
        MemoryCensus(),
        ServiceConfig(),
        listen="127.0.0.1:0",
        metrics_listen="127.0.0.1:0",
    )
    try:
        with urllib.request.urlopen(f"http://{server.metrics_address}/metrics", timeout=5) as response:
            text = response.read().decode()
    finally:
        server.stop(grace=0)
    assert "# TYPE kvtag_backend_errors_total counter" in text
    assert 'kvtag_backend_errors_total{kind="full"} 3.0' in text
    assert 'kvtag_backend_errors_total{kind="transfer"} 1.0' in text
    assert "kvtag_backend_up 1.0" in text


class _StatsFailBackend(MemoryBackend):
    """An injected fault: the backend cannot report its figures (as Mooncake with its master down)."""

    def stats(self) -> BackendStats:
        raise BackendUnavailable("stats unreachable (injected)")


def test_metrics_keep_answering_when_the_backend_cannot_report() -> None:
    server = start_server(
        _StatsFailBackend(1 << 20),
        MemoryCensus(),
        ServiceConfig(),
        listen="127.0.0.1:0",
        metrics_listen="127.0.0.1:0",
    )
    try:
        with urllib.request.urlopen(f"http://{server.metrics_address}/metrics", timeout=5) as response:
            status = response.status
            text = response.read().decode()
    finally:
        server.stop(grace=0)
    assert status == 200
    assert "kvtag_backend_up 0.0" in text
    assert "kvtag_live_sessions 0.0" in text
    assert "kvtag_used_bytes" not in text
    assert "# TYPE kvtag_rpc_duration_seconds histogram" in text
