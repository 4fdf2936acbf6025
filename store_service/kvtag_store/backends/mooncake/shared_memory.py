"""The Mooncake backend's shared-memory half: reservations, commits and reads through staging slots.

Same-host clients write into and read from staging slots (see mooncake.staging); this half
reserves those slots, puts committed ones into the cluster straight from the arena, and reads
values into slots it then references. Without --shm-dir there is no staging, and every call
answers as if no slot could ever be had.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

from kvtag_store.backends.arena import Arena
from kvtag_store.backends.base import (
    NO_RESERVATION,
    BlockAddress,
    KeyStatus,
    PutOutcome,
    PutResult,
    SlotReference,
)
from kvtag_store.backends.mooncake.cluster import Cluster
from kvtag_store.backends.mooncake.errors import MooncakeCode
from kvtag_store.backends.mooncake.format import HEADER_BYTES, FormatError, decode_header, payload_checksum
from kvtag_store.backends.mooncake.reads import Reads
from kvtag_store.backends.mooncake.staging import Staged, StagedAddress, Staging
from kvtag_store.backends.mooncake.writes import Writes

# Spare slots would hold staging memory between puts that the reads also need: this backend
# stages values only for the put that names them.
NO_SPARES = PutResult(
    PutOutcome.REJECTED, "the Mooncake backend grants no spare slots: reserve them with ReserveSlots"
)
_STAGING_FULL = PutResult(
    PutOutcome.REJECTED,
    "the Mooncake backend's shared-memory staging arena is full (values being written or read by "
    "same-host clients); retry, or raise --mooncake-shm-staging",
)
_NO_STAGING = PutResult(PutOutcome.REJECTED, "no shared-memory staging (--shm-dir)")


class SharedMemoryHalf:
    """Staging slots for same-host clients, and the reservations that hold them until a commit."""

    def __init__(self, cluster: Cluster, reads: Reads, writes: Writes, staging: Staging | None) -> None:
        self._cluster = cluster
        self._reads = reads
        self._writes = writes
        self._staging = staging
        self._reservations: dict[int, tuple[str, BlockAddress, Staged]] = {}  # generation -> reserved
        self._reserved_lock = threading.Lock()

    def assign_tenant(self, namespace_id: str, tenant: str) -> None:
        if self._staging is not None:
            self._staging.assign_tenant(namespace_id, tenant)

    def shared_arena(self, namespace_id: str) -> Arena | None:
        return self._staging.arena(namespace_id) if self._staging is not None else None

    @property
    def slots_in_use(self) -> int | None:
        return self._staging.slots_in_use if self._staging is not None else None

    def reserve(
        self, namespace_id: str, mode_id: str, items: Sequence[tuple[BlockAddress, int]]
    ) -> list[SlotReference | PutResult]:
        """A staging slot per item, or the outcome already known. A block already stored answers
        ALREADY_PRESENT or CONFLICT now (existence checks, Writes.check), so the client does not
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

    def commit(
        self,
        namespace_id: str,
        mode_id: str,
        generations: Sequence[int],
        addresses: Sequence[BlockAddress] | None,
    ) -> tuple[list[PutResult], int]:
        """Put each reserved slot into the cluster (Writes.put_staged); the slots are free again
        afterwards, whatever happened. Keys sent with `addresses` are for spare slots, which this
        backend never grants: such a commit frees the slots it names and stores nothing."""
        if addresses is not None:
            self.cancel(generations)
            return [NO_SPARES] * len(generations), 0
        taken: list[tuple[str, BlockAddress, Staged] | None] = []
        with self._reserved_lock:
            for generation in generations:
                reservation = self._reservations.get(generation)
                if reservation is None or reservation[0] != namespace_id:
                    taken.append(None)
                    continue
                del self._reservations[generation]
                taken.append(reservation)
        live = [r for r in taken if r is not None]
        try:
            entries = [(address, staged) for _, address, staged in live]
            outcomes = iter(self._writes.put_staged(namespace_id, mode_id, entries) if live else [])
        finally:
            if self._staging is not None:
                self._staging.free([staged for _, _, staged in live])
        results = [next(outcomes) if r is not None else NO_RESERVATION for r in taken]
        stored = sum(
            r[2].length
            for r, result in zip(taken, results, strict=True)
            if r is not None and result.outcome is PutOutcome.STORED
        )
        return results, stored

    def cancel(self, generations: Iterable[int]) -> None:
        with self._reserved_lock:
            dropped = [r for g in generations if (r := self._reservations.pop(g, None)) is not None]
        if dropped and self._staging is not None:
            self._staging.free([staged for _, _, staged in dropped])

    def reserved_bytes(self) -> int:
        with self._reserved_lock:
            return sum(staged.length for _, _, staged in self._reservations.values())

    def get_references(
        self, namespace_id: str, mode_id: str, addresses: Sequence[BlockAddress]
    ) -> tuple[list[KeyStatus], list[SlotReference | None], list[BlockAddress]]:
        """Each value read from the cluster straight into a staging slot (one
        batch_get_into_multi_buffers), verified there (tag, address, length, CRC) and referenced. The
        pinned addresses carry their slots (StagedAddress): releasing the lease frees them. A value
        the staging arena has no room for is answered MISS; the engine recomputes it."""
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
                        payload_checksum(staged.payload()) != header.payload_crc
                    ):
                        raise FormatError("payload length or checksum mismatch")
                except FormatError:
                    corrupt.append(mkeys[i])
                    continue
                statuses[i] = KeyStatus.HIT
                references[i] = _reference(staged)
                pinned.append(StagedAddress(addresses[i], staged))
                kept.append(staged)
        finally:
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


def _reference(staged: Staged) -> SlotReference:
    return SlotReference(staged.arena.segment, staged.payload_offset, staged.length, staged.generation)
