"""Session lifetime and value integrity through the real API."""

from __future__ import annotations

import time

import grpc
from kvtag.v1 import store_pb2 as pb
from kvtag_store.backends.base import BlockKey
from kvtag_store.policy.sessions import SessionTable

from ..conftest import ServerFactory
from ..faults import corrupt_memory_value
from ..helpers import Store, error_of


def test_session_expires_without_heartbeat_and_then_is_not_found(make_store: ServerFactory) -> None:
    store = make_store(session_ttl_ms=300)
    opened = store.open()
    assert opened.session_ttl_ms == 300
    time.sleep(0.6)
    error = error_of(lambda: store.lookup(opened.session_id, b"k"))
    assert error.code == grpc.StatusCode.NOT_FOUND
    assert error.reason == "SESSION_NOT_FOUND"
    assert "OpenSession" in error.message


def test_heartbeats_keep_a_session_alive(make_store: ServerFactory) -> None:
    store = make_store(session_ttl_ms=400)
    session = store.open().session_id
    for _ in range(6):
        time.sleep(0.15)
        answer = store.stub.Heartbeat(pb.HeartbeatRequest(session_id=session), timeout=5)
        assert answer.session_ttl_ms == 400
    assert list(store.lookup(session, b"k").statuses) == [pb.MISS]


def test_expired_engine_is_reported_as_gone_in_the_census(make_store: ServerFactory) -> None:
    store = make_store(session_ttl_ms=200)
    store.open("engine-a")
    time.sleep(0.7)
    [ns] = store.diagnose().namespaces
    [engine] = ns.modes[0].engines
    assert (engine.engine_id, engine.live) == ("engine-a", False)


def test_close_session_is_idempotent_and_ends_the_session(store: Store) -> None:
    session = store.open().session_id
    store.stub.CloseSession(pb.CloseSessionRequest(session_id=session), timeout=5)
    store.stub.CloseSession(pb.CloseSessionRequest(session_id=session), timeout=5)
    assert error_of(lambda: store.get(session, b"k")).reason == "SESSION_NOT_FOUND"


def test_corrupted_value_is_dropped_counted_and_never_served(store: Store) -> None:
    opened = store.open()
    session = opened.session_id
    store.put(session, (b"k", b"precious KV bytes" * 50), (b"j", b"healthy"))
    corrupt_memory_value(store.backend, opened.namespace_id, (0, BlockKey(b"k")))
    results = store.get(session, b"k", b"j")
    assert [(r.status, r.value) for r in results] == [(pb.MISS, b""), (pb.HIT, b"healthy")]
    stats = store.stats()
    assert (stats.corrupted_dropped, stats.keys) == (1, 1)


def test_lookup_is_a_key_query_and_the_get_drops_a_corrupted_value_as_a_counted_miss(store: Store) -> None:
    """Lookup promises presence only (no checksum pass over hit values); the Get that loads the block
    verifies it, so the connector sees a load error and the engine recomputes the block."""
    opened = store.open()
    session = opened.session_id
    store.put(session, (b"k", b"x" * 4096), (b"j", b"healthy"))
    corrupt_memory_value(store.backend, opened.namespace_id, (0, BlockKey(b"k")))
    answer = store.lookup(session, b"k", b"j")
    assert list(answer.statuses) == [pb.HIT, pb.HIT]
    results = store.get(session, b"k", b"j", lease_id=answer.lease.lease_id)
    assert [(r.status, r.value) for r in results] == [(pb.MISS, b""), (pb.HIT, b"healthy")]
    stats = store.stats()
    assert (stats.corrupted_dropped, stats.keys) == (1, 1)
    assert list(store.lookup(session, b"k").statuses) == [pb.MISS]
    assert [r.status for r in store.get(session, b"k")] == [pb.MISS]
    assert store.stats().corrupted_dropped == 1


def test_a_new_put_after_corruption_stores_fresh_bytes(store: Store) -> None:
    opened = store.open()
    store.put(opened.session_id, (b"k", b"old" * 10))
    corrupt_memory_value(store.backend, opened.namespace_id, (0, BlockKey(b"k")))
    store.get(opened.session_id, b"k")
    assert store.put(opened.session_id, (b"k", b"new" * 10)) == [pb.STORED]
    assert store.get(opened.session_id, b"k")[0].value == b"new" * 10


def test_reservations_added_after_a_session_ended_are_refused_to_be_freed_by_the_caller() -> None:
    """A slot granted while its session is being closed would otherwise be held by nobody."""
    table = SessionTable(session_ttl_ms=10_000)
    session = table.open("engine", "ns", "mode", {})
    assert table.add_reservations(session, [1, 2])
    table.close(session.session_id)
    assert not table.add_reservations(session, [3])
    assert 3 not in session.reservations
