"""Every block a Lookup reported as a hit loads while its lease holds, through a real `kvtag-store
serve` process restarted on its disk tier (issue 42): a working set six times memory, leased whole by
one Lookup, read back in Gets that each fit in memory, and in one Get larger than memory.

Before the fix the promoted blocks stayed pinned by the Lookup's lease, memory filled after two
batches, and 16 of 96 values came back."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import grpc
import pytest
from kvtag.v1 import store_pb2 as pb
from kvtag.v1 import store_pb2_grpc

from tests.net import wait_until
from tests.store_process import StoreProcess, store_starter

from .test_disk_restart import Engine, disk_row, on_disk_at_least

MIB = 1 << 20
COUNT = 96  # x 1 MiB: six times the memory
BATCH = 8  # 8 MiB a Get: each fits in memory on its own
SERVE = ("--capacity", "16MiB", "--disk-capacity", "512MiB", "--max-message-bytes", "64MiB")


class WideEngine(Engine):
    """Engine on a channel that takes messages of 8 MiB and more (a batch of 1 MiB values)."""

    def __init__(self, endpoint: str) -> None:
        super().__init__(endpoint)
        self.channel.close()
        self.channel = grpc.insecure_channel(
            endpoint,
            options=[
                ("grpc.max_receive_message_length", 64 * MIB),
                ("grpc.max_send_message_length", 64 * MIB),
            ],
        )
        self.stub = store_pb2_grpc.KvStoreStub(self.channel)  # type: ignore[no-untyped-call]


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Any]:
    with store_starter(tmp_path) as starter:
        yield starter


def value_of(key: bytes) -> bytes:
    seed = hashlib.sha256(key).digest()
    return (seed * (MIB // len(seed) + 1))[:MIB]


def _put(engine: Engine, keys: list[bytes]) -> None:
    """In batches of 8, each on disk before the next (a put never waits for the disk writer)."""
    for i in range(0, len(keys), BATCH):
        items = [pb.PutItem(block=pb.BlockRef(key=k), value=value_of(k)) for k in keys[i : i + BATCH]]
        answer = engine.stub.Put(pb.PutRequest(session_id=engine.session_id, items=items), timeout=60)
        assert {r.status for r in answer.results} == {pb.STORED}
        wait_until(partial(on_disk_at_least, engine, i + BATCH), 60, f"{i + BATCH} values on disk")


def _get(engine: Engine, keys: list[bytes]) -> list[tuple[int, bytes]]:
    refs = [pb.BlockRef(key=k) for k in keys]
    answer = engine.stub.Get(pb.GetRequest(session_id=engine.session_id, blocks=refs), timeout=60)
    return [(r.status, bytes(r.value)) for r in answer.results]


def test_a_lookup_leasing_a_working_set_six_times_memory_loads_every_block_after_a_restart(
    start: Any, tmp_path: Path
) -> None:
    keys = [f"leased-{i:03d}".encode() for i in range(COUNT)]
    store: StoreProcess = start(*SERVE, "--disk-dir", str(tmp_path / "disk"))
    engine = WideEngine(store.endpoint)
    _put(engine, keys)
    engine.close()
    store.stop()  # SIGTERM: everything is on disk, memory starts empty
    store.start()
    engine = WideEngine(store.endpoint)
    lookup = engine.stub.Lookup(
        pb.LookupRequest(session_id=engine.session_id, blocks=[pb.BlockRef(key=k) for k in keys]), timeout=60
    )
    assert list(lookup.statuses) == [pb.HIT] * COUNT and lookup.lease.lease_id
    # The connector's flow: the scheduler's Lookup leases every hit, the worker Gets them in batches.
    got: list[tuple[int, bytes]] = []
    for i in range(0, COUNT, BATCH):
        got += _get(engine, keys[i : i + BATCH])
    missing = [k for k, (status, _) in zip(keys, got, strict=True) if status != pb.HIT]
    assert not missing, f"{len(missing)} of {COUNT} leased hits did not load: {missing[:4]}"
    assert all(v == value_of(k) for k, (_, v) in zip(keys, got, strict=True)), "byte-exact"
    # One Get of 24 MiB under the same lease, more than the whole memory: read around it.
    wide = keys[:24]
    assert _get(engine, wide) == [(pb.HIT, value_of(k)) for k in wide]
    stats = engine.stats()
    assert stats.used_bytes <= 16 * MIB and stats.reserved_bytes == 0
    assert disk_row(stats).reads_back >= COUNT + len(wide) - 16
    engine.stub.ReleaseLeases(
        pb.ReleaseLeasesRequest(session_id=engine.session_id, lease_ids=[lookup.lease.lease_id]), timeout=10
    )
    engine.close()
