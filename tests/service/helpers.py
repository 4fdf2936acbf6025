"""Request builders and a thin typed wrapper over the real stub, so tests read as specifications."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from kvtag.v1 import store_pb2 as pb
from kvtag_proto.errors import KvtagError, parse_error
from kvtag_store.app.server import RunningServer
from kvtag_store.backends.memory import MemoryBackend

from tests.descriptors import PROBE, mode, namespace


def refs(*keys: bytes, group: int = 0, base: Sequence[bytes] = ()) -> list[pb.BlockRef]:
    bases = list(base) or [b""] * len(keys)
    return [pb.BlockRef(key=k, group=group, base_key=b) for k, b in zip(keys, bases, strict=True)]


def items(*pairs: tuple[bytes, bytes], base: Sequence[bytes] = ()) -> list[pb.PutItem]:
    bases = list(base) or [b""] * len(pairs)
    return [
        pb.PutItem(block=pb.BlockRef(key=k, base_key=b), value=v)
        for (k, v), b in zip(pairs, bases, strict=True)
    ]


@dataclass
class Store:
    server: RunningServer
    stub: Any
    backend: MemoryBackend
    # The stub's channel, for calls with raw bytes (make_store sets it).
    channel: grpc.Channel | None = None

    def open(
        self,
        engine_id: str = "engine-a",
        hashing: pb.HashingMode | None = None,
        ns: pb.NamespaceDescriptor | None = None,
        probe: Sequence[bytes] = PROBE,
        labels: dict[str, str] | None = None,
    ) -> pb.OpenSessionResponse:
        request = pb.OpenSessionRequest(
            engine_id=engine_id,
            namespace=ns or namespace(),
            mode=hashing or mode(),
            probe_keys=list(probe),
            labels=labels or {},
        )
        response: pb.OpenSessionResponse = self.stub.OpenSession(request, timeout=5)
        return response

    def put(self, session_id: str, *pairs: tuple[bytes, bytes], base: Sequence[bytes] = ()) -> list[int]:
        response = self.stub.Put(
            pb.PutRequest(session_id=session_id, items=items(*pairs, base=base)), timeout=5
        )
        return [r.status for r in response.results]

    def lookup(self, session_id: str, *keys: bytes, base: Sequence[bytes] = ()) -> pb.LookupResponse:
        response: pb.LookupResponse = self.stub.Lookup(
            pb.LookupRequest(session_id=session_id, blocks=refs(*keys, base=base)), timeout=5
        )
        return response

    def get(self, session_id: str, *keys: bytes, lease_id: str = "") -> list[pb.GetResult]:
        response = self.stub.Get(
            pb.GetRequest(session_id=session_id, blocks=refs(*keys), lease_id=lease_id), timeout=5
        )
        return list(response.results)

    def diagnose(self) -> pb.DiagnoseResponse:
        response: pb.DiagnoseResponse = self.stub.Diagnose(pb.DiagnoseRequest(), timeout=5)
        return response

    def stats(self) -> pb.GetStatsResponse:
        response: pb.GetStatsResponse = self.stub.GetStats(pb.GetStatsRequest(), timeout=5)
        return response


def error_of(call: Callable[[], object]) -> KvtagError:
    """The decoded kvtag error of a call that must fail."""
    try:
        call()
    except grpc.RpcError as exc:
        decoded = parse_error(exc)
        assert decoded is not None, f"the server sent no kvtag error details: {exc}"
        return decoded
    raise AssertionError("the call succeeded but should have failed")
