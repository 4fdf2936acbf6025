"""Reply shaping: results into the response messages, in the wire form the request came in (a message
per item for the v1 form, parallel arrays for the packed one)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvtag.v1 import store_pb2 as pb
from kvtag_proto.arena_layout import NONCE_LENGTH, NONCE_OFFSET

from kvtag_store.api.outcomes import SETTLED
from kvtag_store.backends.base import KeyStatus, PutResult, SharedArena, SlotReference
from kvtag_store.config import ServiceLimits


def limits(service_limits: ServiceLimits, max_value_bytes: int) -> pb.Limits:
    return pb.Limits(
        max_key_bytes=service_limits.max_key_bytes,
        max_batch_items=service_limits.max_batch_items,
        max_value_bytes=max_value_bytes,
        max_message_bytes=service_limits.max_message_bytes,
    )


def shared_memory_offer(arena: SharedArena) -> pb.SharedMemoryOffer:
    return pb.SharedMemoryOffer(
        segment=arena.segment,
        path=arena.path or "",
        size_bytes=arena.size,
        nonce_offset=NONCE_OFFSET,
        nonce_length=NONCE_LENGTH,
    )


def lookup(packed: bool, statuses: Sequence[int], prefix_length: int) -> pb.LookupResponse:
    if packed:
        return pb.LookupResponse(prefix_length=prefix_length, packed_statuses=bytes(statuses))
    return pb.LookupResponse(prefix_length=prefix_length, statuses=statuses)  # type: ignore[arg-type]


def put_results(results: Sequence[PutResult]) -> list[pb.PutResult]:
    return [pb.PutResult(status=r.outcome, reason=r.reason) for r in results]  # type: ignore[arg-type]


def grants(
    response: pb.ReserveSlotsResponse, packed: bool, granted: Sequence[SlotReference | PutResult]
) -> None:
    """ReserveSlots' answer: a grant (a slot or a result) per item, in the request's form."""
    if packed:
        pack_grants(response.packed, granted)
        return
    for grant in granted:
        if isinstance(grant, PutResult):
            response.grants.add(status=grant.outcome, reason=grant.reason)
        else:
            _fill_slot(response.grants.add().slot, grant)


def pack_grants(packed: pb.PackedGrants, granted: Sequence[SlotReference | PutResult]) -> None:
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


def commit_results(response: pb.CommitSlotsResponse, packed: bool, results: Sequence[PutResult]) -> None:
    """CommitSlots' answer: packed when it bound keys to spare slots (the packed client), else a
    message per generation."""
    if packed:
        response.packed_statuses = bytes(r.outcome for r in results)
        response.packed_reasons.extend([r.reason for r in results if r.outcome not in SETTLED])
    else:
        response.results.extend(put_results(results))


def references(
    response: pb.GetReferencesResponse,
    packed: bool,
    statuses: Sequence[KeyStatus],
    found: Sequence[SlotReference | None],
) -> int:
    """GetReferences' answer in the request's form; returns the bytes referenced."""
    if packed:
        return _pack_references(response.packed, statuses, found)
    return _list_references(response.results, statuses, found)


def _list_references(
    results: Any, statuses: Sequence[KeyStatus], references: Sequence[SlotReference | None]
) -> int:
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
    """Parallel arrays over the hits."""
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


def _fill_slot(slot: pb.SharedMemoryRef, reference: SlotReference) -> None:
    slot.segment = reference.segment
    slot.offset = reference.offset
    slot.length = reference.length
    slot.generation = reference.generation
