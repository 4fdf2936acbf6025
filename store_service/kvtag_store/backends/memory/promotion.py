"""Gets over both tiers: a value held on disk only is read back into memory before it is served.

Each read-back gets a memory slot (evicting as a put would), its record is preadv'd straight into
it, checked against its header and inserted as an entry already on disk. When memory has no room
(what is left is pinned by reads, or leased and not on disk), the value is read around it: into a
buffer of the Get's own (inline), or a slot of the arena outside the pool's bytes that the lease holds
(shared memory; at most the pool's capacity of them at once). So a block a Lookup leased loads
whatever other leases hold. A failing record is dropped and counted; an I/O error turns the tier off.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, NamedTuple, TypeVar

from kvtag_store.backends.base import BlockAddress, KeyStatus, ReadResult, SlotReference
from kvtag_store.backends.memory.allocation import Allocator
from kvtag_store.backends.memory.disk.reads import Located
from kvtag_store.backends.memory.disk.tier import DiskTier
from kvtag_store.backends.memory.entries import STORED, Namespace, ReadPins
from kvtag_store.backends.memory.pools import Pool
from kvtag_store.backends.memory.reads import Reader
from kvtag_store.backends.shm import Arena, Slot

_HIT = KeyStatus.HIT
T = TypeVar("T")
# A slot a shared-memory Get read a disk record into around a full memory, with its arena and pool.
AroundSlot = tuple[Arena, Slot, Pool]
Around = Callable[[Namespace, int], "tuple[T, memoryview] | None"]


@dataclass
class ReadBack(Generic[T]):
    """What read_back did for one Get: `trusted`, ids of the entries it inserted (verified just now, the
    Get need not hash them again); `held`, addresses it pinned for the reader (unpin them once the
    reader pinned its own); `around`, address -> (target handle, digest) of values read around a full
    memory; `failed`, around targets whose record failed (the caller frees them)."""

    trusted: set[int]
    held: list[BlockAddress]
    around: dict[BlockAddress, tuple[T, int]]
    failed: list[T] = field(default_factory=list)


class _ReadJob(NamedTuple):
    found: Located
    view: memoryview  # where the value is read to
    slot: Slot | None  # a new entry's slot, None when read around memory
    handle: object  # the around target's handle (None for a slot)


def _buffer(_ns: Namespace, size: int) -> tuple[bytearray, memoryview]:
    """Where an inline Get reads a disk record around a full memory: a buffer of its own, as large as
    the value it replies with."""
    buffer = bytearray(size)
    return buffer, memoryview(buffer)


class Promoter:
    """The memory backend's Get paths with the disk tier on."""

    def __init__(
        self,
        lock: threading.Lock,
        namespaces: dict[str, Namespace],
        allocator: Allocator,
        reader: Reader,
        disk: DiskTier,
    ) -> None:
        """`lock`, `namespaces` and the parts are the backend's own."""
        self._lock = lock
        self._namespaces = namespaces
        self._allocator = allocator
        self._reader = reader
        self._disk = disk

    def get(self, namespace_id: str, mode_id: str, addresses: Sequence[BlockAddress]) -> list[ReadResult]:
        back = self.read_back(namespace_id, mode_id, addresses, _buffer)
        try:
            results = self._reader.get(namespace_id, mode_id, addresses)
        finally:
            self._unpin(namespace_id, back.held)
        for i, address in enumerate(addresses):
            if results[i].status is not _HIT and address in back.around:
                results[i] = ReadResult(_HIT, bytes(back.around[address][0]))
        return results

    def get_views(
        self, namespace_id: str, mode_id: str, addresses: Sequence[BlockAddress]
    ) -> tuple[list[ReadResult], list[BlockAddress]]:
        back = self.read_back(namespace_id, mode_id, addresses, _buffer)
        try:
            results, pinned = self._reader.get_views(namespace_id, mode_id, addresses, back.trusted)
        finally:
            self._unpin(namespace_id, back.held)
        for i, address in enumerate(addresses):
            if results[i].status is not _HIT and address in back.around:
                results[i] = ReadResult(_HIT, memoryview(back.around[address][0]))
        return results, pinned

    def get_references(
        self, namespace_id: str, mode_id: str, addresses: Sequence[BlockAddress], verify: bool
    ) -> tuple[list[KeyStatus], list[SlotReference | None], list[BlockAddress]]:
        back = self.read_back(namespace_id, mode_id, addresses, self._around_slot)
        try:
            statuses, references, pinned = self._reader.get_references(
                namespace_id, mode_id, addresses, verify, back.trusted
            )
        finally:
            self._unpin(namespace_id, back.held)
        self.free_around(back.failed)
        if not back.around:
            return statuses, references, pinned
        used: dict[int, AroundSlot] = {}
        for i, address in enumerate(addresses):
            if statuses[i] is _HIT or address not in back.around:
                continue
            (arena, slot, pool), digest = back.around[address]
            statuses[i] = _HIT
            references[i] = SlotReference(
                arena.segment, slot.offset, slot.length, slot.generation, None if verify else digest
            )
            used[slot.generation] = (arena, slot, pool)
        # Served from memory after all (another Get promoted it meanwhile): free it now.
        self.free_around([t for t, _ in back.around.values() if t[1].generation not in used])
        return statuses, references, ReadPins(pinned, list(used.values()))

    def read_back(
        self, namespace_id: str, mode_id: str, addresses: Sequence[BlockAddress], around: Around[T]
    ) -> ReadBack[T]:
        """Promote the addresses held on disk only (in this mode) into memory, or read them around a
        full memory into `around(ns, size)`'s target (a handle and its writable view; None: a MISS
        for this Get).

        This Get's memory hits and the entries it inserts are returned pinned (`held`), so neither this
        Get's allocations nor another's evict them before the reader pins them: unpin `held` once it
        has."""
        back: ReadBack[T] = ReadBack(set(), [], {})
        disk = self._disk
        reads = disk.reads
        with self._lock:
            ns = self._namespaces.get(namespace_id)
            if ns is None or not ns.disk or disk.degraded or mode_id not in ns.disk.modes:
                return back
            jobs: list[_ReadJob] = []
            entries, index = ns.entries, ns.disk
            lru, ns_id = ns.pool.lru, ns.namespace_id
            wanted: list[BlockAddress] = []
            for address in addresses:
                held = entries.get(address)
                if held is not None:  # this Get's memory hits: pinned, so its read-backs evict others
                    if held.mode_id == mode_id:
                        lru.move_to_end((ns_id, address))
                        back.held.append(address)
                    continue
                wanted.append(address)
            ns.pins.update(back.held)
            arena = ns.arena
            for address in dict.fromkeys(wanted):
                found = reads.locate(index, mode_id, address)
                if found is None:
                    continue
                slot = self._allocator.allocate(ns, found.where.value_length)
                if isinstance(slot, Slot):
                    view = arena.view[slot.offset : slot.offset + slot.length]
                    jobs.append(_ReadJob(found, view, slot, None))
                else:
                    target = around(ns, found.where.value_length)
                    if target is None:
                        continue  # no room at all: a MISS for this Get
                    jobs.append(_ReadJob(found, target[1], None, target[0]))
                reads.hold(found)
            if not jobs:
                return back
            ns.writers += 1
        outcomes, failure = reads.read(namespace_id, mode_id, [(job.found, job.view) for job in jobs])
        with self._lock:
            ns.writers -= 1
            for job, digest in zip(jobs, outcomes, strict=True):
                on_disk = reads.finish(ns_id, index, job.found, digest is not None, failure is None)
                address = job.found.address
                if digest is not None:
                    if job.slot is None:
                        back.around[address] = (job.handle, digest)  # type: ignore[assignment]
                        continue
                    # A segment dropped while it was read: the value is in memory only again.
                    result = ns.insert(
                        mode_id, address, job.slot, digest, job.found.packed if on_disk else None
                    )
                    if result is STORED:
                        back.trusted.add(id(ns.entries[address]))
                    if address in ns.entries:
                        ns.pins[address] += 1
                        back.held.append(address)
                    continue
                if job.slot is not None:
                    arena.free(job.slot)
                    ns.pool.reserved -= job.slot.length
                else:
                    back.failed.append(job.handle)  # type: ignore[arg-type]
        if failure is not None:
            disk.degrade("read", *failure)
        return back

    def _around_slot(self, ns: Namespace, size: int) -> tuple[AroundSlot, memoryview] | None:
        """A slot of the namespace's arena for a value a shared-memory Get reads around a full memory,
        outside the pool's used and reserved bytes, up to the pool's capacity of them (the arena has
        room for twice it); None past that (the value is a MISS for this Get). Caller holds the lock."""
        pool = ns.pool
        if pool.around + size > pool.capacity:
            return None
        slot = ns.arena.allocate(size, next(self._allocator.generations))
        if slot is None:
            return None
        pool.around += size
        arena = ns.arena
        return (arena, slot, pool), arena.view[slot.offset : slot.offset + slot.length]

    def free_around(self, around: Sequence[AroundSlot]) -> None:
        if not around:
            return
        with self._lock:
            for arena, slot, pool in around:
                arena.free(slot)
                pool.around -= slot.length

    def _unpin(self, namespace_id: str, addresses: Sequence[BlockAddress]) -> None:
        with self._lock:
            ns = self._namespaces.get(namespace_id)
            if ns is not None:
                ns.unpin(addresses)
