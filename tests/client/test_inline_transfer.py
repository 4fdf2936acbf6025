"""Large puts and gets over the inline path (several messages in flight) come back byte for byte."""

from __future__ import annotations

import hashlib

import grpc
from kvtag.v1 import store_pb2 as pb
from kvtag.v1 import store_pb2_grpc

from .conftest import ClientFactory, StoreFactory

SIZES = [64 << 10, 1 << 20, 3, 1 << 20, 700_001, 64 << 10, 2 << 20, 1] * 3


def _value(i: int, size: int) -> bytes:
    seed = hashlib.sha256(b"inline/%d" % i).digest()
    return (seed * (size // len(seed) + 1))[:size]


def test_a_batch_of_many_messages_round_trips_byte_exact(
    start_store: StoreFactory, make_client: ClientFactory
) -> None:
    own_store = start_store()
    client = make_client(own_store.endpoint, tenant="inline-exact", data_path="inline")
    assert client.open() and client.data_path == "inline"
    items = [(0, hashlib.sha256(b"k%d" % i).digest(), _value(i, size), b"") for i, size in enumerate(SIZES)]
    assert client.put(items) == [pb.STORED] * len(items)
    lookup = client.lookup([(g, k, b"") for g, k, _, _ in items], lease_ms=30_000)
    assert lookup.prefix_length == len(items)

    missing = [(0, hashlib.sha256(b"absent%d" % i).digest()) for i in range(3)]
    wanted = [(g, k) for g, k, _, _ in items]
    asked = wanted[:5] + missing[:1] + wanted[5:17] + missing[1:] + wanted[17:]
    got = client.get(asked, leases=lookup.leases)
    expected = [v for _, _, v, _ in items]
    assert got == [*expected[:5], None, *expected[5:17], None, None, *expected[17:]]
    with grpc.insecure_channel(own_store.endpoint) as channel:
        stats = store_pb2_grpc.KvStoreStub(channel).GetStats(pb.GetStatsRequest(), timeout=5)  # type: ignore[no-untyped-call]
    assert stats.leased_keys == 0, "the lookup lease is released once every message was read"
