"""Capacity, LRU eviction and read leases through the real API."""

from __future__ import annotations

import time

from kvtag.v1 import store_pb2 as pb

from tests.descriptors import namespace

from ..conftest import ServerFactory
from ..helpers import Store

BLOCK = 1000  # bytes per value; the stores below hold 4 of them


def test_used_bytes_are_exactly_the_value_bytes(make_store: ServerFactory) -> None:
    store = make_store(capacity=10_000)
    session = store.open().session_id
    store.put(session, (b"a", bytes(123)), (b"b", bytes(4567)), (b"a", bytes(999)))
    stats = store.stats()
    assert (stats.used_bytes, stats.keys) == (123 + 4567, 2)
    [ns] = stats.namespaces
    assert (ns.keys, ns.used_bytes) == (2, 4690)


def test_least_recently_used_block_is_evicted_first(make_store: ServerFactory) -> None:
    store = make_store(capacity=4 * BLOCK)
    session = store.open().session_id
    for name in (b"k1", b"k2", b"k3", b"k4"):
        store.put(session, (name, bytes(BLOCK)))
    store.get(session, b"k1")  # k1 becomes the most recently used; k2 is now the oldest
    store.put(session, (b"k5", bytes(BLOCK)))
    statuses = list(store.lookup(session, b"k1", b"k2", b"k3", b"k4", b"k5").statuses)
    assert statuses == [pb.HIT, pb.MISS, pb.HIT, pb.HIT, pb.HIT]
    stats = store.stats()
    assert (stats.evictions, stats.used_bytes) == (1, 4 * BLOCK)


def test_leased_blocks_survive_eviction_pressure(make_store: ServerFactory) -> None:
    store = make_store(capacity=4 * BLOCK)
    session = store.open().session_id
    for name in (b"k1", b"k2", b"k3", b"k4"):
        store.put(session, (name, bytes(BLOCK)))
    lease = store.lookup(session, b"k1", b"k2").lease
    assert lease.lease_id and lease.expires_in_ms == 30_000
    for name in (b"n1", b"n2", b"n3", b"n4"):
        store.put(session, (name, bytes(BLOCK)))
    assert list(store.lookup(session, b"k1", b"k2").statuses) == [pb.HIT, pb.HIT]
    assert store.stats().leased_keys == 2


def test_store_full_of_leased_blocks_rejects_the_put_and_evicts_nothing(make_store: ServerFactory) -> None:
    store = make_store(capacity=2 * BLOCK)
    session = store.open().session_id
    store.put(session, (b"k1", bytes(BLOCK)), (b"k2", bytes(BLOCK)))
    store.lookup(session, b"k1", b"k2")
    response = store.stub.Put(
        pb.PutRequest(
            session_id=session, items=[pb.PutItem(block=pb.BlockRef(key=b"k3"), value=bytes(BLOCK))]
        ),
        timeout=5,
    )
    [result] = response.results
    assert result.status == pb.REJECTED
    assert "store full of leased blocks" in result.reason
    assert store.stats().evictions == 0


def test_value_larger_than_capacity_is_rejected_per_item_and_the_rest_is_stored(
    make_store: ServerFactory,
) -> None:
    store = make_store(capacity=4 * BLOCK)
    session = store.open().session_id
    response = store.stub.Put(
        pb.PutRequest(
            session_id=session,
            items=[
                pb.PutItem(block=pb.BlockRef(key=b"huge"), value=bytes(4 * BLOCK + 1)),
                pb.PutItem(block=pb.BlockRef(key=b"fine"), value=bytes(BLOCK)),
            ],
        ),
        timeout=5,
    )
    assert [r.status for r in response.results] == [pb.REJECTED, pb.STORED]
    assert "exceeds Limits.max_value_bytes of 4000 bytes" in response.results[0].reason


def test_get_with_lease_id_releases_the_lease(make_store: ServerFactory) -> None:
    store = make_store(capacity=4 * BLOCK)
    session = store.open().session_id
    store.put(session, (b"k1", bytes(BLOCK)))
    lease = store.lookup(session, b"k1").lease
    assert store.stats().leased_keys == 1
    [result] = store.get(session, b"k1", lease_id=lease.lease_id)
    assert result.status == pb.HIT
    assert store.stats().leased_keys == 0


def test_release_leases_unpins_and_the_block_becomes_evictable(make_store: ServerFactory) -> None:
    store = make_store(capacity=2 * BLOCK)
    session = store.open().session_id
    store.put(session, (b"k1", bytes(BLOCK)), (b"k2", bytes(BLOCK)))
    lease = store.lookup(session, b"k1", b"k2").lease
    store.stub.ReleaseLeases(
        pb.ReleaseLeasesRequest(session_id=session, lease_ids=[lease.lease_id]), timeout=5
    )
    assert store.stats().leased_keys == 0
    assert store.put(session, (b"k3", bytes(BLOCK))) == [pb.STORED]
    assert store.stats().evictions == 1


def test_leases_expire_on_their_own(make_store: ServerFactory) -> None:
    store = make_store(capacity=4 * BLOCK)
    session = store.open().session_id
    store.put(session, (b"k1", bytes(BLOCK)))
    response = store.stub.Lookup(
        pb.LookupRequest(session_id=session, blocks=[pb.BlockRef(key=b"k1")], lease_ms=200), timeout=5
    )
    assert response.lease.expires_in_ms == 200
    assert store.stats().leased_keys == 1
    deadline = time.monotonic() + 3
    while store.stats().leased_keys and time.monotonic() < deadline:
        time.sleep(0.05)
    assert store.stats().leased_keys == 0


def test_close_session_releases_its_leases(make_store: ServerFactory) -> None:
    store = make_store(capacity=4 * BLOCK)
    session = store.open().session_id
    store.put(session, (b"k1", bytes(BLOCK)))
    store.lookup(session, b"k1")
    store.stub.CloseSession(pb.CloseSessionRequest(session_id=session), timeout=5)
    assert store.stats().leased_keys == 0


def test_lease_requests_are_capped_at_the_maximum(make_store: ServerFactory) -> None:
    store = make_store(max_lease_ms=1000)
    session = store.open().session_id
    store.put(session, (b"k1", b"v"))
    response = store.stub.Lookup(
        pb.LookupRequest(session_id=session, blocks=[pb.BlockRef(key=b"k1")], lease_ms=3_600_000), timeout=5
    )
    assert response.lease.expires_in_ms == 1000


def test_lookup_prefix_stops_at_the_first_non_hit(make_store: ServerFactory) -> None:
    store = make_store()
    session = store.open().session_id
    store.put(session, (b"a", b"1"), (b"b", b"2"), (b"d", b"4"))
    answer = store.lookup(session, b"a", b"b", b"c", b"d")
    assert answer.prefix_length == 2
    assert list(answer.statuses) == [pb.HIT, pb.HIT, pb.MISS, pb.HIT]


def test_a_lease_taken_in_one_session_is_released_by_a_get_in_another_session_of_the_namespace(
    make_store: ServerFactory,
) -> None:
    """The connector's scheduler looks up in its session; its workers load in their own."""
    store = make_store(capacity=2 * BLOCK)
    scheduler = store.open("engine-a").session_id
    worker = store.open("engine-a").session_id
    store.put(scheduler, (b"k1", bytes(BLOCK)), (b"k2", bytes(BLOCK)))
    lease = store.lookup(scheduler, b"k1", b"k2").lease
    assert store.stats().leased_keys == 2
    results = store.get(worker, b"k1", b"k2", lease_id=lease.lease_id)
    assert [r.status for r in results] == [pb.HIT, pb.HIT]
    assert store.stats().leased_keys == 0
    assert store.put(worker, (b"k3", bytes(BLOCK))) == [pb.STORED]
    assert store.stats().evictions == 1
    # Releasing it again, from either session, is a no-op.
    store.stub.ReleaseLeases(
        pb.ReleaseLeasesRequest(session_id=scheduler, lease_ids=[lease.lease_id]), timeout=5
    )


def test_release_leases_from_another_session_of_the_namespace_unpins(make_store: ServerFactory) -> None:
    store = make_store(capacity=4 * BLOCK)
    scheduler = store.open("engine-a").session_id
    worker = store.open("engine-a").session_id
    store.put(scheduler, (b"k1", bytes(BLOCK)))
    lease = store.lookup(scheduler, b"k1").lease
    store.stub.ReleaseLeases(
        pb.ReleaseLeasesRequest(session_id=worker, lease_ids=[lease.lease_id]), timeout=5
    )
    assert store.stats().leased_keys == 0


def test_a_session_of_another_namespace_cannot_release_a_lease(make_store: ServerFactory) -> None:
    store = make_store(capacity=4 * BLOCK)
    owner = store.open("engine-a").session_id
    stranger = store.open("engine-b", ns=namespace(model="another-model")).session_id
    store.put(owner, (b"k1", bytes(BLOCK)))
    lease = store.lookup(owner, b"k1").lease
    store.stub.ReleaseLeases(
        pb.ReleaseLeasesRequest(session_id=stranger, lease_ids=[lease.lease_id]), timeout=5
    )
    store.get(stranger, b"k1", lease_id=lease.lease_id)
    assert store.stats().leased_keys == 1


def test_lease_ids_are_unguessable_tokens(make_store: ServerFactory) -> None:
    store = make_store(capacity=4 * BLOCK)
    session = store.open().session_id
    store.put(session, (b"k1", bytes(BLOCK)))
    ids = {store.lookup(session, b"k1").lease.lease_id for _ in range(50)}
    assert len(ids) == 50
    for lease_id in ids:
        token = lease_id.removeprefix("l-")
        assert len(token) == 32 and int(token, 16) >= 0  # 128 random bits, hex
    # No shared prefix beyond chance: ids are not a counter under a per-process prefix.
    tokens = sorted(lease_id.removeprefix("l-") for lease_id in ids)
    assert len({t[:8] for t in tokens}) > 40


def _lookup_packed(store: Store, session: str, *keys: bytes) -> pb.LookupResponse:
    runs = [pb.PackedBlocks(key_length=2, keys=b"".join(keys))]
    response: pb.LookupResponse = store.stub.Lookup(
        pb.LookupRequest(session_id=session, packed_blocks=runs), timeout=5
    )
    return response


def test_a_packed_lookup_lease_holds_exactly_its_hits_against_eviction(make_store: ServerFactory) -> None:
    """The packed form pins its hits as one lease object, not per key: eviction still skips exactly
    those blocks."""
    store = make_store(capacity=3 * BLOCK)
    session = store.open().session_id
    store.put(session, (b"k1", bytes(BLOCK)), (b"k2", bytes(BLOCK)), (b"k3", bytes(BLOCK)))
    assert _lookup_packed(store, session, b"k1", b"k3", b"kx").lease.lease_id
    assert store.stats().leased_keys == 2
    assert store.put(session, (b"n1", bytes(BLOCK))) == [pb.STORED]  # k1 is older but leased
    statuses = list(_lookup_packed(store, session, b"k1", b"k2", b"k3", b"n1").packed_statuses)
    assert statuses == [pb.HIT, pb.MISS, pb.HIT, pb.HIT]
    assert store.stats().evictions == 1


def test_a_store_full_of_packed_leases_rejects_until_they_are_released(make_store: ServerFactory) -> None:
    store = make_store(capacity=2 * BLOCK)
    session = store.open().session_id
    store.put(session, (b"k1", bytes(BLOCK)), (b"k2", bytes(BLOCK)))
    lease = _lookup_packed(store, session, b"k1", b"k2").lease
    response = store.stub.Put(
        pb.PutRequest(
            session_id=session, items=[pb.PutItem(block=pb.BlockRef(key=b"n1"), value=bytes(BLOCK))]
        ),
        timeout=5,
    )
    [result] = response.results
    assert result.status == pb.REJECTED
    assert f"{2 * BLOCK} of {2 * BLOCK} bytes are leased" in result.reason
    store.stub.ReleaseLeases(
        pb.ReleaseLeasesRequest(session_id=session, lease_ids=[lease.lease_id]), timeout=5
    )
    assert store.stats().leased_keys == 0
    assert store.put(session, (b"n1", bytes(BLOCK))) == [pb.STORED]
    assert store.stats().evictions == 1


def test_an_inline_get_serves_from_pinned_slots_and_leaves_nothing_pinned(make_store: ServerFactory) -> None:
    """Get replies are built straight from the values' slots, pinned while they are copied: after the
    answer nothing stays pinned, so the blocks are evictable again, and the bytes are exact."""
    store = make_store(capacity=2 * BLOCK)
    session = store.open().session_id
    values = {b"k1": bytes(range(256)) * 3, b"k2": bytes(reversed(range(256))) * 3}  # 768 B each
    store.put(session, *values.items())
    results = store.get(session, b"k1", b"k2", b"kx")
    assert [(r.status, r.value) for r in results] == [
        (pb.HIT, values[b"k1"]),
        (pb.HIT, values[b"k2"]),
        (pb.MISS, b""),
    ]
    assert store.stats().leased_keys == 0
    assert store.put(session, (b"n1", bytes(BLOCK)), (b"n2", bytes(BLOCK))) == [pb.STORED, pb.STORED]
    assert store.stats().evictions == 2
