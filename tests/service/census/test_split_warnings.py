"""OpenSession tells an engine where blocks it can never read sit, on the memory backend (and its
disk tier): MODE_SPLIT for another mode's blocks in its namespace, whoever stored them and however
long ago (the census forgot the mode, or the store restarted on its disk dir), and LAYOUT_SPLIT for a
sibling namespace of its model, in another KV layout, holding the model's blocks.

Real servers on loopback, real files for the restarts."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from kvtag.v1 import store_pb2 as pb
from kvtag.v1 import store_pb2_grpc
from kvtag_proto import ids
from kvtag_store.app.server import start_server
from kvtag_store.backends.memory import MemoryBackend
from kvtag_store.config import ServiceConfig
from kvtag_store.policy.census_snapshot import SNAPSHOT_NAME, SnapshotCensus

from tests.descriptors import mode, namespace

from ..conftest import ServerFactory
from ..helpers import Store

LOOKAHEAD, LEGACY = mode(lookahead=1), mode(lookahead=0)
EAGLE_LAYOUT = "g0:FullAttentionSpec:bs16:page65536:layers5"  # the drafter's layer too
PLAIN_LAYOUT = "g0:FullAttentionSpec:bs16:page65536:layers4"


def layout(kv_layout: str, sharding: str = "tp=1/rank=0", tenant: str = "") -> pb.NamespaceDescriptor:
    ns = namespace(tenant=tenant)
    ns.kv_layout, ns.parallel_sharding = kv_layout, sharding
    return ns


def store_and_leave(store: Store, hashing: pb.HashingMode, ns: pb.NamespaceDescriptor | None = None) -> str:
    """A producer opens, stores two blocks and closes: nothing of it stays live."""
    session_id = store.open(engine_id="producer", hashing=hashing, ns=ns).session_id
    assert store.put(session_id, (b"b0", b"zero"), (b"b1", b"one")) == [pb.STORED, pb.STORED]
    store.stub.CloseSession(pb.CloseSessionRequest(session_id=session_id), timeout=5)
    return ids.mode_id(hashing)


def kinds(response: pb.OpenSessionResponse) -> list[tuple[str, str]]:
    return [(w.kind, w.other_mode_id or w.other_namespace_id) for w in response.warnings]


Restart = Callable[[], Store]


@pytest.fixture
def restart(tmp_path: Path) -> Iterator[Restart]:
    """restart() -> a Store over tmp_path's disk tier and census snapshot; the previous one is stopped
    first (its memory flushed to disk), as a process restart would."""
    running: list[Store] = []

    def start() -> Store:
        for old in running:
            old.server.stop(grace=0)
            assert old.channel is not None
            old.channel.close()
        running.clear()
        backend = MemoryBackend(8 << 20, disk_dir=str(tmp_path / "disk"), disk_capacity=32 << 20)
        census = SnapshotCensus(tmp_path / "disk" / SNAPSHOT_NAME, backend.restored())
        server = start_server(backend, census, ServiceConfig(), listen="127.0.0.1:0")
        channel = grpc.insecure_channel(server.address)
        store = Store(server, store_pb2_grpc.KvStoreStub(channel), backend, channel)  # type: ignore[no-untyped-call]
        running.append(store)
        return store

    yield start
    for old in running:
        old.server.stop(grace=0)
        assert old.channel is not None
        old.channel.close()


# -- MODE_SPLIT --------------------------------------------------------------------------------


def test_a_mode_the_census_forgot_is_named_while_its_blocks_are_held(make_store: ServerFactory) -> None:
    store = make_store()
    producer_mode = store_and_leave(store, LOOKAHEAD)
    # Eight more modes come and go without storing: the census keeps 8 idle modes per namespace, so it
    # forgets the producer's, whose two blocks the backend still holds.
    for seed in range(8):
        session_id = store.open(engine_id=f"visitor-{seed}", hashing=mode(seed=f"s{seed}")).session_id
        store.stub.CloseSession(pb.CloseSessionRequest(session_id=session_id), timeout=5)
    store.server.service.sweep_census()
    (report,) = store.diagnose().namespaces
    assert producer_mode not in {m.mode_id for m in report.modes}, "the census was to forget it"
    opened = store.open(engine_id="consumer", hashing=LEGACY)
    assert kinds(opened) == [("MODE_SPLIT", producer_mode)]
    [split] = opened.warnings
    assert [(d.field, d.established, d.requested) for d in split.diffs] == [("lookahead_tokens", "1", "0")]
    assert (
        f"its blocks were stored in mode {producer_mode} (lookahead_tokens 1 there, 0 here)" in split.message
    )


def test_a_mode_whose_blocks_are_gone_is_no_split(make_store: ServerFactory) -> None:
    store = make_store(capacity=1 << 20)
    store_and_leave(store, LOOKAHEAD)
    # Another namespace fills the store: the producer's blocks are evicted, nothing of its mode is left.
    other = store.open(engine_id="filler", ns=namespace("another-model")).session_id
    for i in range(8):
        store.put(other, (f"f{i}".encode(), bytes(200 << 10)))
    assert store.backend.modes_holding(ids.namespace_id(namespace())) == frozenset()
    assert kinds(store.open(engine_id="consumer", hashing=LEGACY)) == []


def test_after_a_restart_on_the_disk_dir_the_consumer_is_told_the_mode_a_gone_producer_stored(
    restart: Restart,
) -> None:
    producer_mode = store_and_leave(restart(), LOOKAHEAD)
    store = restart()
    assert store.diagnose().namespaces == [], "the restarted census saw no engine"
    opened = store.open(engine_id="consumer", hashing=LEGACY)
    assert kinds(opened) == [("MODE_SPLIT", producer_mode)]
    assert [d.field for d in opened.warnings[0].diffs] == ["lookahead_tokens"]
    # The same mode as the blocks': nothing to tell.
    assert kinds(store.open(engine_id="producer-again", hashing=LOOKAHEAD)) == [
        ("MODE_SPLIT", opened.mode_id)
    ]


# -- LAYOUT_SPLIT ------------------------------------------------------------------------------


def test_a_consumer_in_a_sibling_layout_is_told_which_namespace_holds_the_models_blocks(
    make_store: ServerFactory,
) -> None:
    store = make_store()
    eagle, plain = layout(EAGLE_LAYOUT), layout(PLAIN_LAYOUT)
    store_and_leave(store, LOOKAHEAD, eagle)
    opened = store.open(engine_id="consumer", hashing=LEGACY, ns=plain)
    assert kinds(opened) == [("LAYOUT_SPLIT", ids.namespace_id(eagle))]
    [sibling] = opened.warnings
    assert [(d.field, d.established, d.requested) for d in sibling.diffs] == [
        ("kv_layout", EAGLE_LAYOUT, PLAIN_LAYOUT)
    ]
    assert sibling.other_namespace == eagle
    assert f"sibling namespace `{ids.namespace_id(eagle)}`" in sibling.message
    assert f"kv_layout `{EAGLE_LAYOUT}` there, `{PLAIN_LAYOUT}` here" in sibling.message


def test_siblings_without_blocks_other_shards_and_other_tenants_are_not_named(
    make_store: ServerFactory,
) -> None:
    store = make_store()
    # A sibling layout whose engine stored nothing; the model's other TP shard; another tenant's.
    store.open(engine_id="empty", ns=layout(EAGLE_LAYOUT, "tp=2/rank=0"))
    store_and_leave(store, LOOKAHEAD, layout(PLAIN_LAYOUT, "tp=2/rank=1"))
    store_and_leave(store, LOOKAHEAD, layout(EAGLE_LAYOUT, "tp=2/rank=0", tenant="other"))
    assert kinds(store.open(engine_id="rank0", ns=layout(PLAIN_LAYOUT, "tp=2/rank=0"))) == []


def test_of_a_sibling_layouts_shards_the_one_sharded_like_the_opener_is_named(
    make_store: ServerFactory,
) -> None:
    store = make_store()
    for rank in (1, 0):
        store_and_leave(store, LOOKAHEAD, layout(EAGLE_LAYOUT, f"tp=2/rank={rank}"))
    opened = store.open(engine_id="rank0", ns=layout(PLAIN_LAYOUT, "tp=2/rank=0"), hashing=LEGACY)
    assert kinds(opened) == [("LAYOUT_SPLIT", ids.namespace_id(layout(EAGLE_LAYOUT, "tp=2/rank=0")))]
    assert [d.field for d in opened.warnings[0].diffs] == ["kv_layout"]


def test_a_sibling_layout_is_named_after_a_restart_on_the_disk_dir(restart: Restart) -> None:
    eagle = layout(EAGLE_LAYOUT)
    store_and_leave(restart(), LOOKAHEAD, eagle)
    opened = restart().open(engine_id="consumer", ns=layout(PLAIN_LAYOUT), hashing=LEGACY)
    assert kinds(opened) == [("LAYOUT_SPLIT", ids.namespace_id(eagle))]


def test_the_sweep_counts_blocks_per_namespace_as_the_backend_declares(make_store: ServerFactory) -> None:
    """A namespace whose blocks were evicted is forgotten (the memory backend counts per namespace,
    NamespaceCounting), one that holds blocks is kept, however long idle."""
    store = make_store(capacity=1 << 20, census_retention_ms=50)
    assert store.server.service.capabilities.counting is store.backend
    store_and_leave(store, LOOKAHEAD)
    time.sleep(0.1)
    store.server.service.sweep_census()
    assert len(store.diagnose().namespaces) == 1, "idle past retention, but it holds blocks"
    filler = store.open(engine_id="filler", ns=namespace("filler-model")).session_id
    for i in range(8):
        store.put(filler, (f"f{i}".encode(), bytes(200 << 10)))
    store.stub.CloseSession(pb.CloseSessionRequest(session_id=filler), timeout=5)
    assert ids.namespace_id(namespace()) not in store.backend.blocks_per_namespace(), "evicted"
    time.sleep(0.1)
    store.server.service.sweep_census()
    assert [n.namespace_id for n in store.diagnose().namespaces] == [
        ids.namespace_id(namespace("filler-model"))
    ]
