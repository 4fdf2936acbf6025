"""One engine of the multi-process quota load: writes a tenant's values, then reads every one back and
checks each byte. Runs in a spawned process, so it imports nothing from the test modules' fixtures."""

from __future__ import annotations

import hashlib

import grpc
from kvtag.v1 import store_pb2 as pb
from kvtag.v1 import store_pb2_grpc

from tests.descriptors import PROBE, mode, namespace

VALUE_BYTES = 16 << 10
BATCH = 8


def value_of(tenant: str, index: int) -> bytes:
    """Content derived from (tenant, index), so a reader can regenerate and compare every byte."""
    seed = hashlib.sha256(f"{tenant}/{index}".encode()).digest()
    return (seed * (VALUE_BYTES // len(seed) + 1))[:VALUE_BYTES]


def key_of(index: int) -> bytes:
    return b"block-%06d" % index


def run_engine(endpoint: str, tenant: str, count: int) -> dict[str, object]:
    """Write `count` values in batches, then Get them all: which came back, and were they exact."""
    with grpc.insecure_channel(endpoint) as channel:
        stub = store_pb2_grpc.KvStoreStub(channel)  # type: ignore[no-untyped-call]
        session = stub.OpenSession(
            pb.OpenSessionRequest(
                engine_id=f"load-{tenant}",
                namespace=namespace(tenant=tenant),
                mode=mode(),
                probe_keys=list(PROBE),
            ),
            timeout=30,
        ).session_id
        statuses: list[int] = []
        for start in range(0, count, BATCH):
            items = [
                pb.PutItem(block=pb.BlockRef(key=key_of(i)), value=value_of(tenant, i))
                for i in range(start, min(count, start + BATCH))
            ]
            response = stub.Put(pb.PutRequest(session_id=session, items=items), timeout=30)
            statuses.extend(r.status for r in response.results)
        present: list[int] = []
        corrupt: list[int] = []
        for start in range(0, count, BATCH):
            indexes = list(range(start, min(count, start + BATCH)))
            response = stub.Get(
                pb.GetRequest(session_id=session, blocks=[pb.BlockRef(key=key_of(i)) for i in indexes]),
                timeout=30,
            )
            for i, result in zip(indexes, response.results, strict=True):
                if result.status == pb.HIT:
                    (present if result.value == value_of(tenant, i) else corrupt).append(i)
        return {"tenant": tenant, "statuses": statuses, "present": present, "corrupt": corrupt}
