"""The client logs each sibling layout the store names at OpenSession (LAYOUT_SPLIT), once per
sibling, beside MODE_SPLIT: an engine whose hits are 0 because its model's blocks sit in another
layout is told so in its own log."""

from __future__ import annotations

import logging

import pytest
from kvtag.v1 import store_pb2 as pb
from kvtag_client import keys
from kvtag_client.store import StoreClient

from tests.descriptors import namespace
from tests.store_process import StoreProcess


def client(store: StoreProcess, engine: str, kv_layout: str, lookahead: int) -> StoreClient:
    ns = namespace(tenant="layouts")
    ns.kv_layout = kv_layout
    return StoreClient(
        store.endpoint,
        engine_id=engine,
        namespace=ns,
        mode=keys.mode(16, lookahead),
        probe_keys=keys.probe_keys(16, lookahead),
        rpc_timeout_s=5.0,
    )


def test_each_sibling_layout_is_logged_once(
    shared_store: StoreProcess, caplog: pytest.LogCaptureFixture
) -> None:
    producers = [client(shared_store, f"eagle-{n}", f"attn:{n}x65536", 1) for n in (5, 6)]
    consumer = client(shared_store, "plain", "attn:4x65536", 0)
    try:
        for producer in producers:  # the second is told of the first: that is right, and not this test's
            assert producer.open()
            key = keys.block_keys(list(range(32)), 16, 1)[0]
            assert producer.put([(0, key, b"eagle bytes", b"")]) == [pb.STORED]
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="kvtag_client.store"):
            assert consumer.open()
            consumer.session._log_warnings(consumer.warnings)  # a re-open logs nothing new
        siblings = {w.other_namespace_id for w in consumer.warnings if w.kind == "LAYOUT_SPLIT"}
        assert siblings == {p.namespace_id for p in producers}
        logged = [r.getMessage() for r in caplog.records if "census warning LAYOUT_SPLIT" in r.getMessage()]
        assert len(logged) == 2
        for producer in producers:
            assert sum(f"(other namespace {producer.namespace_id})" in line for line in logged) == 1
        assert all("kv_layout `attn:" in line for line in logged)
    finally:
        for each in [*producers, consumer]:
            each.close()
