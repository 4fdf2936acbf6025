"""The disk tier through a real gRPC server and StoreClient: blocks that outlived a restart (held on
disk only) come back byte-exact on the shared-memory path and inline, and a wrong-mode session gets
no bytes."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvtag.v1 import store_pb2 as pb
from kvtag_client import keys
from kvtag_client.store import StoreClient
from kvtag_store.app.server import RunningServer, start_server
from kvtag_store.backends.memory import MemoryBackend, MemoryCensus
from kvtag_store.config import ServiceConfig

from tests.descriptors import namespace

BLOCK = 256 << 10


class Served:
    """A store on 127.0.0.1 whose memory backend keeps its disk tier (and arena files) in tmp dirs."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.server: RunningServer | None = None
        self.backend: MemoryBackend | None = None
        self.clients: list[StoreClient] = []

    def start(self) -> str:
        (self.root / "shm").mkdir(exist_ok=True)
        self.backend = MemoryBackend(
            4 << 20,
            shm_dir=str(self.root / "shm"),
            prefault="lazy",
            disk_dir=str(self.root / "disk"),
            disk_capacity=64 << 20,
            disk_segment_bytes=4 << 20,
        )
        self.server = start_server(self.backend, MemoryCensus(), ServiceConfig(), listen="127.0.0.1:0")
        return str(self.server.address)

    def client(self, lookahead: int = 0, data_path: str = "auto") -> StoreClient:
        assert self.server is not None
        client = StoreClient(
            self.server.address,
            engine_id=f"engine-{len(self.clients)}",
            namespace=namespace(tenant="disk"),
            mode=keys.mode(16, lookahead),
            probe_keys=keys.probe_keys(16, lookahead),
            rpc_timeout_s=10.0,
            data_path=data_path,
        )
        assert client.open()
        self.clients.append(client)
        return client

    def stop(self) -> None:
        """As on SIGTERM: stop serving, then close the backend (which flushes memory to disk)."""
        for client in self.clients:
            client.close()
        self.clients = []
        if self.server is not None:
            self.server.stop(grace=0)
            self.server = None


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    store = Served(tmp_path)
    yield store
    store.stop()


def test_blocks_held_on_disk_only_after_a_restart_come_back_byte_exact(served: Served) -> None:
    served.start()
    writer = served.client()
    assert writer.data_path == "shared_memory"
    blocks = [(0, f"block-{i}".encode(), os.urandom(BLOCK), b"") for i in range(24)]  # 6 MiB > 4 MiB memory
    assert served.backend is not None
    disk = served.backend.disk_tier()
    assert disk is not None
    for start in range(0, len(blocks), 4):
        assert writer.put(blocks[start : start + 4]) == [pb.STORED] * 4
        assert disk.drain()  # paced as the writer goes: a burst past 1/8 of memory may drop spills
    served.stop()

    served.start()
    assert served.backend is not None
    assert served.backend.stats().tiers[0].keys == 0  # memory is empty: everything is on disk
    shm = served.client()
    assert shm.data_path == "shared_memory"
    lookup = shm.lookup([(g, k, b"") for g, k, _, _ in blocks])
    assert list(lookup.statuses) == [pb.HIT] * len(blocks)
    shm.release(lookup.leases)
    # The shared-memory path: each disk-resident block is read into the slot the client copies from.
    for start in range(0, 8, 4):
        chunk = blocks[start : start + 4]
        assert [bytes(v) if v is not None else None for v in shm.get([(g, k) for g, k, _, _ in chunk])] == [
            v for _, _, v, _ in chunk
        ]
    copies: dict[int, bytes] = {}

    def sink(index: int, slot: memoryview) -> bool:
        copies[index] = bytes(slot)
        return True

    chunk = blocks[8:12]
    assert shm.get_into([(g, k) for g, k, _, _ in chunk], (), sink) == [True] * 4
    assert [copies[i] for i in range(4)] == [v for _, _, v, _ in chunk]
    # Inline, the reply is built from the slot the block was read back into.
    inline = served.client(data_path="inline")
    assert inline.data_path == "inline"
    for start in range(12, 24, 4):
        chunk = blocks[start : start + 4]
        got = inline.get([(g, k) for g, k, _, _ in chunk])
        assert [bytes(v) if v is not None else None for v in got] == [v for _, _, v, _ in chunk]
    disk_row = served.backend.stats().tiers[1]
    assert disk_row.reads_back >= len(blocks) and disk_row.corrupted_dropped == 0


def test_a_wrong_mode_session_gets_no_bytes_from_disk(served: Served) -> None:
    served.start()
    legacy = served.client(lookahead=0)
    blocks = [(0, f"k-{i}".encode(), os.urandom(4096), b"") for i in range(4)]
    assert legacy.put(blocks) == [pb.STORED] * 4
    served.stop()

    served.start()
    lookahead = served.client(lookahead=1)
    refs = [(g, k) for g, k, _, _ in blocks]
    lookup = lookahead.lookup([(g, k, b"") for g, k in refs])
    assert pb.HIT not in list(lookup.statuses)
    assert lookahead.get(refs) == [None] * 4
    assert lookahead.put(blocks[:1]) == [pb.CONFLICT]
    assert [bytes(v) if v is not None else None for v in served.client(lookahead=0).get(refs)] == [
        v for _, _, v, _ in blocks
    ]
