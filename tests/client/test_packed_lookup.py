"""StoreClient.lookup sends Lookup's packed form: the answers of a per-block lookup, no message per key."""

from __future__ import annotations

import logging

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvtag.v1 import store_pb2 as pb
from kvtag.v1 import store_pb2_grpc
from kvtag_client.packed_keys import chunked
from kvtag_client.store import PackedKeys, pack_blocks

from tests.net import wait_until
from tests.store_process import StoreProcess

from .conftest import ClientFactory, StoreFactory
from .fault_proxy import FaultProxy

blocks_strategy = st.lists(
    st.tuples(
        st.sampled_from([0, 1, 7]),
        st.one_of(st.binary(min_size=32, max_size=32), st.binary(max_size=3)),
        st.one_of(st.just(b""), st.binary(min_size=32, max_size=32)),
    ),
    max_size=40,
)


def _sent(blocks: list[tuple[int, bytes, bytes]]) -> list[tuple[int, bytes, bytes]]:
    """The blocks as packed: a block without a key is never sent, so neither is its base key."""
    return [(g, k, b if k else b"") for g, k, b in blocks]


def _unpacked(runs: list[PackedKeys]) -> list[tuple[int, bytes, bytes]]:
    out: list[tuple[int, bytes, bytes]] = []
    for run in runs:
        keys = run.split_keys() if run.key_length else [b""]
        bases = run.split_base_keys() or [b""] * len(keys)
        out += [(run.group, key, base) for key, base in zip(keys, bases, strict=True)]
    return out


@settings(max_examples=200, deadline=None)
@given(blocks=blocks_strategy)
def test_packing_keeps_every_block_in_order(blocks: list[tuple[int, bytes, bytes]]) -> None:
    runs = pack_blocks(blocks)
    assert _unpacked(runs) == _sent(blocks)
    assert sum(run.count for run in runs) == len(blocks)


@settings(max_examples=200, deadline=None)
@given(blocks=blocks_strategy, limit=st.integers(1, 9))
def test_chunks_hold_at_most_the_batch_limit_and_cover_every_block(
    blocks: list[tuple[int, bytes, bytes]], limit: int
) -> None:
    runs = pack_blocks(blocks)
    chunks = list(chunked(runs, limit))
    assert all(0 < sum(r.count for r in chunk) <= limit for _, chunk in chunks)
    assert [offset for offset, _ in chunks] == [limit * i for i in range(len(chunks))]
    assert [b for _, chunk in chunks for b in _unpacked(chunk)] == _sent(blocks)


def _key(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8


@pytest.fixture
def small_batch_store(start_store: StoreFactory) -> StoreProcess:
    return start_store("--max-batch-items", "7")


def test_lookup_over_several_batches_stops_where_the_prefix_breaks(
    small_batch_store: StoreProcess, make_client: ClientFactory
) -> None:
    client = make_client(small_batch_store.endpoint, tenant="packed-chunks")
    assert client.open() and client.limits.max_batch_items == 7
    blocks = [(0, _key(i), b"") for i in range(30)]
    assert client.put([(0, _key(i), b"v%d" % i, b"") for i in range(17)]) == [pb.STORED] * 17
    result = client.lookup(blocks, lease_ms=5000)
    assert result.prefix_length == 17
    # Batches of 7: the third (keys 14..20) breaks the prefix, so keys 21.. are never asked.
    assert result.statuses == [pb.HIT] * 17 + [pb.MISS] * 4 + [pb.KEY_STATUS_UNSPECIFIED] * 9
    assert len(result.leases) == 3
    assert client.get([(0, _key(i)) for i in range(17)], leases=result.leases) == [
        b"v%d" % i for i in range(17)
    ]


@pytest.mark.parametrize("data_path", ["inline", "auto"])
def test_a_get_releases_every_lease_of_a_lookup_over_several_batches(
    small_batch_store: StoreProcess, make_client: ClientFactory, data_path: str
) -> None:
    """A lookup over three Lookup messages holds three leases; the Get that reads its hits releases
    all of them (on either data path), so nothing stays pinned until the 60 s leases expire."""
    client = make_client(small_batch_store.endpoint, tenant=f"leases-{data_path}", data_path=data_path)
    assert client.open()
    assert client.put([(0, _key(i), b"v%d" % i, b"") for i in range(17)]) == [pb.STORED] * 17
    result = client.lookup([(0, _key(i), b"") for i in range(17)], lease_ms=60000)
    assert result.prefix_length == 17 and len(result.leases) == 3
    assert _leased_keys(small_batch_store.endpoint) == 17
    assert client.get([(0, _key(i)) for i in range(17)], leases=result.leases) == [
        b"v%d" % i for i in range(17)
    ]
    wait_until(lambda: _leased_keys(small_batch_store.endpoint) == 0, 5, "every lookup lease released")


def _leased_keys(endpoint: str) -> int:
    with grpc.insecure_channel(endpoint) as channel:
        stub = store_pb2_grpc.KvStoreStub(channel)  # type: ignore[no-untyped-call]
        response: pb.GetStatsResponse = stub.GetStats(pb.GetStatsRequest(), timeout=10)
        return int(response.leased_keys)


def test_hybrid_runs_and_invalid_keys_get_their_own_statuses(
    shared_store: StoreProcess, make_client: ClientFactory
) -> None:
    client = make_client(shared_store.endpoint, tenant="packed-groups")
    assert client.open()
    assert client.put([(0, _key(i), b"kv", b"") for i in range(4)] + [(3, _key(1), b"state", b"")])
    too_long = b"k" * (client.limits.max_key_bytes + 1)
    blocks = (
        [(0, _key(i), _key(100 + i)) for i in range(5)]
        + [(3, _key(i), b"") for i in range(3)]
        + [(0, b"", b""), (0, too_long, b""), (3, _key(1), b"")]
    )
    result = client.lookup(blocks)
    hit, miss = pb.HIT, pb.MISS
    assert result.statuses == [hit] * 4 + [miss] + [miss, hit, miss] + [miss, miss, hit]
    assert result.prefix_length == 4


def test_a_store_without_the_packed_form_is_asked_in_the_v1_form(
    shared_store: StoreProcess, make_client: ClientFactory, caplog: pytest.LogCaptureFixture
) -> None:
    proxy = FaultProxy(shared_store.endpoint)
    try:
        proxy.v1_lookup.set()
        client = make_client(proxy.endpoint, tenant="packed-old-store")
        assert client.open()
        assert client.put([(0, _key(i), b"v", b"") for i in range(3)]) == [pb.STORED] * 3
        with caplog.at_level(logging.WARNING, logger="kvtag_client.store"):
            first = client.lookup([(0, _key(i), b"") for i in range(5)])
            second = client.lookup([(0, _key(i), b"") for i in range(5)])
        assert (first.prefix_length, first.statuses) == (second.prefix_length, second.statuses)
        assert (first.prefix_length, first.statuses) == (3, [pb.HIT] * 3 + [pb.MISS] * 2)
        assert sum("does not answer packed Lookups" in r.message for r in caplog.records) == 1
    finally:
        proxy.close()
