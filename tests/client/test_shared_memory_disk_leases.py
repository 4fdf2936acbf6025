"""Every block a Lookup reported as a hit loads while its lease holds, on the shared-memory path
(issue 42): StoreClient against a real `kvtag-store serve` restarted on its disk tier, a working set six
times memory leased by one Lookup and copied out of arena slots in Gets of 8 MiB, then in one Get
larger than memory (read around it into slots the Get's read lease holds)."""

from __future__ import annotations

import hashlib
from functools import partial
from pathlib import Path

import grpc
from kvtag.v1 import store_pb2 as pb
from kvtag.v1 import store_pb2_grpc

from tests.net import wait_until
from tests.store_process import StoreProcess

from .conftest import ClientFactory, StoreFactory

MIB = 1 << 20
COUNT = 96  # x 1 MiB: six times the memory
BATCH = 8


def value_of(key: bytes) -> bytes:
    seed = hashlib.sha256(key).digest()
    return (seed * (MIB // len(seed) + 1))[:MIB]


def _stats(endpoint: str) -> pb.GetStatsResponse:
    with grpc.insecure_channel(endpoint) as channel:
        stub = store_pb2_grpc.KvStoreStub(channel)  # type: ignore[no-untyped-call]
        response: pb.GetStatsResponse = stub.GetStats(pb.GetStatsRequest(), timeout=10)
        return response


def _on_disk(endpoint: str, count: int) -> bool:
    return sum(t.keys for t in _stats(endpoint).tiers if t.tier == "disk") >= count


def test_leased_hits_six_times_memory_load_on_the_shared_memory_path_after_a_restart(
    start_store: StoreFactory, make_client: ClientFactory, tmp_path: Path
) -> None:
    store: StoreProcess = start_store(
        "--capacity", "16MiB", "--disk-dir", str(tmp_path / "disk"), "--disk-capacity", "512MiB"
    )
    keys = [f"shm-leased-{i:03d}".encode() for i in range(COUNT)]
    writer = make_client(store.endpoint, tenant="disk")
    assert writer.open() and writer.data_path == "shared_memory"
    for i in range(0, COUNT, BATCH):
        chunk = keys[i : i + BATCH]
        assert writer.put([(0, k, value_of(k), b"") for k in chunk]) == [pb.STORED] * len(chunk)
        wait_until(partial(_on_disk, store.endpoint, i + BATCH), 60, f"{i + BATCH} values on disk")
    writer.close()
    store.stop()  # SIGTERM: memory starts empty, every value is on disk only
    store.start()

    reader = make_client(store.endpoint, tenant="disk")
    assert reader.open() and reader.data_path == "shared_memory"
    blocks = [(0, k) for k in keys]
    lookup = reader.lookup([(0, k, b"") for k in keys])
    assert lookup.statuses == [pb.HIT] * COUNT and lookup.leases
    got: list[bytes | None] = []
    for i in range(0, COUNT, BATCH):
        got += [bytes(v) if v is not None else None for v in reader.get(blocks[i : i + BATCH])]
    missing = [k for k, v in zip(keys, got, strict=True) if v is None]
    assert not missing, f"{len(missing)} of {COUNT} leased hits did not load: {missing[:4]}"
    assert all(v == value_of(k) for k, v in zip(keys, got, strict=True)), "byte-exact"
    # 24 MiB in one call: more than the whole memory, read around it.
    wide = blocks[:24]
    assert reader.get(wide) == [value_of(k) for _, k in wide]
    # 48 MiB in one call under the lease: past memory and the read-around slots together (up to the
    # pool's size), so the store answers part; the client asks again for the rest once the first
    # part's slots are freed (the connector's load is one such call per request).
    wider = blocks[24:72]
    assert reader.get(wider, lookup.leases) == [value_of(k) for _, k in wider]
    stats = _stats(store.endpoint)
    assert stats.used_bytes <= 16 * MIB and stats.reserved_bytes == 0
    # The read leases are released soon after each get: the read-around slots go with them.
    wait_until(lambda: _stats(store.endpoint).leased_keys == 0, 10, "read leases released")
