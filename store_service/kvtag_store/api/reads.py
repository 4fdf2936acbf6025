"""The inline read path: Get and GetStream send the values in the reply."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from kvtag.v1 import store_pb2 as pb

from kvtag_store import errors
from kvtag_store.api import codec
from kvtag_store.api.counting import Counting, KeyTally
from kvtag_store.api.inflight import COPIES, InflightBudget
from kvtag_store.api.leases import Leases
from kvtag_store.backends.base import BlockAddress, BlockBackend, ReadResult, ViewReads
from kvtag_store.config import ServiceLimits
from kvtag_store.policy.sessions import Session

# GetStream's messages stay under gRPC's default 4 MiB receive limit so any client can read the stream;
# only a single value larger than that needs a client that raised its limit (Limits says how far).
STREAM_MESSAGE_BYTES = (4 << 20) - (64 << 10)
# Framing of one result inside a GetResponse, at most.
_RESULT_FRAMING = 16


class Reads:
    def __init__(
        self,
        backend: BlockBackend,
        views: ViewReads | None,
        leases: Leases,
        counting: Counting,
        admission: InflightBudget,
        limits: ServiceLimits,
        message_budget: int,
    ) -> None:
        """`views`: the backend when it reads values as views of their slots, else None (copies)."""
        self.backend = backend
        self.views = views
        self.leases = leases
        self.counting = counting
        self.admission = admission
        self.limits = limits
        self.stream_budget = min(message_budget, STREAM_MESSAGE_BYTES)

    def get(self, session: Session, request: pb.GetRequest) -> bytes:
        """The encoded GetResponse (codec.encode_get_results): with a backend that reads views, each value
        is copied once, from its pinned slot straight into the reply."""
        results, pinned = self.read(session, request, "Get", views=True)
        try:
            served = sum(len(r.value) for r in results if r.value is not None)
            with self.admission.hold(COPIES * served):
                reply = codec.encode_get_results(results)
        finally:
            if pinned:
                self.backend.unpin(session.namespace_id, pinned)
        self.counting.served(served)
        return reply

    def stream(self, results: list[ReadResult]) -> Iterator[bytes]:
        """Encoded GetResponse messages of at most the stream budget each, results in request order."""
        chunk: list[ReadResult] = []
        size = 0
        served = 0
        for r in results:
            length = len(r.value) if r.value is not None else 0
            if chunk and size + length > self.stream_budget:
                yield codec.encode_get_results(chunk)
                chunk, size = [], 0
            chunk.append(r)
            size += length + _RESULT_FRAMING
            served += length
        if chunk or not results:
            yield codec.encode_get_results(chunk)
        self.counting.served(served)

    def read(
        self, session: Session, request: pb.GetRequest, rpc: str, views: bool = False
    ) -> tuple[list[ReadResult], Sequence[BlockAddress]]:
        """Results of a Get and what they pinned. With `views` (when the backend offers them) the values
        are views of their slots, pinned until the caller unpins them; otherwise copies, nothing pinned."""
        batch = codec.get_keys(request)
        if batch.packed:
            raise errors.invalid_request(
                f"packed_blocks is for GetReferences (the shared-memory path); {rpc} takes blocks",
                "packed_blocks",
            )
        batch.check(self.limits, rpc)
        addresses = batch.addresses
        pinned: Sequence[BlockAddress] = ()
        if views and self.views is not None:
            results, pinned = self.views.get_views(session.namespace_id, session.mode_id, addresses)
        else:
            results = self.backend.get(session.namespace_id, session.mode_id, addresses)
        try:
            if request.lease_id:
                self.leases.release(session, [request.lease_id])
            self.counting.read(session, KeyTally.of([r.status for r in results]))
        except BaseException:
            if pinned:  # these pins belong to no lease: nothing else would ever drop them
                self.backend.unpin(session.namespace_id, pinned)
            raise
        return results, pinned
