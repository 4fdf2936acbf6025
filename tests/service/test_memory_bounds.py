"""The memory backend gives back what forgotten namespaces and tenants held, on a real server on
loopback: tenant arenas are unmapped and their files removed, a cap bounds the tenants holding one,
and the in-process census records go with the namespace.

Retention windows and session TTLs are fractions of a second so the tests need not wait long."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from kvtag.v1 import store_pb2 as pb
from kvtag.v1 import store_pb2_grpc
from kvtag_store.app.server import RunningServer, start_server
from kvtag_store.backends.memory import MemoryBackend, MemoryCensus
from kvtag_store.config import ServiceConfig

from tests.descriptors import mode, namespace

from .helpers import Store, error_of

RETENTION_MS = 500
TTL_MS = 300
MemoryStoreFactory = Callable[..., tuple[Store, MemoryCensus]]


@pytest.fixture
def make_memory_store(tmp_path: Path) -> Iterator[MemoryStoreFactory]:
    """A server whose memory backend keeps its arenas as files under tmp_path (as under --shm-dir)."""
    running: list[tuple[RunningServer, grpc.Channel]] = []

    def factory(
        max_tenant_arenas: int = 16, tenant_quotas: dict[str, int] | None = None, **config: Any
    ) -> tuple[Store, MemoryCensus]:
        backend = MemoryBackend(
            8 << 20, tenant_quotas, shm_dir=str(tmp_path), max_tenant_arenas=max_tenant_arenas
        )
        census = MemoryCensus()
        config.setdefault("census_retention_ms", RETENTION_MS)
        config.setdefault("session_ttl_ms", TTL_MS)
        service_config = ServiceConfig(**config)
        server = start_server(backend, census, service_config, listen="127.0.0.1:0")
        channel = grpc.insecure_channel(server.address)
        running.append((server, channel))
        stub = store_pb2_grpc.KvStoreStub(channel)  # type: ignore[no-untyped-call]
        return Store(server=server, stub=stub, backend=backend, channel=channel), census

    yield factory
    for server, channel in running:
        channel.close()
        server.stop(grace=0)


def wait_until(check: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def arena_files(directory: Path) -> set[str]:
    return {name for name in os.listdir(directory) if name.startswith("kvtag-")}


def close(store: Store, session: pb.OpenSessionResponse) -> None:
    store.stub.CloseSession(pb.CloseSessionRequest(session_id=session.session_id), timeout=5)


def test_a_tenants_arena_is_freed_once_its_namespaces_are_forgotten(
    make_memory_store: MemoryStoreFactory, tmp_path: Path
) -> None:
    store, _ = make_memory_store()
    store.open(engine_id="first", ns=namespace(model="first", tenant="first"))  # the up-front arena
    holders = [store.open(engine_id=f"h{t}", ns=namespace(model=f"h{t}", tenant=f"h{t}")) for t in range(3)]
    for session in holders:
        assert store.put(session.session_id, (b"k", b"v" * 4096)) == [pb.STORED]
    empty = [store.open(engine_id=f"e{t}", ns=namespace(model=f"e{t}", tenant=f"e{t}")) for t in range(3)]
    assert len(arena_files(tmp_path)) == store.backend.arenas() == 7
    for session in holders + empty:
        close(store, session)
    # The empty tenants' arenas go (unmapped, files removed); the holders' stay with their blocks.
    wait_until(lambda: len(arena_files(tmp_path)) == 4)
    time.sleep(3 * RETENTION_MS / 1000)
    assert store.backend.arenas() == 4
    for session in holders:
        arena = store.backend.shared_arena(session.namespace_id)
        assert arena is not None and arena.path is not None and os.path.exists(arena.path)


def test_forgotten_namespaces_leave_no_backend_or_census_state(make_memory_store: MemoryStoreFactory) -> None:
    # A window the 21 opens fit in on a loaded machine: nothing is forgotten before the counts.
    store, census = make_memory_store(
        max_tenant_arenas=32, default_policy=pb.POLICY_STRICT, census_retention_ms=3000, session_ttl_ms=3000
    )
    first = store.open(ns=namespace(model="strict"), hashing=mode(lookahead=1))
    others = [store.open(engine_id=f"e{i}", ns=namespace(model=f"m{i}", tenant=f"t{i}")) for i in range(20)]
    assert store.backend.namespace_count() == 21
    assert census.namespaces_held() == 21
    for session in [first, *others]:
        close(store, session)
    wait_until(lambda: store.backend.namespace_count() == 0 and census.namespaces_held() == 0, 20.0)
    wait_until(lambda: store.backend.arenas() == 1)  # the pool's up-front prefaulted arena stays
    # A strict namespace without blocks, forgotten, takes the next session's mode as its first.
    later = store.open(engine_id="later", ns=namespace(model="strict"), hashing=mode(lookahead=0))
    assert later.mode_id != first.mode_id
    assert (store.diagnose().namespaces[0]).established_mode_id == later.mode_id


def test_the_tenant_arena_cap_refuses_a_new_tenant_and_spares_the_others(
    make_memory_store: MemoryStoreFactory,
) -> None:
    store, _ = make_memory_store(max_tenant_arenas=2, tenant_quotas={"q": 1 << 20})
    store.open(engine_id="a", ns=namespace(tenant="a"))
    passing = store.open(engine_id="b", ns=namespace(tenant="b"))
    refusal = error_of(lambda: store.open(engine_id="c", ns=namespace(tenant="c")))
    assert refusal.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert refusal.reason == "NAMESPACE_CAP_REACHED"
    assert refusal.metadata == {"cap": "max-tenant-arenas", "limit": "2"}
    assert "--max-tenant-arenas" in refusal.message
    assert store.backend.arenas() == 2  # nothing kept of the refused tenant
    # Tenants holding an arena open more namespaces; a quota tenant's arena is not capped.
    store.open(engine_id="a2", ns=namespace(model="other", tenant="a"))
    store.open(engine_id="q", ns=namespace(tenant="q"))
    metrics = store.server.service.metrics
    assert metrics.sessions_refused.labels("NAMESPACE_CAP_REACHED")._value.get() == 1
    # Once b's namespace is forgotten its arena is freed, and c gets one.
    close(store, passing)
    wait_until(lambda: store.backend.arenas() == 2)
    store.open(engine_id="c", ns=namespace(tenant="c"))


def test_a_namespace_named_again_after_the_census_sweep_keeps_its_tenant_arena(tmp_path: Path) -> None:
    """The census forgets, then a session names the namespace again before the backend is told: the
    backend keeps it (and its tenant's arena), so its values never land in another tenant's arena."""
    backend = MemoryBackend(4 << 20, shm_dir=str(tmp_path))
    try:
        assert backend.admit_tenant("") is None  # the pool's up-front arena
        assert backend.admit_tenant("t") is None
        backend.assign_tenant("ns", "t")
        idle_since = time.monotonic()
        backend.assign_tenant("ns", "t")  # the session that named it again
        assert backend.forget_namespaces(["ns"], idle_since) == 0
        assert backend.namespace_count() == 1 and backend.arenas() == 2
        arena = backend.shared_arena("ns")
        assert arena is not None and arena.tenant == "t"
        # Untouched since: dropped, and the tenant's arena unmapped with its file removed.
        assert backend.forget_namespaces(["ns"], time.monotonic()) > 0
        assert backend.namespace_count() == 0 and backend.arenas() == 1
        assert arena.path is not None and not os.path.exists(arena.path)
    finally:
        backend.close()
