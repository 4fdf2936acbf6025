"""A namespace cap never refuses a new tenant for namespaces that hold nothing (issue 42).

Without tokens any client can open sessions under namespaces of its choosing. Before this, such
namespaces counted against --max-namespaces (and the per-tenant cap) for --census-retention (10 min)
after their sessions closed, so a burst of them refused every new tenant that long. At a cap the
store now forgets, first, every namespace with no live session, no stored block and no lease; what
still holds something stays, and the cap then refuses as documented.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import pytest
from kvtag.v1 import store_pb2 as pb
from kvtag.v1 import store_pb2_grpc
from kvtag_proto.errors import parse_error
from kvtag_store.app.server import RunningServer, start_server
from kvtag_store.backends.memory import MemoryBackend, MemoryCensus
from kvtag_store.config import Caps, ServiceConfig

from tests.descriptors import PROBE, mode, namespace

CAP = 4


@pytest.fixture
def stub() -> Iterator[store_pb2_grpc.KvStoreStub]:
    config = ServiceConfig(caps=Caps(max_namespaces=CAP, max_namespaces_per_tenant=CAP))
    server: RunningServer = start_server(MemoryBackend(8 << 20), MemoryCensus(), config, listen="127.0.0.1:0")
    channel = grpc.insecure_channel(server.address)
    try:
        yield store_pb2_grpc.KvStoreStub(channel)  # type: ignore[no-untyped-call]
    finally:
        channel.close()
        server.stop(grace=0)


def _open(stub: store_pb2_grpc.KvStoreStub, tenant: str, model: str = "m") -> str:
    request = pb.OpenSessionRequest(
        engine_id=f"e-{tenant}",
        namespace=namespace(tenant=tenant, model=model),
        mode=mode(),
        probe_keys=PROBE,
    )
    return str(stub.OpenSession(request, timeout=10).session_id)


def _close(stub: store_pb2_grpc.KvStoreStub, session_id: str) -> None:
    stub.CloseSession(pb.CloseSessionRequest(session_id=session_id), timeout=10)


def _refusal(stub: store_pb2_grpc.KvStoreStub, tenant: str) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as refused:
        _open(stub, tenant)
    error = parse_error(refused.value)
    assert error is not None
    return error.code, error.reason


def _namespaces(stub: store_pb2_grpc.KvStoreStub) -> int:
    return int(stub.Diagnose(pb.DiagnoseRequest(), timeout=10).total_namespaces)


def test_namespaces_left_empty_are_forgotten_at_the_cap_and_a_new_tenant_is_admitted_at_once(
    stub: store_pb2_grpc.KvStoreStub,
) -> None:
    for n in range(CAP):
        _close(stub, _open(stub, f"junk-{n}"))
    assert _namespaces(stub) == CAP, "closed sessions leave their namespaces in the census (retention)"
    session = _open(stub, "newcomer")  # refused NAMESPACE_CAP_REACHED for 10 minutes before
    assert session
    assert _namespaces(stub) == 1, "the empty namespaces were forgotten; the newcomer's is the one left"


def test_namespaces_with_live_sessions_or_blocks_stay_and_the_cap_refuses_as_documented(
    stub: store_pb2_grpc.KvStoreStub,
) -> None:
    live = [_open(stub, f"live-{n}") for n in range(CAP - 1)]
    holder = _open(stub, "holder")
    put = stub.Put(
        pb.PutRequest(session_id=holder, items=[pb.PutItem(block=pb.BlockRef(key=b"k"), value=b"v" * 64)]),
        timeout=10,
    )
    assert [r.status for r in put.results] == [pb.STORED]
    _close(stub, holder)  # no live session, but a stored block: kept
    assert _refusal(stub, "newcomer") == (grpc.StatusCode.RESOURCE_EXHAUSTED, "NAMESPACE_CAP_REACHED")
    assert _namespaces(stub) == CAP
    _close(stub, live[0])
    # The reclaiming sweep runs at most once a second: the next refusal may come from the same
    # second's decision; within two seconds the emptied namespace is forgotten and the newcomer admitted.
    deadline = time.monotonic() + 3.0
    while True:
        try:
            assert _open(stub, "newcomer")
            break
        except grpc.RpcError:
            assert time.monotonic() < deadline, "the namespace emptied by its last session was not reclaimed"
            time.sleep(0.2)
    held = stub.Lookup(
        pb.LookupRequest(session_id=_open(stub, "holder"), blocks=[pb.BlockRef(key=b"k")]), timeout=10
    )
    assert list(held.statuses) == [pb.HIT], "the namespace that held a block kept it"
