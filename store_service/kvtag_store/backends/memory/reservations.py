"""Two-phase shared-memory puts: slots reserved for their keys (or spare, for keys named at commit),
written by the client in place, then committed (checksummed and inserted) or cancelled.

A reserved slot counts in its pool's reserved bytes until then, so it evicts like a stored value.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

from kvtag_store.backends.base import NO_RESERVATION, BlockAddress, PutOutcome, PutResult, SlotReference
from kvtag_store.backends.memory.allocation import Allocator
from kvtag_store.backends.memory.entries import STORED, Namespace, checksum
from kvtag_store.backends.shm.arena import Slot

# Spare slots (CommitSlotsRequest.spare_lengths) of a pool stay within this share of its capacity:
# they save a put a round trip, and cost the store this much room at most.
SPARE_SHARE = 16
_KEYED_SLOT = PutResult(
    PutOutcome.REJECTED,
    "this slot was reserved for its key by ReserveSlots: commit it without packed_items",
)
_SPARE_SHARE_FULL = PutResult(PutOutcome.REJECTED, "spare slots are at their share of capacity")
_SPARE_WITHOUT_KEY = PutResult(
    PutOutcome.REJECTED, "a spare slot is committed with its key: send packed_items, one key per generation"
)


class _Reservation(NamedTuple):
    namespace_id: str
    address: BlockAddress | None  # None: a spare slot, bound to its key at commit
    slot: Slot


class Reservations:
    """The slots reserved and not yet committed, by generation."""

    def __init__(
        self,
        lock: threading.Lock,
        namespaces: dict[str, Namespace],
        namespace: Callable[[str], Namespace],
        allocator: Allocator,
    ) -> None:
        """`lock` and `namespaces` are the backend's own; `namespace(id)` returns the namespace,
        creating it if need be (the caller holds the lock)."""
        self._lock = lock
        self._namespaces = namespaces
        self._namespace = namespace
        self._allocator = allocator
        self._by_generation: dict[int, _Reservation] = {}

    def reserve(
        self, namespace_id: str, mode_id: str, items: Sequence[tuple[BlockAddress, int]]
    ) -> list[SlotReference | PutResult]:
        """Step 1: a slot per item, or the outcome already known (ALREADY_PRESENT, CONFLICT, REJECTED).
        Slots stay reserved until commit() or cancel()."""
        out: list[SlotReference | PutResult] = []
        claim = self._allocator.claim
        with self._lock:
            ns = self._namespace(namespace_id)
            segment = ns.arena.segment
            for address, length in items:
                grant = claim(ns, mode_id, address, length)
                if isinstance(grant, Slot):
                    self._by_generation[grant.generation] = _Reservation(namespace_id, address, grant)
                    out.append(SlotReference(segment, grant.offset, grant.length, grant.generation))
                else:
                    out.append(grant)
        return out

    def reserve_spare(self, namespace_id: str, lengths: Sequence[int]) -> list[SlotReference | PutResult]:
        """Slots reserved for no key yet (CommitSlotsRequest.spare_lengths), while the pool's spare
        slots stay within 1/SPARE_SHARE of its capacity; REJECTED for the rest. They evict like
        any reservation: a full store holds that much less, and a put writing into them saves
        a round trip."""
        generations = self._allocator.generations
        with self._lock:
            ns = self._namespace(namespace_id)
            pool, arena = ns.pool, ns.arena
            share = pool.capacity // SPARE_SHARE
            slots: list[Slot] = []
            if lengths and len(set(lengths)) == 1:
                # The usual request (one put's blocks, of one size): all at once when they fit in the
                # share and in free room, so there is no eviction to decide per slot.
                length, need = lengths[0], lengths[0] * len(lengths)
                if pool.spare + need <= share and pool.used + pool.reserved + need <= pool.capacity:
                    slots = arena.allocate_many(length, [next(generations) for _ in lengths])
                    pool.reserved += length * len(slots)
                    pool.spare += length * len(slots)
            granted: list[Slot | PutResult] = list(slots)
            for length in lengths[len(slots) :]:  # the others one by one, evicting as a put would
                if pool.spare + length > share:
                    granted.append(_SPARE_SHARE_FULL)
                    continue
                slot = self._allocator.allocate(ns, length)
                if isinstance(slot, Slot):
                    pool.spare += length
                granted.append(slot)
            out: list[SlotReference | PutResult] = []
            for grant in granted:
                if isinstance(grant, PutResult):
                    out.append(grant)
                    continue
                self._by_generation[grant.generation] = _Reservation(namespace_id, None, grant)
                out.append(SlotReference(arena.segment, grant.offset, grant.length, grant.generation))
        return out

    def commit(
        self,
        namespace_id: str,
        mode_id: str,
        generations: Sequence[int],
        digests: Sequence[int] | None = None,
        addresses: Sequence[BlockAddress] | None = None,
    ) -> tuple[list[PutResult], int]:
        """Step 2: the reserved slots (by generation) the client wrote. Each value is checksummed now,
        unless the writer sent `digests` (one per generation), and becomes visible only by its insert.
        A wrong client digest is caught by the first read's verification. `addresses` (one per
        generation) bind spare slots to their keys. Returns a result per generation and the bytes
        newly stored."""
        refused: dict[int, PutResult] = {}
        reservations = self._by_generation
        with self._lock:
            ns = self._namespace(namespace_id)
            # (address, slot) of each generation held, None where it is not.
            taken: list[tuple[BlockAddress, Slot] | None] = []
            for n, generation in enumerate(generations):
                reservation = reservations.get(generation)
                if reservation is None or reservation.namespace_id != namespace_id:
                    taken.append(None)
                    continue
                del reservations[generation]
                address = reservation.address
                if address is None and addresses is not None:  # a spare slot, bound to its key now
                    ns.pool.spare -= reservation.slot.length
                    address = addresses[n]
                elif address is None or addresses is not None:
                    # Freed now: the session no longer holds it, so nothing else would.
                    refused[n] = _SPARE_WITHOUT_KEY if addresses is None else _KEYED_SLOT
                    self._free(reservation)
                    taken.append(None)
                    continue
                taken.append((address, reservation.slot))
        if digests is None:
            view = ns.arena.view
            digests = [
                checksum(view[t[1].offset : t[1].offset + t[1].length]) if t is not None else 0 for t in taken
            ]
        stored = 0
        results: list[PutResult] = []
        insert = ns.insert
        with self._lock:
            for n, (t, digest) in enumerate(zip(taken, digests, strict=True)):
                if t is None:
                    results.append(refused.get(n, NO_RESERVATION))
                    continue
                result = insert(mode_id, t[0], t[1], digest)
                if result is STORED:
                    stored += t[1].length
                results.append(result)
        return results, stored

    def cancel(self, generations: Iterable[int]) -> None:
        """Free reserved slots that were never committed (their session ended). Unknown ones are ignored."""
        with self._lock:
            for generation in generations:
                reservation = self._by_generation.pop(generation, None)
                if reservation is not None:
                    self._free(reservation)

    def namespaces(self) -> set[str]:
        """The namespaces holding reserved slots. Caller holds the lock."""
        return {reservation.namespace_id for reservation in self._by_generation.values()}

    def clear(self) -> None:
        """Forget every reservation (the backend is closing). Caller holds the lock."""
        self._by_generation.clear()

    def _free(self, reservation: _Reservation) -> None:
        """Caller holds the lock."""
        ns = self._namespaces.get(reservation.namespace_id)
        if ns is not None:
            ns.arena.free(reservation.slot)
            ns.pool.reserved -= reservation.slot.length
            if reservation.address is None:
                ns.pool.spare -= reservation.slot.length
