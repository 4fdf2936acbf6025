"""The memory backend gives back what forgotten namespaces and tenants held, on a real server on
loopback: tenant arenas are unmapped and their files removed, only tenants the operator names get one
(tokens file, quota), and the in-process census records go with the namespace.

Retention windows and session TTLs are fractions of a second so the tests need not wait long."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
from kvtag.v1 import store_pb2 as pb
from kvtag.v1 import store_pb2_grpc
from kvtag_proto.channels import ChannelSecurity, open_channel
from kvtag_store.app.server import RunningServer, start_server
from kvtag_store.backends.memory import MemoryBackend, MemoryCensus
from kvtag_store.config import ServiceConfig
from kvtag_store.security.options import Security
from kvtag_store.security.tokens import TokenRegistry

from tests.descriptors import mode, namespace

from ..helpers import Store
from ..security_harness import write_tokens

RETENTION_MS = 500
TTL_MS = 300
MemoryStoreFactory = Callable[..., tuple[Store, MemoryCensus]]


@pytest.fixture
def make_memory_store(tmp_path: Path) -> Iterator[MemoryStoreFactory]:
    """A server whose memory backend keeps its arenas as files under tmp_path/shm (as under --shm-dir).
    With `token_tenants`, it takes tokens: the store's calls carry an admin token naming those tenants."""
    running: list[tuple[RunningServer, grpc.Channel]] = []
    shm = tmp_path / "shm"
    shm.mkdir()

    def factory(
        tenant_quotas: dict[str, int] | None = None,
        token_tenants: Sequence[str] | None = None,
        **config: Any,
    ) -> tuple[Store, MemoryCensus]:
        backend = MemoryBackend(8 << 20, tenant_quotas, shm_dir=str(shm))
        census = MemoryCensus()
        config.setdefault("census_retention_ms", RETENTION_MS)
        config.setdefault("session_ttl_ms", TTL_MS)
        service_config = ServiceConfig(**config)
        security = Security()
        channel_security = ChannelSecurity(use_env_token=False)
        if token_tenants is not None:
            token = write_tokens(tmp_path / "tokens.toml", [("ops", "admin", token_tenants)])["ops"]
            (tmp_path / "ops.token").write_text(token)
            security = Security(tokens=TokenRegistry.from_file(tmp_path / "tokens.toml"))
            channel_security = ChannelSecurity(token_file=str(tmp_path / "ops.token"), use_env_token=False)
        server = start_server(backend, census, service_config, listen="127.0.0.1:0", security=security)
        channel = open_channel(server.address, channel_security)
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
    named = ["first", *(f"h{t}" for t in range(3)), *(f"e{t}" for t in range(3))]
    store, _ = make_memory_store(token_tenants=named)  # tenants of their own: the tokens file names them
    store.open(engine_id="first", ns=namespace(model="first", tenant="first"))  # the up-front arena
    holders = [store.open(engine_id=f"h{t}", ns=namespace(model=f"h{t}", tenant=f"h{t}")) for t in range(3)]
    for session in holders:
        assert store.put(session.session_id, (b"k", b"v" * 4096)) == [pb.STORED]
    empty = [store.open(engine_id=f"e{t}", ns=namespace(model=f"e{t}", tenant=f"e{t}")) for t in range(3)]
    assert len(arena_files(tmp_path / "shm")) == store.backend.arenas() == 7
    for session in holders + empty:
        close(store, session)
    # The empty tenants' arenas go (unmapped, files removed); the holders' stay with their blocks.
    wait_until(lambda: len(arena_files(tmp_path / "shm")) == 4)
    time.sleep(3 * RETENTION_MS / 1000)
    assert store.backend.arenas() == 4
    for session in holders:
        arena = store.backend.shared_arena(session.namespace_id)
        assert arena is not None and arena.path is not None and os.path.exists(arena.path)


def test_forgotten_namespaces_leave_no_backend_or_census_state(make_memory_store: MemoryStoreFactory) -> None:
    # A window the 21 opens fit in on a loaded machine: nothing is forgotten before the counts.
    store, census = make_memory_store(
        default_policy=pb.POLICY_STRICT, census_retention_ms=3000, session_ttl_ms=3000
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


def test_without_tokens_every_tenant_shares_the_pools_arena_and_none_is_refused(
    make_memory_store: MemoryStoreFactory, tmp_path: Path
) -> None:
    """Tenant names are client-chosen labels without tokens: 40 of them (past the old cap of 16) add
    no arena and are all served; a quota tenant, named by the operator, still has its own."""
    store, _ = make_memory_store(tenant_quotas={"q": 1 << 20})
    sessions = [store.open(engine_id=f"t{i}", ns=namespace(tenant=f"t{i}")) for i in range(40)]
    for i, session in enumerate(sessions):
        assert store.put(session.session_id, (b"k", bytes([i]) * 100)) == [pb.STORED]
    quota = store.open(engine_id="q", ns=namespace(tenant="q"))
    assert store.backend.arenas() == 2 == len(arena_files(tmp_path / "shm"))
    first = store.backend.shared_arena(sessions[0].namespace_id)
    assert first is not None and first.tenant == ""
    assert all(store.backend.shared_arena(s.namespace_id) is first for s in sessions)
    assert store.backend.shared_arena(quota.namespace_id) is not first
    # Each tenant's namespace still reads back only its own value.
    for i, session in enumerate(sessions):
        assert [(r.status, r.value) for r in store.get(session.session_id, b"k")] == [
            (pb.HIT, bytes([i]) * 100)
        ]
    assert store.server.service.metrics.sessions_refused.labels("NAMESPACE_CAP_REACHED")._value.get() == 0


def test_with_tokens_only_the_tenants_the_file_names_get_an_arena_of_their_own(
    make_memory_store: MemoryStoreFactory,
) -> None:
    """With tokens, an arena per tenant the tokens file names (the operator's bound); tenants reached
    only through a "*" grant share one arena, whatever number of them is opened."""
    store, _ = make_memory_store(token_tenants=["a", "b", "*"])
    a = store.open(engine_id="a", ns=namespace(tenant="a"))
    b = store.open(engine_id="b", ns=namespace(tenant="b"))
    wild = [store.open(engine_id=f"w{i}", ns=namespace(tenant=f"w{i}")) for i in range(20)]
    arena_a, arena_b = store.backend.shared_arena(a.namespace_id), store.backend.shared_arena(b.namespace_id)
    assert arena_a is not None and arena_a.tenant == "a"
    assert arena_b is not None and arena_b.tenant == "b"
    shared = {id(store.backend.shared_arena(w.namespace_id)) for w in wild}
    assert len(shared) == 1 and id(arena_a) not in shared and id(arena_b) not in shared
    assert store.backend.arenas() == 3


def test_a_namespace_named_again_after_the_census_sweep_keeps_its_tenant_arena(tmp_path: Path) -> None:
    """The census forgets, then a session names the namespace again before the backend is told: the
    backend keeps it (and its tenant's arena), so its values never land in another tenant's arena."""
    backend = MemoryBackend(4 << 20, shm_dir=str(tmp_path))
    try:
        backend.admit_tenant("")  # the pool's up-front arena
        backend.admit_tenant("t")
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
