"""The Mooncake backend's shared-memory half: reservations, commits and reads through staging slots.

Same-host clients write into and read from staging slots (see mooncake.staging); this half
reserves those slots, puts committed ones into the cluster straight from the arena, and reads
values into slots it then references. Spare slots (granted at one commit for the session's next
put, bound to their keys at its commit) make a put one round trip; they hold staging memory the
reads need too, so they stay within 1/SPARE_SHARE of each tenant's arena. Without --shm-dir there
is no staging, and every call answers as if no slot could ever be had.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

from kvtag_store.backends.base import (
    NO_RESERVATION,
    TIER_MOONCAKE,
    BlockAddress,
    EventRelay,
    KeyStatus,
    PutOutcome,
    PutResult,
    SlotReference,
)
from kvtag_store.backends.mooncake.cluster import Cluster
from kvtag_store.backends.mooncake.errors import MooncakeCode
from kvtag_store.backends.mooncake.format import HEADER_BYTES, FormatError, decode_header, payload_checksum
from kvtag_store.backends.mooncake.reads import ClusterReader
from kvtag_store.backends.mooncake.staging import Staged, StagedAddress, Staging
from kvtag_store.backends.mooncake.writes import ClusterWriter
from kvtag_store.backends.shm.arena import Arena

# Spare slots of a staging arena stay within this share of it: the rest is for reads and reservations.
SPARE_SHARE = 4
_SPARE_SHARE_FULL = PutResult(
    PutOutcome.REJECTED,
    "spare slots are at their share of the Mooncake staging arena: reserve with ReserveSlots",
)
_SPARE_WITHOUT_KEY = PutResult(
    PutOutcome.REJECTED, "a spare slot is committed with its key: send packed_items, one key per generation"
)
_KEYED_SLOT = PutResult(
    PutOutcome.REJECTED, "a slot reserved for a key is committed without one (ReserveSlots already named it)"
)
_STAGING_FULL = PutResult(
    PutOutcome.REJECTED,
    "the Mooncake backend's shared-memory staging arena is full (values being written or read by "
    "same-host clients); retry, or raise --mooncake-shm-staging",
)
_NO_STAGING = PutResult(PutOutcome.REJECTED, "no shared-memory staging (--shm-dir)")


class SharedMemoryHalf:
    """Staging slots for same-host clients, and the reservations that hold them until a commit."""

    def __init__(
        self,
        cluster: Cluster,
        reads: ClusterReader,
        writes: ClusterWriter,
        staging: Staging | None,
        events: EventRelay,
    ) -> None:
        """`events`: told of the blocks commits store (KV events)."""
        self._cluster = cluster
        self._reads = reads
        self._writes = writes
        self._staging = staging
        # generation -> (namespace, address, slot); address None: a spare slot, bound at its commit
        self._reservations: dict[int, tuple[str, BlockAddress | None, Staged]] = {}
        self._reserved_lock = threading.Lock()
        self._spare_bytes = 0
        self._events = events

    def assign_tenant(self, namespace_id: str, tenant: str, arena: str | None = None) -> None:
        if self._staging is not None:
            self._staging.assign_tenant(namespace_id, tenant, arena)

    def shared_arena(self, namespace_id: str) -> Arena | None:
        return self._staging.arena(namespace_id) if self._staging is not None else None

    @property
    def slots_in_use(self) -> int | None:
        return self._staging.slots_in_use if self._staging is not None else None

    def reserve(
        self, namespace_id: str, mode_id: str, items: Sequence[tuple[BlockAddress, int]]
    ) -> list[SlotReference | PutResult]:
        """A staging slot per item, or the outcome already known. A block already stored answers
        ALREADY_PRESENT or CONFLICT now (existence checks, ClusterWriter.check), so the client does not
        copy it for nothing."""
        if self._staging is None:
            return [_NO_STAGING] * len(items)
        self._cluster.breaker.check("storing")
        out: list[SlotReference | PutResult | None] = list(
            self._writes.check(namespace_id, mode_id, [address for address, _ in items])
        )
        for i, (_, length) in enumerate(items):
            if out[i] is None:
                out[i] = self._writes.too_large(length)
        todo = [i for i in range(len(items)) if out[i] is None]
        granted = self._staging.allocate(namespace_id, [items[i][1] for i in todo])
        with self._reserved_lock:
            for i, staged in zip(todo, granted, strict=True):
                if staged is None:
                    out[i] = _STAGING_FULL
                    continue
                self._reservations[staged.generation] = (namespace_id, items[i][0], staged)
                out[i] = _reference(staged)
        return [r if r is not None else _STAGING_FULL for r in out]

    def reserve_spare(self, namespace_id: str, lengths: Sequence[int]) -> list[SlotReference | PutResult]:
        """Staging slots for no key yet (the session's next put), while the spare ones stay within
        1/SPARE_SHARE of the arena; REJECTED for the rest."""
        if self._staging is None:
            return [_NO_STAGING] * len(lengths)
        share = self._staging.size_bytes // SPARE_SHARE
        out: list[SlotReference | PutResult] = []
        with self._reserved_lock:
            fits = 0
            room = share - self._spare_bytes
            for length in lengths:
                if length > room:
                    break
                room -= length
                fits += 1
            granted = self._staging.allocate(namespace_id, list(lengths[:fits]))
            for staged in granted:
                if staged is None:
                    out.append(_STAGING_FULL)
                    continue
                self._reservations[staged.generation] = (namespace_id, None, staged)
                self._spare_bytes += staged.length
                out.append(_reference(staged))
        return out + [_SPARE_SHARE_FULL] * (len(lengths) - fits)

    def commit(
        self,
        namespace_id: str,
        mode_id: str,
        generations: Sequence[int],
        digests: Sequence[int] | None,
        addresses: Sequence[BlockAddress] | None,
    ) -> tuple[list[PutResult], int]:
        """Put each reserved slot into the cluster (ClusterWriter.put_staged), under the client's digests
        when it sent them; the slots are free again afterwards, whatever happened. `addresses` bind
        spare slots to their keys: those were not checked at reserve, so the blocks already stored
        are answered from existence checks here and not put."""
        taken: list[tuple[BlockAddress, Staged, int | None] | None] = []
        results: list[PutResult | None] = [None] * len(generations)
        refused: list[Staged] = []
        with self._reserved_lock:
            for n, generation in enumerate(generations):
                reservation = self._reservations.get(generation)
                if reservation is None or reservation[0] != namespace_id:
                    taken.append(None)
                    results[n] = NO_RESERVATION
                    continue
                del self._reservations[generation]
                _, address, staged = reservation
                if address is None and addresses is not None:
                    self._spare_bytes -= staged.length
                    address = addresses[n]
                elif address is None or addresses is not None:
                    if address is None:
                        self._spare_bytes -= staged.length
                    refused.append(staged)
                    taken.append(None)
                    results[n] = _SPARE_WITHOUT_KEY if addresses is None else _KEYED_SLOT
                    continue
                taken.append((address, staged, digests[n] if digests is not None else None))
        live = [n for n, t in enumerate(taken) if t is not None]
        try:
            if addresses is not None and live:
                known = self._writes.check(namespace_id, mode_id, [addresses[n] for n in live])
                for n, outcome in zip(live, known, strict=True):
                    results[n] = outcome
                live = [n for n in live if results[n] is None]
            entries = [(t[0], t[1]) for n in live if (t := taken[n]) is not None]
            sent = [t[2] for n in live if (t := taken[n]) is not None]
            outcomes = (
                self._writes.put_staged(namespace_id, mode_id, entries, sent if digests is not None else None)
                if entries
                else []
            )
            for n, outcome in zip(live, outcomes, strict=True):
                results[n] = outcome
        finally:
            if self._staging is not None:
                self._staging.free(refused + [t[1] for t in taken if t is not None])
        final = [r if r is not None else NO_RESERVATION for r in results]
        kept = [(t[0], r) for t, r in zip(taken, final, strict=True) if t is not None]
        self._events.stored_results(
            namespace_id, mode_id, (a for a, _ in kept), (r for _, r in kept), TIER_MOONCAKE
        )
        stored = sum(
            t[1].length
            for t, result in zip(taken, final, strict=True)
            if t is not None and result.outcome is PutOutcome.STORED
        )
        return final, stored

    def cancel(self, generations: Iterable[int]) -> None:
        with self._reserved_lock:
            dropped = [r for g in generations if (r := self._reservations.pop(g, None)) is not None]
            self._spare_bytes -= sum(staged.length for _, address, staged in dropped if address is None)
        if dropped and self._staging is not None:
            self._staging.free([staged for _, _, staged in dropped])

    def reserved_bytes(self) -> int:
        with self._reserved_lock:
            return sum(staged.length for _, _, staged in self._reservations.values())

    def spare_bytes(self) -> int:
        with self._reserved_lock:
            return self._spare_bytes

    def get_references(
        self, namespace_id: str, mode_id: str, addresses: Sequence[BlockAddress], verify: bool
    ) -> tuple[list[KeyStatus], list[SlotReference | None], list[BlockAddress]]:
        """Each value read from the cluster straight into a staging slot (one
        batch_get_into_multi_buffers), checked there (tag, address, length, and the payload digest
        unless the reader verifies its own copy against the digest its reference carries) and
        referenced. The pinned addresses carry their slots (StagedAddress): releasing the lease frees
        them. A value the staging arena has no room for is answered MISS; the engine recomputes it."""
        statuses = [KeyStatus.MISS] * len(addresses)
        references: list[SlotReference | None] = [None] * len(addresses)
        pinned: list[BlockAddress] = []
        if not addresses or self._staging is None:
            return statuses, references, pinned
        self._cluster.breaker.check("reading")
        found = self._reads.locate(namespace_id, mode_id, addresses)
        mkeys = found.mkeys
        if found.on_suspects:
            self._cluster.errors.add(MooncakeCode.TRANSFER_FAIL, found.on_suspects)
        for i, holder in enumerate(found.holders):
            if holder:
                statuses[i] = KeyStatus.MODE_MISMATCH
        wanted: list[tuple[int, int, frozenset[str]]] = []
        corrupt: list[str] = []
        for i, size, where in found.located:
            if size >= HEADER_BYTES:
                wanted.append((i, size - HEADER_BYTES, where))
            else:
                corrupt.append(mkeys[i])  # shorter than a header: not a kvtag value
        granted = self._staging.allocate(namespace_id, [length for _, length, _ in wanted])
        reading = [
            (i, where, staged) for (i, _, where), staged in zip(wanted, granted, strict=True) if staged
        ]
        kept: list[Staged] = []
        try:
            for i, staged in self._reads.into_slots(mkeys, reading):
                group, key = addresses[i]
                try:
                    header = decode_header(staged.header(), namespace_id, group, key, mode_id)
                    if header.payload_bytes != staged.length or (
                        verify and payload_checksum(staged.payload()) != header.payload_digest
                    ):
                        raise FormatError("payload length or checksum mismatch")
                except FormatError:
                    corrupt.append(mkeys[i])
                    continue
                statuses[i] = KeyStatus.HIT
                references[i] = _reference(staged, None if verify else header.payload_digest)
                pinned.append(StagedAddress(addresses[i], staged))
                kept.append(staged)
        finally:
            for _, _, staged in reading:  # the headers are read: the generation words go back
                staged.restore_generation()
            held = {staged.generation for staged in kept}
            self._staging.free([staged for _, _, staged in reading if staged.generation not in held])
        if corrupt:
            self._cluster.drop_corrupt(corrupt)
        return statuses, references, pinned

    def release(self, addresses: Sequence[BlockAddress]) -> None:
        """Free the slots a shared-memory Get's lease holds (addresses it returned as pinned)."""
        if self._staging is not None:
            self._staging.free([a.staged for a in addresses if isinstance(a, StagedAddress)])

    def close(self) -> None:
        if self._staging is not None:
            self._staging.close()


def _reference(staged: Staged, digest: int | None = None) -> SlotReference:
    return SlotReference(
        staged.arena.segment, staged.payload_offset, staged.length, staged.generation, digest
    )
