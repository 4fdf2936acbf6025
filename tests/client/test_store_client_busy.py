"""StoreClient against a store answering SERVER_BUSY (its admission limit reached, injected by the
proxy in front of a real store): the busy Put is a counted drop, the session and the connection stay,
and the messages answered before it keep their results."""

from __future__ import annotations

import logging

import pytest
from kvtag.v1 import store_pb2 as pb
from kvtag_client import keys
from kvtag_client.store import StoreState

from tests.store_process import StoreProcess

from .conftest import ClientFactory
from .fault_proxy import FaultProxy

VALUE = 256 << 10  # a few values per Put message (messages are ~256 KiB to ~1 MiB)


def _items(count: int, marker_at: int | None = None) -> list[tuple[int, bytes, bytes, bytes]]:
    blocks = keys.block_keys(list(range(5000, 5000 + 16 * count)), 16, 0)
    items = []
    for n, key in enumerate(blocks):
        fill = b"BUSY-MARKER" if n == marker_at else b"v%d-" % n
        items.append((0, key, (fill * (VALUE // len(fill) + 1))[:VALUE], b""))
    return items


def test_a_busy_store_drops_the_put_and_keeps_the_session(
    shared_store: StoreProcess, make_client: ClientFactory, caplog: pytest.LogCaptureFixture
) -> None:
    proxy = FaultProxy(shared_store.endpoint)
    try:
        client = make_client(proxy.endpoint, tenant="busy", data_path="inline")
        assert client.open()
        session = client.session_id
        proxy.busy_marker = b"BUSY-MARKER"
        with caplog.at_level(logging.WARNING, logger="kvtag_client"):
            assert client.put(_items(1, marker_at=0)) is None
        assert proxy.busy_calls == 1
        assert client.counters.put_dropped == 1 and client.counters.degraded_calls == 1
        # Busy is not an outage: no warning, no reconnect, the same session serves the next call.
        assert client.state is StoreState.CONNECTED and client.session_id == session
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
        assert client.put(_items(2)) == [pb.STORED] * 2
    finally:
        proxy.close()


def test_a_put_busy_part_way_keeps_the_results_of_the_messages_answered_before(
    shared_store: StoreProcess, make_client: ClientFactory
) -> None:
    proxy = FaultProxy(shared_store.endpoint)
    try:
        client = make_client(proxy.endpoint, tenant="busy-part-way", data_path="inline")
        assert client.open()
        proxy.busy_marker = b"BUSY-MARKER"
        items = _items(12, marker_at=8)  # 12 x 256 KiB: the marker is in the third message or later
        results = client.put(items)
        assert results is not None and proxy.busy_calls == 1
        # Every message before the busy one was answered: its items keep their results.
        assert results[:4] == [pb.STORED] * 4
        assert results[8] == pb.PUT_STATUS_UNSPECIFIED
        assert set(results) <= {pb.STORED, pb.PUT_STATUS_UNSPECIFIED}
        dropped = results.count(pb.PUT_STATUS_UNSPECIFIED)
        assert client.counters.put_dropped == dropped and client.counters.put_stored == len(items) - dropped
        # What the client reported stored is readable, byte for byte.
        stored = [n for n, r in enumerate(results) if r == pb.STORED]
        got = client.get([(0, items[n][1]) for n in stored])
        assert [bytes(v) if v is not None else None for v in got] == [items[n][2] for n in stored]
        assert client.state is StoreState.CONNECTED
    finally:
        proxy.close()
