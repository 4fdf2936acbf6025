"""Real kvtag.v1 calls from the host through the generated stubs, shared by the deployment tests."""

from __future__ import annotations

from typing import Any

import grpc
from kvtag.v1 import store_pb2 as pb
from kvtag.v1 import store_pb2_grpc

from tests.descriptors import PROBE, mode, namespace


def channel(target: str) -> grpc.Channel:
    return grpc.insecure_channel(target)


def stub(chan: grpc.Channel) -> Any:
    return store_pb2_grpc.KvStoreStub(chan)  # type: ignore[no-untyped-call]


def open_session(kv: Any, engine_id: str, model: str, lookahead: int) -> pb.OpenSessionResponse:
    request = pb.OpenSessionRequest(
        engine_id=engine_id, namespace=namespace(model), mode=mode(lookahead), probe_keys=PROBE
    )
    response: pb.OpenSessionResponse = kv.OpenSession(request, timeout=10)
    return response
