"""The kvtag.v1 KvStore API layer: sessions, tag enforcement, leases and counters over a BlockBackend."""

from __future__ import annotations

import functools
import logging
import secrets
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from itertools import repeat
from operator import attrgetter
from typing import Any, TypeVar

import grpc
from kvtag.v1 import store_pb2 as pb
from kvtag.v1 import store_pb2_grpc

from kvtag_store import errors
from kvtag_store.api import codec, intake, validation
from kvtag_store.api.admission import COPIES, Admission
from kvtag_store.backends.arena import NONCE_LENGTH, NONCE_OFFSET, Arena
from kvtag_store.backends.base import (
    BackendUnavailable,
    BlockAddress,
    BlockBackend,
    BlockKey,
    CensusStore,
    KeyStatus,
    Payload,
    PutOutcome,
    PutResult,
    ReadResult,
    SharedMemoryBackend,
    SlotReference,
)
from kvtag_store.backends.memory.backend import MemoryBackend
from kvtag_store.config import ServiceConfig, ServiceLimits
from kvtag_store.observe import logs, tenant_stats
from kvtag_store.observe.metrics import KEY_STATUS_NAMES, PUT_STATUS_NAMES, StoreMetrics
from kvtag_store.policy.base_keys import BaseKeyIndex
from kvtag_store.policy.census import Census
from kvtag_store.policy.sessions import Session, SessionTable, Unpin
from kvtag_store.security.access import Access
from kvtag_store.security.tokens import Principal, TokenRegistry

log = logging.getLogger("kvtag_store.api.servicer")
# Requests refused before they were read (malformed bytes, admission): one line a second per reason.
rejections = logs.RateLimited(log)
_UNREAD = frozenset({"MALFORMED_REQUEST", "SERVER_BUSY"})


def message_headroom(max_message_bytes: int) -> int:
    """Room left in a message for everything but the value (keys, statuses, framing): 1 MiB, or a
    sixteenth of a smaller message limit (a 1 MiB limit still carries 960 KiB values)."""
    return min(1 << 20, max_message_bytes // 16)


STREAM_MESSAGE_BYTES = (4 << 20) - (64 << 10)
_HIT, _MISS, _MISMATCH = KeyStatus.HIT, KeyStatus.MISS, KeyStatus.MODE_MISMATCH
_HIT_BYTE = bytes([_HIT])

_SHM_REFUSED = PutResult(
    PutOutcome.REJECTED,
    "data path not negotiated: this session uses DATA_PATH_INLINE (attach the shared-memory arena "
    "with AttachSharedMemory first); send the bytes in `value`",
)
_SHM_IN_PUT = PutResult(
    PutOutcome.REJECTED,
    "shared-memory values are not committed by Put: reserve slots (ReserveSlots), write them and "
    "commit them (CommitSlots), or send the bytes in `value`",
)
_NO_PAYLOAD = PutResult(PutOutcome.REJECTED, "item carries no payload; set `value`")
# Put outcomes after which the block is stored in the caller's mode; they carry no reason (the rest
# do, in CommitSlotsResponse.packed_reasons).
_SETTLED = (PutOutcome.STORED, PutOutcome.ALREADY_PRESENT)
_SESSION_ENDED = PutResult(
    PutOutcome.REJECTED, "the session ended while its slots were being reserved; open a new session"
)
_NOT_RESERVED = PutResult(
    PutOutcome.REJECTED,
    "no such reservation: the slot was not reserved by this session (ReserveSlots), was already "
    "committed; reserve again",
)

R = TypeVar("R")
_GROUP_KEY = attrgetter("group", "key")


def rpc(spec: intake.Intake | None) -> Callable[[Callable[..., R]], Callable[..., R]]:
    """Time the call, turn ApiError / BackendUnavailable into rich statuses, and (with `spec`) take the
    raw request bytes through intake.admitted: counted, admitted, parsed, held until the call ends.
    Without `spec` the method receives what gRPC gives it (the raw stream of PutStream)."""

    def decorate(method: Callable[..., R]) -> Callable[..., R]:
        name = method.__name__

        @functools.wraps(method)
        def wrapper(self: KvStoreService, data: Any, context: grpc.ServicerContext) -> R:
            started = time.perf_counter()
            try:
                if spec is None:
                    return method(self, data, context)
                with self.admitted(spec, data) as request:
                    return method(self, request, context)
            except errors.ApiError as exc:
                failure = exc
            except BackendUnavailable as exc:
                failure = errors.backend_unavailable(str(exc))
            except Exception:  # a bug: log it with the stack; gRPC answers UNKNOWN
                log.exception("%s failed unexpectedly", name, extra={"rpc": name})
                raise
            finally:
                self.metrics.rpc_seconds.labels(name).observe(time.perf_counter() - started)
            self.refused(name, failure)
            context.abort_with_status(failure.status)
            raise AssertionError("abort_with_status returns only by raising")

        return wrapper

    return decorate


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
        self.access = access or Access(TokenRegistry.disabled())
        # A backend whose values pass through arenas (memory keeps them there, Mooncake stages them):
        # only it offers the shared-memory path.
        self.arenas = backend if isinstance(backend, SharedMemoryBackend) else None
        self.config = config
        self.limits = config.limits
        self.metrics = metrics
        self.sessions = SessionTable(config.session_ttl_ms)
        self.census = Census(census_store, config.namespace_policies, config.default_policy)
        self.base_index = BaseKeyIndex(config.base_index_entries)
        self.admission = Admission(config.max_inflight_bytes)
        self.message_budget = self.limits.max_message_bytes - message_headroom(self.limits.max_message_bytes)
        self.max_value_bytes = min(backend.max_value_bytes, self.message_budget)
        self._stop = threading.Event()
        self._reaper: threading.Thread | None = None
        metrics.watch(backend.stats, self.census.live_sessions)

    # -- lifecycle ----------------------------------------------------------

    def start(self) -> None:
        """Start the thread that expires sessions and leases."""
        self._reaper = threading.Thread(target=self._reap_forever, name="kvtag-reaper", daemon=True)
        self._reaper.start()

    def stop(self) -> None:
        self._stop.set()
        if self._reaper is not None:
            self._reaper.join(timeout=1)

    def _reap_forever(self) -> None:
        interval = min(0.25, self.config.session_ttl_ms / 4000.0)
        while not self._stop.wait(interval):
            try:
                self.reap()
            except Exception:  # the reaper must outlive a bad backend call
                log.exception("reaping expired sessions failed")

    def reap(self) -> None:
        dead, unpins = self.sessions.expire()
        for session in dead:
            self._cancel_reservations(session)
            self.census.left(session)
            self.metrics.sessions_expired.inc()
            log.info(
                "session expired without heartbeat",
                extra={"session_id": session.session_id, "engine_id": session.engine_id},
            )
        self._unpin(unpins)

    def _cancel_reservations(self, session: Session) -> None:
        generations = self.sessions.drain_reservations(session)
        if generations and self.arenas is not None:
            self.arenas.cancel(generations)

    def _unpin(self, unpins: Iterable[Unpin]) -> None:
        for namespace_id, addresses in unpins:
            self.backend.unpin(namespace_id, addresses)

    def _session(self, session_id: str, context: grpc.ServicerContext, rpc: str) -> Session:
        """The caller's live session. One of a tenant the caller's token does not grant is answered as
        unknown, so a session id used under another token gets nothing, not even its existence."""
        principal = self.access.session_caller(context, rpc)
        session = self.sessions.touch(validation.session_id(session_id), _tenant_check(principal))
        if session is None:
            raise errors.session_not_found(session_id)
        return session

    def admitted(self, spec: intake.Intake, data: bytes) -> AbstractContextManager[Any]:
        return intake.admitted(spec, data, self.limits.max_batch_items, self.admission)

    def refused(self, name: str, failure: errors.ApiError) -> None:
        """Count and log a refused call: one line each, rate-limited for requests refused unread."""
        self.metrics.rpc_errors.labels(name, failure.reason).inc()
        extra = {"rpc": name, "reason": failure.reason}
        if failure.reason in _UNREAD:
            rejections.warning(failure.reason, "%s refused: %s", name, failure.message, extra=extra)
        else:
            log.info("%s refused: %s", name, failure.message, extra=extra)

    def limits_message(self) -> pb.Limits:
        return pb.Limits(
            max_key_bytes=self.limits.max_key_bytes,
            max_batch_items=self.limits.max_batch_items,
            max_value_bytes=self.max_value_bytes,
            max_message_bytes=self.limits.max_message_bytes,
        )

    # -- sessions -----------------------------------------------------------

    @rpc(intake.OPEN_SESSION)
    def OpenSession(
        self, request: pb.OpenSessionRequest, context: grpc.ServicerContext
    ) -> pb.OpenSessionResponse:
        principal = self.access.opener(context, request.namespace.tenant)
        validation.open_session(request, self.limits)
        try:
            admission = self.census.admit(request)
        except errors.ApiError as refusal:
            self.metrics.sessions_refused.labels(refusal.reason).inc()
            if refusal.reason == "PROBE_DISAGREEMENT":
                self.metrics.probe_disagreements.inc()
            raise
        if any(w.kind == "PROBE_DISAGREEMENT" for w in admission.warnings):
            self.metrics.probe_disagreements.inc()
        tenant = request.namespace.tenant
        session = self.sessions.open(
            request.engine_id, admission.namespace_id, admission.mode_id, dict(request.labels), tenant
        )
        assign_tenant = getattr(self.backend, "assign_tenant", None)
        if assign_tenant is not None:
            assign_tenant(admission.namespace_id, tenant)
        offer = (
            self._shared_memory_offer(admission.namespace_id)
            if pb.DATA_PATH_SHARED_MEMORY in request.data_paths
            else None
        )
        self.census.joined(session, request.mode)
        log.info(
            "session opened",
            extra={
                "session_id": session.session_id,
                "engine_id": request.engine_id,
                "principal": principal.name,
                "namespace_id": admission.namespace_id,
                "mode_id": admission.mode_id,
                "warnings": [w.kind for w in admission.warnings],
            },
        )
        return pb.OpenSessionResponse(
            session_id=session.session_id,
            namespace_id=admission.namespace_id,
            mode_id=admission.mode_id,
            policy=admission.policy,  # type: ignore[arg-type]
            warnings=admission.warnings,
            session_ttl_ms=self.config.session_ttl_ms,
            data_path=pb.DATA_PATH_INLINE,
            limits=self.limits_message(),
            shared_memory_offer=offer,
        )

    def _shared_arena(self, namespace_id: str) -> Arena | None:
        return self.arenas.shared_arena(namespace_id) if self.arenas is not None else None

    def _shared_memory_offer(self, namespace_id: str) -> pb.SharedMemoryOffer | None:
        """The namespace's tenant arena, when the backend keeps values in shared memory."""
        arena = self._shared_arena(namespace_id)
        if arena is None:
            return None
        return pb.SharedMemoryOffer(
            segment=arena.segment,
            path=arena.path or "",
            size_bytes=arena.size,
            nonce_offset=NONCE_OFFSET,
            nonce_length=NONCE_LENGTH,
        )

    @rpc(intake.ATTACH_SHARED_MEMORY)
    def AttachSharedMemory(
        self, request: pb.AttachSharedMemoryRequest, context: grpc.ServicerContext
    ) -> pb.AttachSharedMemoryResponse:
        """The client read the arena's nonce through its own mapping, so it can map the segment."""
        session = self._session(request.session_id, context, "AttachSharedMemory")
        arena = self._shared_arena(session.namespace_id)
        if arena is None or not secrets.compare_digest(request.nonce, arena.nonce):
            log.info(
                "shared-memory attach refused: %s",
                "no shared-memory arena" if arena is None else "wrong nonce",
                extra={"session_id": session.session_id, "engine_id": session.engine_id},
            )
            return pb.AttachSharedMemoryResponse(data_path=pb.DATA_PATH_INLINE)
        session.shared_memory = True
        log.info(
            "session attached the shared-memory arena",
            extra={
                "session_id": session.session_id,
                "engine_id": session.engine_id,
                "segment": arena.segment,
            },
        )
        return pb.AttachSharedMemoryResponse(data_path=pb.DATA_PATH_SHARED_MEMORY)

    @rpc(intake.RESERVE_SLOTS)
    def ReserveSlots(
        self, request: pb.ReserveSlotsRequest, context: grpc.ServicerContext
    ) -> pb.ReserveSlotsResponse:
        session = self._session(request.session_id, context, "ReserveSlots")
        packed = bool(request.packed_items)
        items = _packed_slot_items(request, self.limits) if packed else _slot_items(request, self.limits)
        response = pb.ReserveSlotsResponse()
        if not session.shared_memory or self.arenas is None:
            refused = [_SHM_REFUSED] * len(items)
            if packed:
                _pack_grants(response.packed, refused)
            else:
                _list_grants(response.grants, refused)
            return response
        # The same per-item limit as an inline Put, so both paths give the same results.
        limit = self.max_value_bytes
        reserved = iter(
            self.arenas.reserve(
                session.namespace_id,
                session.mode_id,
                [((group, BlockKey(key)), length) for group, key, _, length in items if length <= limit],
            )
        )
        granted = [next(reserved) if length <= limit else self._too_large(length) for *_, length in items]
        granted = self._hold(session, granted)
        # Outcomes known now are counted now; the granted ones when committed. Base keys are recorded
        # for what will be (or already is) stored in this mode.
        known = Counter(g.outcome for g in granted if isinstance(g, PutResult))
        if known:
            self._tally_puts(session, known, 0)
        base_keys = [
            (group, base_key)
            for (group, _, base_key, _), grant in zip(items, granted, strict=True)
            if base_key and (not isinstance(grant, PutResult) or grant.outcome is PutOutcome.ALREADY_PRESENT)
        ]
        if base_keys:
            self.base_index.record(session.namespace_id, session.mode_id, base_keys)
        if packed:
            _pack_grants(response.packed, granted)
        else:
            _list_grants(response.grants, granted)
        return response

    def _hold(
        self, session: Session, granted: list[SlotReference | PutResult]
    ) -> list[SlotReference | PutResult]:
        """Record granted slots as the session's, so its end frees them; if it ended meanwhile, free
        them now and answer REJECTED."""
        generations = [g.generation for g in granted if not isinstance(g, PutResult)]
        if not generations or self.sessions.add_reservations(session, generations):
            return granted
        if self.arenas is not None:
            self.arenas.cancel(generations)
        return [g if isinstance(g, PutResult) else _SESSION_ENDED for g in granted]

    @rpc(intake.COMMIT_SLOTS)
    def CommitSlots(
        self, request: pb.CommitSlotsRequest, context: grpc.ServicerContext
    ) -> pb.CommitSlotsResponse:
        """Shared-memory Put, step 2: checksum (or take the client's digests), tag and insert the written
        slots the session reserved, binding spare ones to the keys sent; then give back cancelled
        slots and grant the spare ones asked for the next put."""
        session = self._session(request.session_id, context, "CommitSlots")
        validation.batch_size("generations", len(request.generations), self.limits)
        validation.batch_size("spare_lengths", len(request.spare_lengths), self.limits)
        validation.batch_size("cancel_generations", len(request.cancel_generations), self.limits)
        generations = list(request.generations)
        keys = _commit_keys(request, self.limits) if request.packed_items else None
        sent = len(request.xxh3_64)  # checked before listing: a huge list would cost ~36 B per digest
        if sent and sent != len(generations):
            raise errors.invalid_request(
                f"xxh3_64 has {sent} digests for {len(generations)} generations: send one "
                "per generation, in the same order, or none",
                "xxh3_64",
            )
        sent_digests = list(request.xxh3_64)
        held = self.sessions.take_reservations(session, generations)
        claimed = [g for g, ok in zip(generations, held, strict=True) if ok]
        digests = [d for d, ok in zip(sent_digests, held, strict=True) if ok] if sent_digests else None
        addresses = (
            [(group, BlockKey(key)) for (group, key, _), ok in zip(keys, held, strict=True) if ok]
            if keys is not None
            else None
        )
        outcomes: list[PutResult] = []
        stored_bytes = 0
        if claimed and self.arenas is not None:
            outcomes, stored_bytes = self.arenas.commit(
                session.namespace_id, session.mode_id, claimed, digests, addresses
            )
        committed = iter(outcomes)
        results = [next(committed) if ok else _NOT_RESERVED for ok in held]
        self._tally_puts(session, Counter(r.outcome for r in results), stored_bytes)
        if keys is not None:
            self._record_base_keys(session, keys, results)
        response = pb.CommitSlotsResponse()
        if keys is not None:
            response.packed_statuses = bytes(r.outcome for r in results)
            response.packed_reasons.extend([r.reason for r in results if r.outcome not in _SETTLED])
        else:
            response.results.extend(
                pb.PutResult(status=r.outcome, reason=r.reason)  # type: ignore[arg-type]
                for r in results
            )
        if request.cancel_generations:
            cancel = list(request.cancel_generations)
            held = self.sessions.take_reservations(session, cancel)
            if self.arenas is not None:
                self.arenas.cancel([g for g, ok in zip(cancel, held, strict=True) if ok])
        if request.spare_lengths:
            _pack_grants(response.spare, self._spares(session, list(request.spare_lengths)))
        return response

    def _spares(self, session: Session, lengths: list[int]) -> list[SlotReference | PutResult]:
        if not session.shared_memory or self.arenas is None:
            return [_SHM_REFUSED] * len(lengths)
        limit = self.max_value_bytes
        spare = iter(self.arenas.reserve_spare(session.namespace_id, [n for n in lengths if 0 < n <= limit]))
        return self._hold(session, [next(spare) if 0 < n <= limit else self._too_large(n) for n in lengths])

    def _record_base_keys(
        self, session: Session, keys: Sequence[tuple[int, bytes, bytes]], results: Sequence[PutResult]
    ) -> None:
        """Base keys of what is now stored in this mode, as ReserveSlots records them."""
        base_keys = [
            (group, base_key)
            for (group, _, base_key), result in zip(keys, results, strict=True)
            if base_key and result.outcome in _SETTLED
        ]
        if base_keys:
            self.base_index.record(session.namespace_id, session.mode_id, base_keys)

    @rpc(intake.HEARTBEAT)
    def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.ServicerContext) -> pb.HeartbeatResponse:
        self._session(request.session_id, context, "Heartbeat")
        return pb.HeartbeatResponse(session_ttl_ms=self.config.session_ttl_ms)

    @rpc(intake.CLOSE_SESSION)
    def CloseSession(
        self, request: pb.CloseSessionRequest, context: grpc.ServicerContext
    ) -> pb.CloseSessionResponse:
        principal = self.access.session_caller(context, "CloseSession")
        session, unpins = self.sessions.close(
            validation.session_id(request.session_id), _tenant_check(principal)
        )
        self._unpin(unpins)
        if session is not None:
            self._cancel_reservations(session)
            self.census.left(session)
            log.info(
                "session closed", extra={"session_id": session.session_id, "engine_id": session.engine_id}
            )
        return pb.CloseSessionResponse()

    # -- data ---------------------------------------------------------------

    @rpc(intake.LOOKUP)
    def Lookup(self, request: codec.LookupBatch, context: grpc.ServicerContext) -> pb.LookupResponse:
        session = self._session(request.session_id, context, "Lookup")
        ns_id, mode_id = session.namespace_id, session.mode_id
        if request.packed:
            assert request.message is not None
            validation.packed_blocks(request.message, self.limits)
            packed, pinned = self._lookup_packed(ns_id, mode_id, request.message.packed_blocks)
            hits = packed.count(_HIT)
            mismatches = packed.count(_MISMATCH)
            misses = len(packed) - hits - mismatches
            prefix = len(packed) - len(packed.lstrip(_HIT_BYTE))
            statuses: Sequence[int] = packed
            response = pb.LookupResponse(prefix_length=prefix, packed_statuses=packed)
        else:
            addresses = validation.addresses(request.addresses, "blocks", self.limits, request.key_length)
            listed, pinned = self._lookup_and_pin(ns_id, mode_id, addresses)
            hits = listed.count(_HIT)
            mismatches = listed.count(_MISMATCH)
            misses = len(listed) - hits - mismatches
            prefix = _prefix_length(listed, misses, mismatches)
            statuses = listed
            response = pb.LookupResponse(prefix_length=prefix, statuses=listed)  # type: ignore[arg-type]
        cross = self._cross_mode_misses(session, request, statuses) if misses else None
        if pinned:
            lease_ms = min(request.lease_ms or self.config.default_lease_ms, self.config.max_lease_ms)
            response.lease.lease_id = self.sessions.add_lease(session, ns_id, pinned, lease_ms)
            response.lease.expires_in_ms = lease_ms
        self.census.count(session, hits=hits, misses=misses, mode_mismatches=mismatches, cross_mode=cross)
        self._count_keys(self.metrics.lookup_keys, hits, misses, mismatches)
        if cross:
            self.metrics.cross_mode_misses.inc(sum(cross.values()))
        return response

    def _lookup_packed(
        self, ns_id: str, mode_id: str, runs: Sequence[pb.PackedBlocks]
    ) -> tuple[bytes, Sequence[BlockAddress]]:
        """A status byte per key of validated packed runs, and the pinned hits. The memory backend
        answers on the key bytes (no tuple per key); other backends get (group, key) addresses."""
        packed = getattr(self.backend, "lookup_packed_and_pin", None)
        if packed is not None:
            statuses, pinned = packed(ns_id, mode_id, [(run.group, run.keys, run.key_length) for run in runs])
            return statuses, pinned if pinned is not None else ()
        listed, pinned = self._lookup_and_pin(ns_id, mode_id, codec.packed_addresses(runs))
        return bytes(listed), pinned

    def _lookup_and_pin(
        self, ns_id: str, mode_id: str, addresses: list[BlockAddress]
    ) -> tuple[list[KeyStatus], Sequence[BlockAddress]]:
        """Statuses and the pinned hits. Backends that can do both atomically (the memory backend's
        lookup_and_pin) leave no window for an eviction between lookup and pin."""
        atomic = getattr(self.backend, "lookup_and_pin", None)
        if atomic is not None:
            statuses, pinned = atomic(ns_id, mode_id, addresses)
            return statuses, pinned
        statuses = self.backend.lookup(ns_id, mode_id, addresses)
        hits = statuses.count(_HIT)
        if not hits:
            return statuses, []
        pinned = (
            addresses
            if hits == len(addresses)
            else [a for a, s in zip(addresses, statuses, strict=True) if s == _HIT]
        )
        self.backend.pin(ns_id, pinned)
        return statuses, pinned

    def _cross_mode_misses(
        self, session: Session, request: codec.LookupBatch, statuses: Sequence[int]
    ) -> Counter[str] | None:
        """Misses another mode holds, by base key. Clients send base keys for all items or none, so the
        first miss tells whether to look (reading base_key of every item would double Lookup's cost)."""
        missed = [i for i, s in enumerate(statuses) if s == _MISS]
        items = request.base_keys(missed)
        if not items:
            return None
        return self.base_index.other_holders(session.namespace_id, session.mode_id, items) or None

    @staticmethod
    def _count_keys(counter: Any, hits: int, misses: int, mismatches: int) -> None:
        if hits:
            counter.labels(KEY_STATUS_NAMES[pb.HIT]).inc(hits)
        if misses:
            counter.labels(KEY_STATUS_NAMES[pb.MISS]).inc(misses)
        if mismatches:
            counter.labels(KEY_STATUS_NAMES[pb.MODE_MISMATCH]).inc(mismatches)

    def _put_items(
        self, session: Session, items: Sequence[codec.PutItemView], results: list[pb.PutResult]
    ) -> None:
        """All value items of the request go to the backend in one put_many call (a batch backend
        amortises its round trips); items without an inline value are refused in place."""
        ns_id, mode_id = session.namespace_id, session.mode_id
        outcomes: list[PutResult | None] = [None] * len(items)
        batch: list[tuple[BlockAddress, Payload]] = []
        batch_index: list[int] = []
        for index, item in enumerate(items):
            payload = item.payload
            if payload == "value" and len(item.value) > self.max_value_bytes:
                outcomes[index] = self._too_large(len(item.value))
            elif payload == "value":
                batch.append(((item.group, BlockKey(item.key)), item.value))
                batch_index.append(index)
            elif payload == "shared_memory":
                outcomes[index] = _SHM_IN_PUT if session.shared_memory else _SHM_REFUSED
            else:
                outcomes[index] = _NO_PAYLOAD
        if batch:
            stored = self.backend.put_many(ns_id, mode_id, batch)
            if len(stored) != len(batch):
                raise RuntimeError(f"backend put_many returned {len(stored)} results for {len(batch)} items")
            for index, result in zip(batch_index, stored, strict=True):
                outcomes[index] = result
        counts: Counter[PutOutcome] = Counter()
        base_keys: list[tuple[int, bytes]] = []
        stored_bytes = 0
        for item, maybe in zip(items, outcomes, strict=True):
            result = maybe if maybe is not None else _NO_PAYLOAD
            outcome = result.outcome
            counts[outcome] += 1
            if outcome is PutOutcome.STORED:
                stored_bytes += len(item.value)
            if item.base_key and outcome in (PutOutcome.STORED, PutOutcome.ALREADY_PRESENT):
                base_keys.append((item.group, item.base_key))
            results.append(pb.PutResult(status=outcome, reason=result.reason))  # type: ignore[arg-type]
        if base_keys:
            self.base_index.record(ns_id, mode_id, base_keys)
        self._tally_puts(session, counts, stored_bytes)

    def _tally_puts(self, session: Session, counts: Counter[PutOutcome], stored_bytes: int) -> None:
        self.census.count(session, conflicts=counts[PutOutcome.CONFLICT], stored=counts[PutOutcome.STORED])
        for outcome, count in counts.items():
            self.metrics.put_items.labels(PUT_STATUS_NAMES[outcome]).inc(count)  # type: ignore[index]
        if stored_bytes:
            self.metrics.put_bytes.inc(stored_bytes)

    def _too_large(self, size: int) -> PutResult:
        return PutResult(
            PutOutcome.REJECTED,
            f"value of {size} bytes exceeds Limits.max_value_bytes of {self.max_value_bytes} bytes (the "
            "smallest of the store capacity, the backend's value limit and --max-message-bytes less "
            "headroom); store smaller blocks",
        )

    def _check_put_keys(self, items: list[codec.PutItemView]) -> None:
        validation.batch_size("items", len(items), self.limits)
        for index, item in enumerate(items):
            validation.key(item.key, f"items[{index}].block.key", self.limits)

    @rpc(intake.PUT)
    def Put(self, request: codec.PutBatch, context: grpc.ServicerContext) -> pb.PutResponse:
        session = self._session(request.session_id, context, "Put")
        self._check_put_keys(request.items)
        response = pb.PutResponse()
        results: list[pb.PutResult] = []
        self._put_items(session, request.items, results)
        response.results.extend(results)
        return response

    @rpc(None)
    def PutStream(self, request_iterator: Iterator[bytes], context: grpc.ServicerContext) -> pb.PutResponse:
        """Messages are handled in order, each admitted on its own. When one fails, the error carries
        the results of the items of the earlier messages (they were handled), as a PutResponse."""
        session: Session | None = None
        results: list[pb.PutResult] = []
        for data in request_iterator:
            try:
                with self.admitted(intake.PUT, data) as request:
                    session = self._put_message(session, request, results, context)
            except errors.ApiError as exc:
                if session is not None:
                    exc.details["put_results"] = pb.PutResponse(results=results)
                raise
        if session is None:
            raise errors.invalid_request(
                "PutStream carried no message; send at least one PutRequest", "session_id"
            )
        response = pb.PutResponse()
        response.results.extend(results)
        return response

    def _put_message(
        self,
        session: Session | None,
        request: codec.PutBatch,
        results: list[pb.PutResult],
        context: grpc.ServicerContext,
    ) -> Session:
        if session is None:
            session = self._session(request.session_id, context, "PutStream")
        elif request.session_id and request.session_id != session.session_id:
            raise errors.invalid_request(
                "a PutStream carries one session; later messages must omit session_id or repeat it",
                "session_id",
            )
        else:
            self.sessions.touch(session.session_id)
        self._check_put_keys(request.items)
        self._put_items(session, request.items, results)
        return session

    def _read(
        self, request: pb.GetRequest, context: grpc.ServicerContext, rpc: str, views: bool = False
    ) -> tuple[Session, list[BlockAddress], list[Any], Sequence[BlockAddress]]:
        """Results of a Get and what they pinned. With `views` (the memory backend only) the values are
        views of their slots, pinned until the caller unpins them; otherwise copies, nothing pinned."""
        session = self._session(request.session_id, context, rpc)
        if request.packed_blocks:
            raise errors.invalid_request(
                f"packed_blocks is for GetReferences (the shared-memory path); {rpc} takes blocks",
                "packed_blocks",
            )
        addresses = validation.addresses(list(map(_GROUP_KEY, request.blocks)), "blocks", self.limits)
        pinned: Sequence[BlockAddress] = ()
        if views and isinstance(self.backend, MemoryBackend):
            results, pinned = self.backend.get_views(session.namespace_id, session.mode_id, addresses)
        else:
            results = self.backend.get(session.namespace_id, session.mode_id, addresses)
        try:
            if request.lease_id:
                self._unpin(self.sessions.release(session, [request.lease_id]))
            hits = sum(1 for r in results if r.status == _HIT)
            mismatches = sum(1 for r in results if r.status == _MISMATCH)
            misses = len(results) - hits - mismatches
            self.census.count(session, hits=hits, misses=misses, mode_mismatches=mismatches)
            self._count_keys(self.metrics.get_keys, hits, misses, mismatches)
        except BaseException:
            if pinned:  # these pins belong to no lease: nothing else would ever drop them
                self.backend.unpin(session.namespace_id, pinned)
            raise
        return session, addresses, results, pinned

    @rpc(intake.GET)
    def Get(self, request: pb.GetRequest, context: grpc.ServicerContext) -> bytes:
        """Returns the encoded GetResponse (codec.encode_get_results): with the memory backend each value
        is copied once, from its pinned slot straight into the reply."""
        session, _, results, pinned = self._read(request, context, "Get", views=True)
        try:
            served = sum(len(r.value) for r in results if r.value is not None)
            with self.admission.hold(COPIES * served):
                reply = codec.encode_get_results(results)
        finally:
            if pinned:
                self.backend.unpin(session.namespace_id, pinned)
        self.metrics.get_bytes.inc(served)
        return reply

    @rpc(intake.GET)
    def GetReferences(
        self, request: pb.GetRequest, context: grpc.ServicerContext
    ) -> pb.GetReferencesResponse:
        """Shared-memory Get: references to pinned, verified slots under a lease the client releases."""
        session = self._session(request.session_id, context, "GetReferences")
        if not session.shared_memory or self.arenas is None:
            raise errors.data_path_not_negotiated("GetReferences")
        if request.packed_blocks:
            validation.packed_blocks(request, self.limits, "GetReferences")
            addresses = codec.packed_addresses(request.packed_blocks)
        else:
            addresses = validation.addresses(list(map(_GROUP_KEY, request.blocks)), "blocks", self.limits)
        ns_id = session.namespace_id
        statuses, references, pinned = self.arenas.get_references(
            ns_id, session.mode_id, addresses, verify=not request.verify_in_client
        )
        if request.lease_id:
            self._unpin(self.sessions.release(session, [request.lease_id]))
        response = pb.GetReferencesResponse()
        if request.packed_blocks:
            served = _pack_references(response.packed, statuses, references)
        else:
            served = _list_references(response.results, statuses, references)
        if pinned:
            lease_ms = self.config.default_lease_ms
            response.lease.lease_id = self.sessions.add_lease(session, ns_id, pinned, lease_ms)
            response.lease.expires_in_ms = lease_ms
        hits = statuses.count(_HIT)
        mismatches = statuses.count(_MISMATCH)
        misses = len(statuses) - hits - mismatches
        self.census.count(session, hits=hits, misses=misses, mode_mismatches=mismatches)
        self._count_keys(self.metrics.get_keys, hits, misses, mismatches)
        self.metrics.get_bytes.inc(served)
        return response

    def GetStream(self, data: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        """Yields encoded GetResponse messages of at most ~4 MiB each, results in request order."""
        started = time.perf_counter()
        try:
            with self.admitted(intake.GET, data) as request:
                _, _, results, _ = self._read(request, context, "GetStream")
        except errors.ApiError as exc:
            self.refused("GetStream", exc)
            context.abort_with_status(exc.status)
            return
        except BackendUnavailable as exc:
            self.refused("GetStream", errors.backend_unavailable(str(exc)))
            context.abort_with_status(errors.backend_unavailable(str(exc)).status)
            return
        finally:
            self.metrics.rpc_seconds.labels("GetStream").observe(time.perf_counter() - started)
        # Messages stay under gRPC's default 4 MiB receive limit so any client can read the stream;
        # only a single value larger than that needs a client that raised its limit (Limits says how far).
        budget = min(self.message_budget, STREAM_MESSAGE_BYTES)
        chunk: list[ReadResult] = []
        size = 0
        served = 0
        for r in results:
            length = len(r.value) if r.value is not None else 0
            if chunk and size + length > budget:
                yield codec.encode_get_results(chunk)
                chunk, size = [], 0
            chunk.append(r)
            size += length + 16
            served += length
        if chunk or not results:
            yield codec.encode_get_results(chunk)
        self.metrics.get_bytes.inc(served)

    @rpc(intake.RELEASE_LEASES)
    def ReleaseLeases(
        self, request: pb.ReleaseLeasesRequest, context: grpc.ServicerContext
    ) -> pb.ReleaseLeasesResponse:
        session = self._session(request.session_id, context, "ReleaseLeases")
        validation.batch_size("lease_ids", len(request.lease_ids), self.limits)
        self._unpin(self.sessions.release(session, list(request.lease_ids)))
        return pb.ReleaseLeasesResponse()

    # -- diagnostics --------------------------------------------------------

    @rpc(intake.DIAGNOSE)
    def Diagnose(self, request: pb.DiagnoseRequest, context: grpc.ServicerContext) -> pb.DiagnoseResponse:
        principal = self.access.viewer(context, "Diagnose")
        report = self.census.report(request.namespace_id)
        if principal.sees_everything:
            return report
        # Only the caller's tenants: another tenant's namespace is absent exactly as an unknown one is.
        return pb.DiagnoseResponse(
            namespaces=[ns for ns in report.namespaces if principal.may_use(ns.namespace.tenant)]
        )

    @rpc(intake.GET_STATS)
    def GetStats(self, request: pb.GetStatsRequest, context: grpc.ServicerContext) -> pb.GetStatsResponse:
        principal = self.access.viewer(context, "GetStats")
        return tenant_stats.stats_response(self.backend.stats(), self.census.tenants(), principal)


def _tenant_check(principal: Principal) -> Callable[[str], bool] | None:
    """The tenant test for a session lookup; None (no test) for a caller who may use every tenant."""
    return None if principal.sees_everything else principal.may_use


def _prefix_length(statuses: list[KeyStatus], misses: int, mismatches: int) -> int:
    """Index of the first non-HIT, found by C-level list.index rather than a Python loop."""
    first = len(statuses)
    if misses:
        first = statuses.index(_MISS)
    if mismatches:
        first = min(first, statuses.index(_MISMATCH))
    return first


def _list_references(
    results: Any, statuses: Sequence[KeyStatus], references: Sequence[SlotReference | None]
) -> int:
    """GetReferences' `results`, a message per block; returns the bytes referenced."""
    served = 0
    for status, reference in zip(statuses, references, strict=True):
        result = results.add(status=status)
        if reference is not None:
            _fill_slot(result.slot, reference)
            if reference.digest is not None:
                result.xxh3_64 = reference.digest
            served += reference.length
    return served


def _pack_references(
    packed: pb.PackedReferences, statuses: Sequence[KeyStatus], references: Sequence[SlotReference | None]
) -> int:
    """GetReferences' `packed` answer: parallel arrays over the hits; returns the bytes referenced."""
    hits = [r for r in references if r is not None]
    packed.statuses = bytes(statuses)
    if hits:
        packed.segment = hits[0].segment
        packed.offsets.extend([r.offset for r in hits])
        lengths = [r.length for r in hits]
        packed.lengths.extend(lengths)
        packed.generations.extend([r.generation for r in hits])
        if hits[0].digest is not None:
            packed.xxh3_64.extend([r.digest or 0 for r in hits])
        return sum(lengths)
    return 0


_SlotItem = tuple[int, bytes, bytes, int]  # (group, key, base_key, length)


def _slot_items(request: pb.ReserveSlotsRequest, limits: ServiceLimits) -> list[_SlotItem]:
    validation.batch_size("items", len(request.items), limits)
    # Each item's fields read once (every access to a upb sub-message builds a wrapper).
    items = [(item.block.group, item.block.key, item.block.base_key, item.length) for item in request.items]
    for index, (_, key, _, _) in enumerate(items):
        validation.key(key, f"items[{index}].block.key", limits)
    return items


def _packed_slot_items(request: pb.ReserveSlotsRequest, limits: ServiceLimits) -> list[_SlotItem]:
    if request.items:
        raise errors.invalid_request(
            "a ReserveSlots carries either items or packed_items, not both; send all items in one form",
            "packed_items",
        )
    total = validation.packed_runs(request.packed_items, "packed_items", limits)
    lengths = request.packed_lengths
    if len(lengths) != total:
        raise errors.invalid_request(
            f"packed_lengths has {len(lengths)} lengths for {total} keys: send one per key, in order",
            "packed_lengths",
        )
    items = _split_runs(request.packed_items)
    return [(group, key, base, length) for (group, key, base), length in zip(items, lengths, strict=True)]


def _commit_keys(request: pb.CommitSlotsRequest, limits: ServiceLimits) -> list[tuple[int, bytes, bytes]]:
    """The keys of the spare slots a CommitSlots names: (group, key, base key), one per generation."""
    total = validation.packed_runs(request.packed_items, "packed_items", limits)
    if total != len(request.generations):
        raise errors.invalid_request(
            f"packed_items has {total} keys for {len(request.generations)} generations: send one key "
            "per generation, in the same order, or none",
            "packed_items",
        )
    return _split_runs(request.packed_items)


def _split_runs(runs: Sequence[pb.PackedBlocks]) -> list[tuple[int, bytes, bytes]]:
    """(group, key, base key) of checked packed runs (validation.packed_runs), in order."""
    items: list[tuple[int, bytes, bytes]] = []
    for run in runs:
        keys = codec.split_keys(run.keys, run.key_length)
        bases = (
            codec.split_keys(run.base_keys, len(run.base_keys) // len(keys))
            if run.base_keys
            else repeat(b"", len(keys))
        )
        items.extend(zip(repeat(run.group), keys, bases))
    return items


def _list_grants(grants: Any, granted: Sequence[SlotReference | PutResult]) -> None:
    for grant in granted:
        if isinstance(grant, PutResult):
            grants.add(status=grant.outcome, reason=grant.reason)
        else:
            _fill_slot(grants.add().slot, grant)


def _fill_slot(slot: pb.SharedMemoryRef, reference: SlotReference) -> None:
    slot.segment = reference.segment
    slot.offset = reference.offset
    slot.length = reference.length
    slot.generation = reference.generation


def _pack_grants(packed: pb.PackedGrants, granted: Sequence[SlotReference | PutResult]) -> None:
    statuses = bytearray(len(granted))
    slots = [g for g in granted if not isinstance(g, PutResult)]
    known = [(i, g) for i, g in enumerate(granted) if isinstance(g, PutResult)]
    for i, result in known:
        statuses[i] = result.outcome
    packed.statuses = bytes(statuses)
    packed.reasons.extend([result.reason for _, result in known])
    if slots:
        packed.segment = slots[0].segment  # a session's slots all lie in its tenant's one arena
        packed.offsets.extend([g.offset for g in slots])
        packed.generations.extend([g.generation for g in slots])
