"""Lookup's packed form (packed_blocks / packed_statuses) answers exactly like the v1 `blocks` form."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvtag.v1 import store_pb2 as pb
from kvtag.v1 import store_pb2_grpc
from kvtag_store.api import codec
from kvtag_store.app.server import RunningServer, start_server
from kvtag_store.backends.memory import MemoryBackend, MemoryCensus
from kvtag_store.config import ServiceConfig, ServiceLimits

from tests.descriptors import mode, namespace

from ..helpers import Store, error_of

MAX_BATCH = 64
_namespaces = itertools.count()


@pytest.fixture(scope="module")
def server() -> Iterator[Store]:
    backend = MemoryBackend(64 << 20)
    running: RunningServer = start_server(
        backend,
        MemoryCensus(),
        ServiceConfig(limits=ServiceLimits(max_batch_items=MAX_BATCH)),
        listen="127.0.0.1:0",
    )
    channel = grpc.insecure_channel(running.address)
    yield Store(server=running, stub=store_pb2_grpc.KvStoreStub(channel), backend=backend)  # type: ignore[no-untyped-call]
    channel.close()
    running.stop(grace=0)


@dataclass
class Run:
    group: int
    keys: list[bytes]
    base_keys: list[bytes]

    def packed(self, key_length: int) -> pb.PackedBlocks:
        return pb.PackedBlocks(
            key_length=key_length,
            keys=b"".join(self.keys),
            group=self.group,
            base_keys=b"".join(self.base_keys),
        )

    def refs(self) -> list[pb.BlockRef]:
        bases = self.base_keys or [b""] * len(self.keys)
        return [
            pb.BlockRef(key=k, group=self.group, base_key=b) for k, b in zip(self.keys, bases, strict=True)
        ]


@st.composite
def lookups(draw: st.DrawFn) -> tuple[int, list[Run], set[tuple[int, bytes]], set[tuple[int, bytes]]]:
    """(key length, runs, blocks stored by this mode, blocks stored by another mode)."""
    length = draw(st.integers(1, 40))
    pool = draw(st.lists(st.binary(min_size=length, max_size=length), min_size=1, max_size=12, unique=True))
    runs: list[Run] = []
    for _ in range(draw(st.integers(1, 4))):
        keys = draw(st.lists(st.sampled_from(pool), min_size=1, max_size=MAX_BATCH // 4))  # within the limit
        base_length = draw(st.sampled_from([0, 0, length, 7]))
        bases = (
            [draw(st.binary(min_size=base_length, max_size=base_length)) for _ in keys] if base_length else []
        )
        runs.append(Run(draw(st.sampled_from([0, 1, 2**32 - 1])), keys, bases))
    blocks = sorted({(run.group, key) for run in runs for key in run.keys})
    mine = draw(st.sets(st.sampled_from(blocks))) if blocks else set()
    others = draw(st.sets(st.sampled_from(blocks))) - mine if blocks else set()
    return length, runs, mine, others


def _store(store: Store, session_id: str, blocks: set[tuple[int, bytes]]) -> None:
    if blocks:
        items = [pb.PutItem(block=pb.BlockRef(key=k, group=g), value=b"v" + k) for g, k in sorted(blocks)]
        response = store.stub.Put(pb.PutRequest(session_id=session_id, items=items), timeout=5)
        assert {r.status for r in response.results} == {pb.STORED}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=lookups())
def test_packed_lookup_answers_like_the_v1_form(
    server: Store, case: tuple[int, list[Run], set[tuple[int, bytes]], set[tuple[int, bytes]]]
) -> None:
    length, runs, mine, others = case
    ns = namespace(model=f"packed-{next(_namespaces)}", tenant="packed")
    session = server.open("engine-a", hashing=mode(lookahead=1), ns=ns).session_id
    other = server.open("engine-b", hashing=mode(lookahead=0), ns=ns).session_id
    _store(server, session, mine)
    _store(server, other, others)

    v1 = server.stub.Lookup(
        pb.LookupRequest(session_id=session, blocks=[r for run in runs for r in run.refs()]), timeout=5
    )
    packed = server.stub.Lookup(
        pb.LookupRequest(session_id=session, packed_blocks=[run.packed(length) for run in runs]), timeout=5
    )
    assert list(packed.packed_statuses) == list(v1.statuses)
    assert not packed.statuses, "the packed form answers in packed_statuses only"
    assert packed.prefix_length == v1.prefix_length
    assert bool(packed.lease.lease_id) == bool(v1.lease.lease_id) == bool(mine)


def test_packed_lookup_leases_its_hits(store: Store) -> None:
    server = store
    session = server.open(ns=namespace(tenant="packed-lease")).session_id
    keys = [bytes([i]) * 32 for i in range(8)]
    _store(server, session, {(0, k) for k in keys[:5]})
    packed = pb.PackedBlocks(key_length=32, keys=b"".join(keys))
    response = server.stub.Lookup(pb.LookupRequest(session_id=session, packed_blocks=[packed]), timeout=5)
    assert (response.prefix_length, response.packed_statuses) == (5, bytes([pb.HIT] * 5 + [pb.MISS] * 3))
    assert server.stats().leased_keys == 5
    server.stub.ReleaseLeases(
        pb.ReleaseLeasesRequest(session_id=session, lease_ids=[response.lease.lease_id]), timeout=5
    )
    assert server.stats().leased_keys == 0


@pytest.mark.parametrize(
    ("run", "with_blocks", "reason", "field"),
    [
        (pb.PackedBlocks(key_length=0, keys=b"abcd"), False, "EMPTY_KEY", "packed_blocks[0].key_length"),
        (
            pb.PackedBlocks(key_length=300, keys=b"k" * 300),
            False,
            "KEY_TOO_LARGE",
            "packed_blocks[0].key_length",
        ),
        (pb.PackedBlocks(key_length=4, keys=b"abcdef"), False, "INVALID_REQUEST", "packed_blocks[0].keys"),
        (
            pb.PackedBlocks(key_length=2, keys=b"abcd", base_keys=b"xyz"),
            False,
            "INVALID_REQUEST",
            "packed_blocks[0].base_keys",
        ),
        (pb.PackedBlocks(key_length=1, keys=b"k" * (MAX_BATCH + 1)), False, "BATCH_TOO_LARGE", ""),
        (pb.PackedBlocks(key_length=2, keys=b"abcd"), True, "INVALID_REQUEST", "packed_blocks"),
    ],
)
def test_malformed_packed_lookup_is_refused_with_its_reason(
    server: Store, run: pb.PackedBlocks, with_blocks: bool, reason: str, field: str
) -> None:
    session = server.open(ns=namespace(tenant="packed-bad")).session_id
    request = pb.LookupRequest(session_id=session, packed_blocks=[run])
    if with_blocks:
        request.blocks.add(key=b"k")
    error = error_of(lambda: server.stub.Lookup(request, timeout=5))
    assert (error.code, error.reason) == (grpc.StatusCode.INVALID_ARGUMENT, reason)
    if field:
        assert [f for f, _ in error.field_violations] == [field]
    assert server.stub.Heartbeat(pb.HeartbeatRequest(session_id=session), timeout=5).session_ttl_ms


@settings(max_examples=100, deadline=None)
@given(case=lookups(), picks=st.lists(st.integers(0, 200), max_size=20))
def test_packed_base_keys_are_the_v1_base_keys(
    case: tuple[int, list[Run], set[tuple[int, bytes]], set[tuple[int, bytes]]], picks: list[int]
) -> None:
    length, runs, _, _ = case
    total = sum(len(run.keys) for run in runs)
    indexes = sorted({p % total for p in picks})
    packed = codec.parse_lookup(
        pb.LookupRequest(
            session_id="s", packed_blocks=[run.packed(length) for run in runs]
        ).SerializeToString()
    )
    assert packed.packed
    assert codec.packed_addresses(packed.message.packed_blocks) == [  # type: ignore[union-attr]
        (run.group, key) for run in runs for key in run.keys
    ]
    expected = [(run.group, base) for run in runs for base in (run.base_keys or [b""] * len(run.keys))]
    want = [expected[i] for i in indexes if expected[i][1]]
    assert packed.base_keys(indexes) == (want or None)
