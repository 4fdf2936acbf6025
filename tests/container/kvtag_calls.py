"""Real kvtag.v1 calls from the host through the generated stubs, shared by the deployment tests."""

from __future__ import annotations

from typing import Any

import grpc
from kvtag.v1 import store_pb2 as pb
from kvtag.v1 import store_pb2_grpc

PROBE = [b"container-probe-0", b"container-probe-1"]


def channel(target: str) -> grpc.Channel:
    return grpc.insecure_channel(target)


def stub(chan: grpc.Channel) -> Any:
    return store_pb2_grpc.KvStoreStub(chan)  # type: ignore[no-untyped-call]


def namespace(model: str) -> pb.NamespaceDescriptor:
    return pb.NamespaceDescriptor(
        model_name=model,
        weights_fingerprint="sha256:container",
        kv_dtype="bfloat16",
        kv_layout="attn:1x4096",
        block_size=16,
        parallel_sharding="tp=1/rank=0",
    )


def mode(lookahead: int) -> pb.HashingMode:
    return pb.HashingMode(
        key_scheme="canonical",
        scheme_version="1",
        hash_algorithm="sha256",
        hash_block_size=16,
        lookahead_tokens=lookahead,
    )


def open_session(kv: Any, engine_id: str, model: str, lookahead: int) -> pb.OpenSessionResponse:
    request = pb.OpenSessionRequest(
        engine_id=engine_id, namespace=namespace(model), mode=mode(lookahead), probe_keys=PROBE
    )
    response: pb.OpenSessionResponse = kv.OpenSession(request, timeout=10)
    return response
