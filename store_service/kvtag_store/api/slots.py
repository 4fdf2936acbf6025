"""The shared-memory path: the arena a same-host client maps, two-phase puts into its slots (reserve,
write, commit), spare slots for the next put, and reads by reference under a lease.

A slot granted to a session is recorded as its reservation until committed or cancelled, so a
session that ends (closed or expired) gives its slots back.
"""

from __future__ import annotations

import logging
import secrets
from collections import Counter

from kvtag.v1 import store_pb2 as pb

from kvtag_store import errors
from kvtag_store.api import codec, replies, tokens, validation
from kvtag_store.api.counting import Counting, KeyTally
from kvtag_store.api.leases import Leases
from kvtag_store.api.outcomes import SESSION_ENDED, SETTLED, SHM_REFUSED, ValueLimit
from kvtag_store.api.tokens import TokenSink
from kvtag_store.backends.base import (
    NO_RESERVATION,
    BlockKey,
    PutOutcome,
    PutResult,
    SharedArena,
    SharedMemoryBackend,
    SlotReference,
)
from kvtag_store.config import ServiceLimits
from kvtag_store.policy.base_keys import BaseKeyIndex
from kvtag_store.policy.sessions import Session, SessionTable

log = logging.getLogger("kvtag_store.api.slots")

Grant = SlotReference | PutResult


class Slots:
    def __init__(
        self,
        backend: SharedMemoryBackend | None,
        sessions: SessionTable,
        leases: Leases,
        counting: Counting,
        base_index: BaseKeyIndex,
        value_limit: ValueLimit,
        limits: ServiceLimits,
        lease_ms: int,
        token_sink: TokenSink | None = None,
    ) -> None:
        """`backend`: the backend when it offers shared memory, else None (every slot call is refused)."""
        self.backend = backend
        self.sessions = sessions
        self.leases = leases
        self.counting = counting
        self.base_index = base_index
        self.value_limit = value_limit
        self.limits = limits
        self.lease_ms = lease_ms
        self.token_sink = token_sink or TokenSink()

    # -- the arena ------------------------------------------------------------

    def arena(self, namespace_id: str) -> SharedArena | None:
        """The namespace's tenant arena, when the backend keeps or stages values in shared memory."""
        return self.backend.shared_arena(namespace_id) if self.backend is not None else None

    def offer(self, namespace_id: str) -> pb.SharedMemoryOffer | None:
        arena = self.arena(namespace_id)
        return replies.shared_memory_offer(arena) if arena is not None else None

    def attach(self, session: Session, nonce: bytes) -> pb.AttachSharedMemoryResponse:
        """The client read the arena's nonce through its own mapping, so it can map the segment."""
        arena = self.arena(session.namespace_id)
        if arena is None or not secrets.compare_digest(nonce, arena.nonce):
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

    def _negotiated(self, session: Session) -> SharedMemoryBackend | None:
        return self.backend if session.shared_memory else None

    # -- puts -----------------------------------------------------------------

    def reserve(self, session: Session, request: pb.ReserveSlotsRequest) -> pb.ReserveSlotsResponse:
        """Shared-memory Put, step 1: a slot per item to write the value into, or its result at once
        (already present, conflict, too large)."""
        batch = codec.reserve_items(request, self.limits)
        token_ids = tokens.slot_tokens(request)
        response = pb.ReserveSlotsResponse()
        backend = self._negotiated(session)
        if backend is None:
            replies.grants(response, batch.packed, [SHM_REFUSED] * len(batch.items))
            return response
        self.token_sink.keep(session.namespace_id, token_ids)
        # The same per-item limit as an inline Put, so both paths give the same results.
        limit = self.value_limit.max_value_bytes
        reserved = iter(
            backend.reserve(
                session.namespace_id,
                session.mode_id,
                [
                    ((group, BlockKey(key)), length)
                    for group, key, _, length in batch.items
                    if length <= limit
                ],
            )
        )
        granted = [
            next(reserved) if length <= limit else self.value_limit.too_large(length)
            for *_, length in batch.items
        ]
        granted = self._hold(session, granted)
        # Outcomes known now are counted now; the granted ones when committed. Base keys are recorded
        # for what will be (or already is) stored in this mode.
        known = Counter(g.outcome for g in granted if isinstance(g, PutResult))
        if known:
            self.counting.puts(session, known, 0)
        self._record_base_keys(
            session,
            [
                (group, base_key)
                for (group, _, base_key, _), grant in zip(batch.items, granted, strict=True)
                if base_key
                and (not isinstance(grant, PutResult) or grant.outcome is PutOutcome.ALREADY_PRESENT)
            ],
        )
        replies.grants(response, batch.packed, granted)
        return response

    def commit(self, session: Session, request: pb.CommitSlotsRequest) -> pb.CommitSlotsResponse:
        """Shared-memory Put, step 2: checksum (or take the client's digests), tag and insert the written
        slots the session reserved, binding spare ones to the keys sent; then give back cancelled
        slots and grant the spare ones asked for the next put."""
        validation.batch_size("generations", len(request.generations), self.limits)
        validation.batch_size("spare_lengths", len(request.spare_lengths), self.limits)
        validation.batch_size("cancel_generations", len(request.cancel_generations), self.limits)
        generations = list(request.generations)
        keys = codec.commit_keys(request, self.limits)
        sent = len(request.xxh3_64)  # checked before listing: a huge list costs memory per digest
        if sent and sent != len(generations):
            raise errors.invalid_request(
                f"xxh3_64 has {sent} digests for {len(generations)} generations: send one "
                "per generation, in the same order, or none",
                "xxh3_64",
            )
        sent_digests = list(request.xxh3_64)
        if keys is not None:
            self.token_sink.keep(session.namespace_id, tokens.slot_tokens(request))
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
        if claimed and self.backend is not None:
            outcomes, stored_bytes = self.backend.commit(
                session.namespace_id, session.mode_id, claimed, digests, addresses
            )
        committed = iter(outcomes)
        results = [next(committed) if ok else NO_RESERVATION for ok in held]
        self.counting.puts(session, Counter(r.outcome for r in results), stored_bytes)
        if keys is not None:
            self._record_base_keys(
                session,
                [
                    (group, base_key)
                    for (group, _, base_key), result in zip(keys, results, strict=True)
                    if base_key and result.outcome in SETTLED
                ],
            )
        response = pb.CommitSlotsResponse()
        replies.commit_results(response, keys is not None, results)
        if request.cancel_generations:
            self._cancel_held(session, list(request.cancel_generations))
        if request.spare_lengths:
            replies.pack_grants(response.spare, self._spares(session, list(request.spare_lengths)))
        return response

    def _spares(self, session: Session, lengths: list[int]) -> list[Grant]:
        backend = self._negotiated(session)
        if backend is None:
            return [SHM_REFUSED] * len(lengths)
        limit = self.value_limit.max_value_bytes
        spare = iter(backend.reserve_spare(session.namespace_id, [n for n in lengths if 0 < n <= limit]))
        return self._hold(
            session, [next(spare) if 0 < n <= limit else self.value_limit.too_large(n) for n in lengths]
        )

    def _hold(self, session: Session, granted: list[Grant]) -> list[Grant]:
        """Record granted slots as the session's, so its end frees them; if it ended meanwhile, free
        them now and answer REJECTED."""
        generations = [g.generation for g in granted if not isinstance(g, PutResult)]
        if not generations or self.sessions.add_reservations(session, generations):
            return granted
        if self.backend is not None:
            self.backend.cancel(generations)
        return [g if isinstance(g, PutResult) else SESSION_ENDED for g in granted]

    def _cancel_held(self, session: Session, generations: list[int]) -> None:
        """Give back the slots of `generations` the session holds; others are ignored."""
        held = self.sessions.take_reservations(session, generations)
        if self.backend is not None:
            self.backend.cancel([g for g, ok in zip(generations, held, strict=True) if ok])

    def cancel_all(self, session: Session) -> None:
        """Give back every slot of a session that ended."""
        generations = self.sessions.drain_reservations(session)
        if generations and self.backend is not None:
            self.backend.cancel(generations)

    def _record_base_keys(self, session: Session, base_keys: list[tuple[int, bytes]]) -> None:
        if base_keys:
            self.base_index.record(session.namespace_id, session.mode_id, base_keys)

    # -- reads ----------------------------------------------------------------

    def references(self, session: Session, request: pb.GetRequest) -> pb.GetReferencesResponse:
        """Shared-memory Get: references to pinned, verified slots under a lease the client releases."""
        backend = self._negotiated(session)
        if backend is None:
            raise errors.data_path_not_negotiated("GetReferences")
        batch = codec.get_keys(request)
        batch.check(self.limits, "GetReferences")
        statuses, found, pinned = backend.get_references(
            session.namespace_id, session.mode_id, batch.addresses, verify=not request.verify_in_client
        )
        if request.lease_id:
            self.leases.release(session, [request.lease_id])
        response = pb.GetReferencesResponse()
        served = replies.references(response, batch.packed, statuses, found)
        if pinned:
            self.leases.grant(response.lease, session, pinned, self.lease_ms)
        self.counting.read(session, KeyTally.of(statuses))
        self.counting.served(served)
        return response
