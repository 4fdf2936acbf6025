"""Slots for new values, and the LRU eviction that makes room for them within a pool.

A slot handed out here counts in its pool's reserved bytes until it is inserted (Namespace.insert) or
freed, so committed plus reserved bytes never exceed the pool's capacity. Pinned blocks (reads in
progress, leases) are never evicted, but a block a Lookup leased may leave memory once its bytes are on
disk (Namespace.evictable): the lease then holds its disk record. Every method runs under the backend's
lock.
"""

from __future__ import annotations

import itertools
from collections import Counter, deque
from collections.abc import Callable

from kvtag_store.backends.base import BlockAddress, PutOutcome, PutResult
from kvtag_store.backends.memory.entries import ALREADY_PRESENT, Namespace, conflict
from kvtag_store.backends.memory.pools import Pool, StoreKey
from kvtag_store.backends.shm.arena import Arena, Slot

# The disk tier's spill_evicted: (namespace_id, address, mode_id, digest, the value's bytes).
Spill = Callable[[str, BlockAddress, str, int, memoryview], None]


class Allocator:
    """Hands out arena slots for the store's namespaces, evicting least recently used blocks for room."""

    def __init__(
        self, namespaces: dict[str, Namespace], pools: list[Pool], spill: Spill | None = None
    ) -> None:
        """`namespaces` and `pools` are the backend's own tables, shared, not copied. `spill`: the disk
        tier's hook for an evicted entry not yet on disk (it queues a copy), when the tier is on."""
        self._namespaces = namespaces
        self._pools = pools
        # Every slot handed out gets the next generation: a reader tells a reused slot by it.
        self.generations = itertools.count(1)
        self.evictions: Counter[str | None] = Counter()  # by tenant (None: not yet known)
        self._spill = spill

    def claim(self, ns: Namespace, mode_id: str, address: BlockAddress, size: int) -> Slot | PutResult:
        """The known outcome of storing `size` bytes at `address`, or a slot for them (counted in
        reserved bytes until inserted or cancelled)."""
        pool = ns.pool
        if size > pool.capacity:
            return PutResult(PutOutcome.REJECTED, pool.too_large(size))
        existing = ns.entries.get(address)
        if existing is not None:
            if existing.mode_id != mode_id:
                return conflict(existing)
            pool.lru.move_to_end((ns.namespace_id, address))
            return ALREADY_PRESENT
        if ns.disk:
            held = ns.disk.mode_holding(mode_id, address)
            if held is not None:
                if held != mode_id:
                    return PutResult(PutOutcome.CONFLICT, f"key is held by mode {held}")
                return ALREADY_PRESENT
        return self.allocate(ns, size)

    def allocate(self, ns: Namespace, size: int) -> Slot | PutResult:
        """A slot of `size` bytes, counted in reserved bytes, evicting to make room; REJECTED when the
        pool is full of leases or the arena has no room."""
        pool = ns.pool
        if pool.used + pool.reserved + size > pool.capacity and not self._make_room(pool, size):
            return PutResult(PutOutcome.REJECTED, pool.full_of_leases(self._pinned_bytes(pool)))
        slot = ns.arena.allocate(size, next(self.generations))
        if slot is None:
            slot = self._evict_for_slot(ns.arena, size)
        if slot is None:
            return PutResult(
                PutOutcome.REJECTED,
                f"no room for {size} bytes in the value arena of this tenant (its memory is leased, being "
                "written, or the shared-memory file system is full); release leases or enlarge --shm-dir",
            )
        pool.reserved += size
        return slot

    def _pinned_bytes(self, pool: Pool) -> int:
        """Bytes of the pool that cannot be evicted (leases, reads) and reservations. O(pinned keys):
        only needed when it is full."""
        total = pool.reserved
        for ns in self._namespaces.values():
            if ns.pool is not pool:
                continue
            for address in ns.pinned_addresses():
                entry = ns.entries.get(address)
                if entry is not None and not ns.evictable(address, entry):
                    total += entry.slot.length
        return total

    def _make_room(self, pool: Pool, size: int) -> bool:
        """Evict the pool's least recently used unpinned blocks until `size` more bytes fit; False (and
        evict nothing) when the leased blocks leave too little room.

        Leased blocks met on the way move to the recent end (a second chance), so later scans do
        not walk past them again; they are in use, which is what recency means."""
        need = pool.used + pool.reserved + size - pool.capacity
        victims: list[StoreKey] = []
        leased: list[StoreKey] = []
        freed = 0
        namespaces = self._namespaces
        for store_key in pool.lru:
            ns_id, address = store_key
            ns = namespaces[ns_id]
            entry = ns.entries[address]
            if not ns.evictable(address, entry):
                leased.append(store_key)
                continue
            victims.append(store_key)
            freed += entry.slot.length
            if freed >= need:
                break
        deque(map(pool.lru.move_to_end, leased), maxlen=0)
        if freed < need:
            return False
        for ns_id, address in victims:
            self._evict(namespaces[ns_id], address)
        return True

    def _evict(self, ns: Namespace, address: BlockAddress) -> None:
        entry = ns.entries[address]
        if entry.disk is None and self._spill is not None:
            self._spill(ns.namespace_id, address, entry.mode_id, entry.checksum, entry.view())
        ns.remove(address, entry)
        self.evictions[ns.tenant] += 1

    def _evict_for_slot(self, arena: Arena, size: int) -> Slot | None:
        """The arena has bytes to spare but no slot that fits (mixed sizes, or a full file system):
        evict this arena's least recently used unpinned blocks until a slot of `size` frees up."""
        namespaces = self._namespaces
        candidates = [
            (ns_id, address)
            for pool in self._pools
            for ns_id, address in pool.lru
            if namespaces[ns_id].arena is arena
            and namespaces[ns_id].evictable(address, namespaces[ns_id].entries[address])
        ]
        for ns_id, address in candidates:
            self._evict(namespaces[ns_id], address)
            slot = arena.allocate(size, next(self.generations))
            if slot is not None:
                return slot
        return None
