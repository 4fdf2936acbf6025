"""Spare slots (CommitSlotsRequest.spare_lengths): a shared-memory put in one round trip, against a
real kvtag-store process. The slots are bound to their keys only at commit, so the tests check that
this changes nothing a reader or the accounting can see: exact bytes, mode tags, no overwrite,
bounded and freed capacity, and refusals for every malformed form."""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from kvtag.v1 import store_pb2 as pb
from kvtag.v1 import store_pb2_grpc
from kvtag_client.store import StoreClient

from tests.store_process import StoreProcess

from .conftest import ClientFactory, StoreFactory


def _stats(endpoint: str) -> pb.GetStatsResponse:
    with grpc.insecure_channel(endpoint) as channel:
        stub = store_pb2_grpc.KvStoreStub(channel)  # type: ignore[no-untyped-call]
        response: pb.GetStatsResponse = stub.GetStats(pb.GetStatsRequest(), timeout=10)
        return response


class _CountingStub:
    """The client's own stub, counting the RPCs it makes."""

    def __init__(self, stub: Any) -> None:
        self.stub = stub
        self.calls: Counter[str] = Counter()

    def __getattr__(self, name: str) -> Callable[..., Any]:
        call = getattr(self.stub, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            return call(*args, **kwargs)

        return counted


def _shm_client(make_client: ClientFactory, endpoint: str, **kwargs: object) -> StoreClient:
    client = make_client(endpoint, **kwargs)
    assert client.open() and client.data_path == "shared_memory"
    return client


def _held(client: StoreClient) -> int:
    return sum(client.shm.spares.held().values())


def test_a_put_after_the_first_takes_one_round_trip_and_stores_exact_bytes(
    shared_store: StoreProcess, make_client: ClientFactory
) -> None:
    client = _shm_client(make_client, shared_store.endpoint, tenant="spare-exact")
    counting = _CountingStub(client.session.stub)
    client.session.stub = counting  # type: ignore[assignment]
    batches = [[(0, f"b{b}-{i}".encode(), os.urandom(4096 + i), b"") for i in range(8)] for b in range(4)]
    assert client.put(batches[0]) == [pb.STORED] * 8
    assert counting.calls == Counter(ReserveSlots=1, CommitSlots=1)
    assert _held(client) == 8  # one spare per item of the batch, of its length
    for batch in batches[1:]:
        assert client.put(batch) == [pb.STORED] * 8
    assert counting.calls == Counter(ReserveSlots=1, CommitSlots=4)
    reader = make_client(shared_store.endpoint, tenant="spare-exact", data_path="inline")
    assert reader.open() and reader.data_path == "inline"
    for batch in batches:
        assert reader.get([(g, k) for g, k, _, _ in batch]) == [v for _, _, v, _ in batch]
    # A put of other lengths gives the spares back (one ReserveSlots again) and holds its own.
    other = [(0, f"other-{i}".encode(), os.urandom(100), b"") for i in range(3)]
    assert client.put(other) == [pb.STORED] * 3
    assert counting.calls["ReserveSlots"] == 2
    assert client.shm.spares.held() == {100: 3}


def test_a_spare_slot_never_overwrites_a_stored_block_and_keeps_its_mode(
    shared_store: StoreProcess, make_client: ClientFactory
) -> None:
    """Keys are bound at commit: a key already stored answers ALREADY_PRESENT (its bytes unchanged),
    one another mode holds answers CONFLICT, and only the new key is stored."""
    writer = _shm_client(make_client, shared_store.endpoint, tenant="spare-modes")
    lookahead = _shm_client(make_client, shared_store.endpoint, lookahead_tokens=1, tenant="spare-modes")
    assert writer.put([(0, b"first", b"1" * 64, b""), (0, b"second", b"2" * 64, b"")]) == [pb.STORED] * 2
    assert lookahead.put([(0, b"theirs", b"t" * 64, b"")]) == [pb.STORED]
    assert _held(writer) == 2
    again = [(0, b"first", b"X" * 64, b""), (0, b"theirs", b"Y" * 64, b"")]
    reservation = writer.reserve([(g, k, len(v), b) for g, k, v, b in again])
    assert reservation is not None and reservation.spare
    assert reservation.statuses == [pb.PUT_STATUS_UNSPECIFIED] * 2  # not known before the commit
    for slot, (_, _, value, _) in zip(reservation.slots, again, strict=True):
        assert slot is not None
        slot[:] = value
    assert writer.commit(reservation) == [pb.ALREADY_PRESENT, pb.CONFLICT]
    # The same answer on the wire: packed statuses, and a reason only for the CONFLICT.
    gens = writer.reserve([(0, b"first", 64, b""), (0, b"theirs", 64, b"")])
    assert gens is not None and gens.spare
    wire = writer.session.stub.CommitSlots(
        pb.CommitSlotsRequest(
            session_id=writer.session_id,
            generations=[g for g in gens.generations if g is not None],
            packed_items=[
                pb.PackedBlocks(key_length=5, keys=b"first"),
                pb.PackedBlocks(key_length=6, keys=b"theirs"),
            ],
        ),
        timeout=10,
    )
    assert list(wire.packed_statuses) == [pb.ALREADY_PRESENT, pb.CONFLICT] and not wire.results
    assert len(wire.packed_reasons) == 1 and "held by mode" in wire.packed_reasons[0]
    assert writer.get([(0, b"first"), (0, b"theirs")]) == [b"1" * 64, None]
    assert lookahead.get([(0, b"theirs")]) == [b"t" * 64]


def test_spares_stay_within_a_sixteenth_of_capacity_and_are_freed_with_their_session(
    start_store: StoreFactory, make_client: ClientFactory
) -> None:
    store = start_store("--capacity", "1MiB")
    client = _shm_client(make_client, store.endpoint)
    batch = [(0, f"k{i}".encode(), os.urandom(16 << 10), b"") for i in range(8)]
    assert client.put(batch) == [pb.STORED] * 8
    stats = _stats(store.endpoint)
    # 64 KiB of spare room: 4 of the 8 asked for.
    assert _held(client) == 4 and stats.reserved_bytes == stats.spare_bytes == 4 * (16 << 10)
    assert stats.used_bytes == 8 * (16 << 10)
    # Too few spares for the next batch: it reserves (two round trips) and stays exact.
    assert client.put([(0, f"n{i}".encode(), os.urandom(16 << 10), b"") for i in range(8)]) == [pb.STORED] * 8
    client.close()
    stats = _stats(store.endpoint)
    assert stats.reserved_bytes == stats.spare_bytes == 0


def test_spares_older_than_half_a_session_ttl_are_not_written_but_given_back(
    start_store: StoreFactory, make_client: ClientFactory
) -> None:
    """Past half a TTL since the granting call the client cannot know its session is still alive at
    the store (which would then have freed the slots to other writers): it reserves again instead,
    and the next commit cancels the stale spares."""
    store = start_store("--session-ttl-ms", "1000")
    client = _shm_client(make_client, store.endpoint)
    counting = _CountingStub(client.session.stub)
    client.session.stub = counting  # type: ignore[assignment]
    assert client.put([(0, b"early", b"e" * 128, b"")]) == [pb.STORED]
    assert _held(client) == 1
    time.sleep(0.6)
    assert client.put([(0, b"late", b"l" * 128, b"")]) == [pb.STORED]
    assert counting.calls["ReserveSlots"] == 2
    assert _held(client) == 1  # a fresh one; the stale one was cancelled
    assert _stats(store.endpoint).reserved_bytes == 128
    assert client.get([(0, b"early"), (0, b"late")]) == [b"e" * 128, b"l" * 128]


def test_commit_slots_refuses_or_rejects_every_malformed_spare_form(
    shared_store: StoreProcess, make_client: ClientFactory
) -> None:
    client = _shm_client(make_client, shared_store.endpoint, tenant="spare-forms")
    stub, sid = client.session.stub, client.session_id
    before = _stats(shared_store.endpoint).reserved_bytes

    def commit(**fields: Any) -> pb.CommitSlotsResponse:
        response: pb.CommitSlotsResponse = stub.CommitSlots(
            pb.CommitSlotsRequest(session_id=sid, **fields), timeout=10
        )
        return response

    granted = commit(spare_lengths=[10, 10, 0, client.limits.max_value_bytes + 1]).spare
    assert list(granted.statuses) == [pb.PUT_STATUS_UNSPECIFIED] * 2 + [pb.REJECTED] * 2
    assert "exceeds" in granted.reasons[1] and len(granted.generations) == 2
    assert _stats(shared_store.endpoint).reserved_bytes == before + 20
    spare_a, spare_b = granted.generations

    # A key count that is not the generation count is refused outright.
    with pytest.raises(grpc.RpcError) as refused:
        commit(generations=[spare_a, spare_b], packed_items=[pb.PackedBlocks(key_length=4, keys=b"abcd")])
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "packed_items" in str(refused.value.details())

    # A spare committed without its key, and a ReserveSlots slot committed with one, are rejected
    # and freed (the session no longer holds them).
    keyed = client.reserve([(0, b"keyed", 10, b"")])
    assert keyed is not None and keyed.generations[0] is not None and not keyed.spare
    no_key = commit(generations=[spare_a])
    assert [r.status for r in no_key.results] == [pb.REJECTED] and "its key" in no_key.results[0].reason
    with_key = commit(
        generations=[keyed.generations[0]], packed_items=[pb.PackedBlocks(key_length=5, keys=b"keyed")]
    )
    # With packed_items the results come packed too: a status byte each, reasons of the refused.
    assert not with_key.results and list(with_key.packed_statuses) == [pb.REJECTED]
    assert len(with_key.packed_reasons) == 1 and "ReserveSlots" in with_key.packed_reasons[0]

    # The other spare is cancelled unwritten: all reserved bytes are back, nothing was stored.
    assert list(commit(cancel_generations=[spare_b]).results) == []
    assert _stats(shared_store.endpoint).reserved_bytes == before
    assert client.get([(0, b"keyed")]) == [None]


def test_an_inline_session_is_granted_no_spares(
    shared_store: StoreProcess, make_client: ClientFactory
) -> None:
    client = make_client(shared_store.endpoint, tenant="spare-inline", data_path="inline")
    assert client.open() and client.data_path == "inline"
    response = client.session.stub.CommitSlots(
        pb.CommitSlotsRequest(session_id=client.session_id, spare_lengths=[10]), timeout=10
    )
    assert (
        list(response.spare.statuses) == [pb.REJECTED] and "AttachSharedMemory" in response.spare.reasons[0]
    )
