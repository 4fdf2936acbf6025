"""Fixtures: an in-process kvtag-store on a free loopback port, stubs and session helpers."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # `tests.contract` imports resolve from the repository root
    sys.path.insert(0, str(REPO))

from kvtag.v1 import store_pb2 as pb  # noqa: E402
from kvtag.v1 import store_pb2_grpc  # noqa: E402
from kvtag_store.app.server import RunningServer, start_server  # noqa: E402
from kvtag_store.backends.memory import MemoryBackend, MemoryCensus  # noqa: E402
from kvtag_store.config import ServiceConfig  # noqa: E402

from .helpers import Store  # noqa: E402

ServerFactory = Callable[..., Store]


@pytest.fixture
def make_store() -> Iterator[ServerFactory]:
    """make_store(capacity=..., **ServiceConfig fields) -> a Store on a fresh server, stopped at teardown."""
    running: list[tuple[RunningServer, grpc.Channel]] = []

    def factory(capacity: int = 64 << 20, **config: Any) -> Store:
        backend = MemoryBackend(capacity)
        server = start_server(backend, MemoryCensus(), ServiceConfig(**config), listen="127.0.0.1:0")
        limit = server.service.limits.max_message_bytes
        options = [("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)]
        channel = grpc.insecure_channel(server.address, options=options)
        running.append((server, channel))
        stub = store_pb2_grpc.KvStoreStub(channel)  # type: ignore[no-untyped-call]
        return Store(server=server, stub=stub, backend=backend, channel=channel)

    yield factory
    for server, channel in running:
        channel.close()
        server.stop(grace=0)


@pytest.fixture
def store(make_store: ServerFactory) -> Store:
    return make_store()


__all__ = ["pb"]
