"""The kvtag.v1 KvStore servicer: each RPC finds the caller's session and hands the request to the
module that does its job (session_desk, lookups, reads, writes, slots).

The servicer assembles those parts over one BlockBackend, whose extra capabilities it learns once
(backends.base.Capabilities). Every method is registered without a request deserializer: `rpc`
(calls.py) admits and parses the raw bytes (intake.py) before the method runs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import grpc
from kvtag.v1 import store_pb2 as pb
from kvtag.v1 import store_pb2_grpc

from kvtag_store import heap
from kvtag_store.api import codec, intake, replies, validation
from kvtag_store.api.calls import Calls, rpc
from kvtag_store.api.counting import Counting
from kvtag_store.api.inflight import InflightBudget
from kvtag_store.api.leases import Leases
from kvtag_store.api.lookups import Lookups
from kvtag_store.api.outcomes import ValueLimit
from kvtag_store.api.reads import Reads
from kvtag_store.api.reaper import Reaper
from kvtag_store.api.session_desk import SessionDesk
from kvtag_store.api.slots import Slots
from kvtag_store.api.tokens import TokenSink
from kvtag_store.api.usage import UsageReports
from kvtag_store.api.writes import Writes
from kvtag_store.backends.base import BlockBackend, Capabilities, CensusStore, ReadResult
from kvtag_store.config import ServiceConfig
from kvtag_store.observe import tenant_stats
from kvtag_store.observe.diagnose_pages import DiagnosePager
from kvtag_store.observe.metrics import StoreMetrics
from kvtag_store.policy.base_keys import BaseKeyIndex
from kvtag_store.policy.census import Census
from kvtag_store.policy.sessions import SessionTable
from kvtag_store.security.access import Access
from kvtag_store.security.tokens import TokenRegistry


def message_headroom(max_message_bytes: int) -> int:
    """Room left in a message for everything but the value (keys, statuses, framing): 1 MiB, or a
    sixteenth of a smaller message limit."""
    return min(1 << 20, max_message_bytes // 16)


# The least time between two sweeps a namespace cap brings on (reclaim_namespaces).
RECLAIM_INTERVAL_S = 1.0


class KvStoreService(store_pb2_grpc.KvStoreServicer):
    def __init__(
        self,
        backend: BlockBackend,
        census_store: CensusStore,
        config: ServiceConfig,
        metrics: StoreMetrics,
        access: Access | None = None,
    ) -> None:
        self.backend = backend
        self.capabilities = Capabilities.of(backend)
        self.access = access or Access(TokenRegistry.disabled())
        self.config = config
        self.limits = config.limits
        self.metrics = metrics
        self.sessions = SessionTable(config.session_ttl_ms, limits=config.caps)
        self.census = Census(
            census_store,
            config.namespace_policies,
            config.default_policy,
            config.caps,
            config.census_retention_ms,
            self.capabilities.holdings,
        )
        self.base_index = BaseKeyIndex(config.base_index_entries)
        # The bound on request and reply bytes held at once (inflight.py).
        self.admission = InflightBudget(config.max_inflight_bytes)
        self.calls = Calls(self.limits.max_batch_items, self.admission, metrics)
        message_budget = self.limits.max_message_bytes - message_headroom(self.limits.max_message_bytes)
        value_limit = ValueLimit(min(backend.max_value_bytes, message_budget))
        self.pages = DiagnosePager(self.census, message_budget)
        self.max_value_bytes = value_limit.max_value_bytes
        self.counting = counting = Counting(self.census, metrics)
        leases = Leases(self.sessions, backend)
        # Token ids sent with puts, for KV events; app.server connects it when events start.
        self.tokens = TokenSink()
        self.slots = Slots(
            self.capabilities.shared_memory,
            self.sessions,
            leases,
            counting,
            self.base_index,
            value_limit,
            self.limits,
            config.default_lease_ms,
            self.tokens,
        )
        self._next_reclaim = 0.0
        self.desk = SessionDesk(
            self.sessions,
            self.access,
            self.census,
            counting,
            self.capabilities.tenants,
            self.capabilities.forgetting,
            self.slots,
            leases,
            self.limits,
            replies.limits(self.limits, value_limit.max_value_bytes),
            config.session_ttl_ms,
            self.reclaim_namespaces,
            self.tokens,
        )
        self.leases = leases
        self.usage = UsageReports(counting, self.base_index, self.limits.max_key_bytes)
        self.lookups = Lookups(backend, self.capabilities, leases, counting, self.base_index, config)
        self.reads = Reads(
            backend, self.capabilities.views, leases, counting, self.admission, self.limits, message_budget
        )
        self.writes = Writes(
            backend, self.sessions, counting, self.base_index, value_limit, self.limits, self.tokens
        )
        self.reaper = Reaper.for_ttl(self.reap, config.session_ttl_ms)
        # Told the namespaces each sweep forgot, so what they keep per namespace goes with the census's.
        self.forget_listeners: list[Callable[[list[str]], None]] = []
        metrics.watch(backend.stats, self.census.live_sessions)
        metrics.watch_census(self.census.namespace_count)
        if self.capabilities.forgetting is not None:
            metrics.watch_arenas(
                self.capabilities.forgetting.arenas, self.capabilities.forgetting.prefault_progress
            )

    # -- lifecycle ----------------------------------------------------------

    def start(self) -> None:
        """Start the thread that expires sessions and leases."""
        self.reaper.start()

    def stop(self) -> None:
        self.reaper.stop()

    def reap(self) -> None:
        """End the sessions whose heartbeat stopped and unpin the leases that ran out; now and then,
        forget idle namespaces."""
        self.desk.expire()
        if self.census.sweep_due(time.monotonic()):
            self.sweep_census()

    def sweep_census(self, idle_for_ms: int | None = None) -> list[str]:
        """census.sweep with the backend's blocks per namespace (NamespaceCounting). A backend that
        cannot count them per namespace (Mooncake) gives None: namespaces whose modes stored stay."""
        idle_since = time.monotonic()  # what a session names after this is kept by the backend
        counting = self.capabilities.counting
        forgotten = self.census.sweep(
            counting.blocks_per_namespace() if counting is not None else None, idle_for_ms=idle_for_ms
        )
        if forgotten:
            self.metrics.namespaces_forgotten.inc(len(forgotten))
        if self.capabilities.forgetting is not None:
            self.capabilities.forgetting.forget_namespaces(forgotten, idle_since)
        if forgotten:
            for listener in self.forget_listeners:
                listener(forgotten)
            heap.give_back()  # what the forgotten namespaces' calls left free (kvtag_store.heap)
        return forgotten

    def reclaim_namespaces(self) -> bool:
        """At a namespace cap: forget the namespaces that hold nothing (no live session, block or
        lease) now rather than after --census-retention, so that junk namespaces, which any client
        can open without a token, never refuse a new tenant. At most one such sweep a second: it reads
        the backend's per-namespace counts. True if any namespace was forgotten."""
        now = time.monotonic()
        if now < self._next_reclaim:
            return False
        self._next_reclaim = now + RECLAIM_INTERVAL_S
        return bool(self.sweep_census(idle_for_ms=0))

    # -- sessions -----------------------------------------------------------

    @rpc(intake.OPEN_SESSION)
    def OpenSession(
        self, request: pb.OpenSessionRequest, context: grpc.ServicerContext
    ) -> pb.OpenSessionResponse:
        return self.desk.open(request, context)

    @rpc(intake.HEARTBEAT)
    def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.ServicerContext) -> pb.HeartbeatResponse:
        session = self.desk.find(request.session_id, context, "Heartbeat")
        if request.HasField("usage"):
            self.usage.report(session, request.usage)
        return pb.HeartbeatResponse(session_ttl_ms=self.config.session_ttl_ms)

    @rpc(intake.CLOSE_SESSION)
    def CloseSession(
        self, request: pb.CloseSessionRequest, context: grpc.ServicerContext
    ) -> pb.CloseSessionResponse:
        self.desk.close(request, context)
        return pb.CloseSessionResponse()

    # -- inline data --------------------------------------------------------

    @rpc(intake.LOOKUP)
    def Lookup(self, request: codec.KeyBatch, context: grpc.ServicerContext) -> pb.LookupResponse:
        session = self.desk.find(request.session_id, context, "Lookup")
        return self.lookups.lookup(session, request)

    @rpc(intake.PUT)
    def Put(self, request: codec.PutBatch, context: grpc.ServicerContext) -> pb.PutResponse:
        session = self.desk.find(request.session_id, context, "Put")
        return self.writes.put(session, request)

    @rpc(None)
    def PutStream(self, request_iterator: Iterator[bytes], context: grpc.ServicerContext) -> pb.PutResponse:
        return self.writes.put_stream(
            request_iterator,
            lambda session_id, name: self.desk.find(session_id, context, name),
            self.calls.admitted,
        )

    @rpc(intake.GET)
    def Get(self, request: pb.GetRequest, context: grpc.ServicerContext) -> bytes:
        """Returns the encoded GetResponse (codec.encode_get_results)."""
        session = self.desk.find(request.session_id, context, "Get")
        return self.reads.get(session, request)

    def GetStream(self, data: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        """Yields encoded GetResponse messages, results in request order. The read is one call (refused
        like any other); the messages are sent after it."""
        results = self.calls.run("GetStream", context, lambda: self._read_for_stream(data, context))
        yield from self.reads.stream(results)

    def _read_for_stream(self, data: bytes, context: grpc.ServicerContext) -> list[ReadResult]:
        with self.calls.admitted(intake.GET, data) as request:
            session = self.desk.find(request.session_id, context, "GetStream")
            results, _ = self.reads.read(session, request, "GetStream")
        return results

    @rpc(intake.RELEASE_LEASES)
    def ReleaseLeases(
        self, request: pb.ReleaseLeasesRequest, context: grpc.ServicerContext
    ) -> pb.ReleaseLeasesResponse:
        session = self.desk.find(request.session_id, context, "ReleaseLeases")
        validation.batch_size("lease_ids", len(request.lease_ids), self.limits)
        self.leases.release(session, list(request.lease_ids))
        return pb.ReleaseLeasesResponse()

    # -- shared memory ------------------------------------------------------

    @rpc(intake.ATTACH_SHARED_MEMORY)
    def AttachSharedMemory(
        self, request: pb.AttachSharedMemoryRequest, context: grpc.ServicerContext
    ) -> pb.AttachSharedMemoryResponse:
        session = self.desk.find(request.session_id, context, "AttachSharedMemory")
        return self.slots.attach(session, request.nonce)

    @rpc(intake.RESERVE_SLOTS)
    def ReserveSlots(
        self, request: pb.ReserveSlotsRequest, context: grpc.ServicerContext
    ) -> pb.ReserveSlotsResponse:
        session = self.desk.find(request.session_id, context, "ReserveSlots")
        return self.slots.reserve(session, request)

    @rpc(intake.COMMIT_SLOTS)
    def CommitSlots(
        self, request: pb.CommitSlotsRequest, context: grpc.ServicerContext
    ) -> pb.CommitSlotsResponse:
        session = self.desk.find(request.session_id, context, "CommitSlots")
        return self.slots.commit(session, request)

    @rpc(intake.GET)
    def GetReferences(
        self, request: pb.GetRequest, context: grpc.ServicerContext
    ) -> pb.GetReferencesResponse:
        session = self.desk.find(request.session_id, context, "GetReferences")
        return self.slots.references(session, request)

    # -- diagnostics --------------------------------------------------------

    @rpc(intake.DIAGNOSE)
    def Diagnose(self, request: pb.DiagnoseRequest, context: grpc.ServicerContext) -> pb.DiagnoseResponse:
        principal = self.access.viewer(context, "Diagnose")
        # Only the caller's tenants: another tenant's namespace is absent exactly as an unknown one is.
        return self.pages.page(request, None if principal.sees_everything else principal.may_use)

    @rpc(intake.GET_STATS)
    def GetStats(self, request: pb.GetStatsRequest, context: grpc.ServicerContext) -> pb.GetStatsResponse:
        principal = self.access.viewer(context, "GetStats")
        return tenant_stats.stats_response(self.backend.stats(), self.census.tenants(), principal)
