"""The embedded default backend: tagged values in arena slots, LRU-evicted, checksummed.

What counts as used bytes: the length of each stored value, exactly. Keys,
tags, checksums, slot headers and index overhead are not counted (they are
small and bounded by the key count). Slots reserved for a shared-memory Put
and not yet committed count against the capacity too (`reserved_bytes`), so
committed plus reserved never exceeds it.

Values live in arenas (kvtag_store.backends.arena), one per tenant: shared-memory files
a same-host client maps when the service has a directory for them (--shm-dir),
anonymous memory otherwise. Either way a value is written into a slot, checksummed,
and inserted under the lock only once complete, so no reader ever sees half a value.

Tenant quotas (--tenant-quota) split the capacity into pools: each tenant with
a quota gets a pool of that size, and the tenants without one share the rest.
Eviction is LRU within a pool, so a tenant over its quota evicts only its own
blocks, and no tenant can ever evict another pool's blocks.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import Counter, OrderedDict, deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from itertools import repeat
from operator import itemgetter
from typing import NamedTuple

import numpy as np
import xxhash

from kvtag_store.backends import key_index
from kvtag_store.backends.arena import Arena, Slot, arena_size, remove_orphans, shared_memory_room
from kvtag_store.backends.base import (
    BackendStats,
    BlockAddress,
    BlockKey,
    KeyStatus,
    Payload,
    ProbeRecord,
    PutOutcome,
    PutResult,
    ReadResult,
    SlotReference,
    TenantUsage,
)

log = logging.getLogger("kvtag_store.backends.memory.backend")

_HIT = KeyStatus.HIT
_MISS = KeyStatus.MISS
_MISMATCH = KeyStatus.MODE_MISMATCH
# Results without a reason are immutable and shared: no allocation per stored item.
_STORED = PutResult(PutOutcome.STORED)
_ALREADY_PRESENT = PutResult(PutOutcome.ALREADY_PRESENT)
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
_NO_RESERVATION = PutResult(
    PutOutcome.REJECTED,
    "no such reservation: the slot was not reserved by this session for this block, was already "
    "committed, or its session expired; reserve again (ReserveSlots)",
)
# Items stored per lock acquisition in put_many: about a millisecond of lock hold.
_PUT_CHUNK = 1024

_HIT_BYTE = bytes([_HIT])
_MISS_BYTE = bytes([_MISS])
_NO_MODE = key_index.NOT_FOUND
_UNKNOWN_MODE = -2  # a mode that stored nothing yet: matches no index entry, not even NOT_FOUND
# The key index catches up with stores and removals at the next packed Lookup, or after this many:
# ~3 ms under the lock, the longest a write or a scheduler's Lookup waits for it.
_KEY_INDEX_LAG = 4096

# (namespace_id, (group, key)): a block's address across the whole store.
_StoreKey = tuple[str, BlockAddress]


# The checksum of every stored value, chosen here only: xxh3-64. It is several times faster than zlib's
# CRC-32 (docs/benchmarks.md has the figures and the A/B) and releases the GIL like it.
# A corrupted value passes unnoticed with probability 2**-64 (CRC-32 catches every single-bit flip
# for certain, any other damage with 2**-32). Values live in process memory only: nothing persisted
# depends on the choice.
checksum = xxhash.xxh3_64_intdigest


class _Entry:
    """One stored block. A slotted class, not a dataclass: millions may exist."""

    __slots__ = ("arena", "checksum", "mode_id", "slot")

    def __init__(self, mode_id: str, arena: Arena, slot: Slot, digest: int) -> None:
        self.mode_id = mode_id
        self.arena = arena
        self.slot = slot
        self.checksum = digest

    def view(self) -> memoryview:
        """The value's bytes in the arena: valid while the entry is pinned or the lock is held."""
        return self.arena.view[self.slot.offset : self.slot.offset + self.slot.length]


class _Reservation(NamedTuple):
    namespace_id: str
    address: BlockAddress | None  # None: a spare slot, bound to its key at commit
    slot: Slot


class _Pool:
    """Bytes shared by some namespaces (one quota tenant's, or all the others') and their LRU order."""

    __slots__ = ("capacity", "eager_left", "lru", "reserved", "spare", "tenant", "used")

    def __init__(self, capacity: int, tenant: str | None) -> None:
        self.capacity = capacity
        # Bytes of this pool's arenas still to be prefaulted up front: the first arena of a pool takes
        # its capacity, so prefaulting never commits more memory than the capacities add up to.
        self.eager_left = capacity
        self.tenant = tenant  # None: the shared pool
        self.used = 0
        self.reserved = 0  # bytes of slots reserved and not yet inserted
        self.spare = 0  # of which spare slots, reserved for no key yet
        # Every block of the pool, least recently used first (pinned ones too: eviction skips them).
        self.lru: OrderedDict[_StoreKey, None] = OrderedDict()

    def too_large(self, size: int) -> str:
        if self.tenant is None:
            return (
                f"value of {size} bytes exceeds the store capacity of {self.capacity} bytes; "
                "raise --capacity or store smaller blocks"
            )
        return (
            f"value of {size} bytes exceeds tenant {self.tenant!r}'s quota of {self.capacity} bytes; "
            "raise its --tenant-quota or store smaller blocks"
        )

    def full_of_leases(self, leased: int) -> str:
        where, knob = ("store", "--capacity") if self.tenant is None else ("tenant quota", "--tenant-quota")
        return (
            f"{where} full of leased blocks: {leased} of {self.capacity} bytes are leased or being written; "
            f"release leases (Get with lease_id, ReleaseLeases) or raise {knob}"
        )


class PinnedRuns(Sequence[BlockAddress]):
    """The hits a packed Lookup pinned, kept as the request's packed key bytes (no object per key).

    A lease holds it and hands it back to unpin, which drops it whole. Eviction asks `holds`, which
    cuts the keys and builds a key set per group only when first asked (most leases end before any
    eviction looks).
    """

    __slots__ = ("_count", "_runs", "_sets")

    def __init__(self, runs: list[tuple[int, bytes, int, bytes | None]]) -> None:
        """Runs of (group, packed keys, key length, status bytes or None when every key is pinned)."""
        self._runs = runs
        self._count = sum(
            len(packed) // length if statuses is None else statuses.count(_HIT)
            for _, packed, length, statuses in runs
        )
        self._sets: dict[int, frozenset[bytes]] | None = None

    def _keys(self) -> Iterator[tuple[int, bytes]]:
        for group, packed, length, statuses in self._runs:
            for i in range(0, len(packed), length):
                if statuses is None or statuses[i // length] == _HIT:
                    yield group, packed[i : i + length]

    def holds(self, address: BlockAddress) -> bool:
        sets = self._sets
        if sets is None:
            built: dict[int, set[bytes]] = {}
            for group, key in self._keys():
                built.setdefault(group, set()).add(key)
            sets = self._sets = {group: frozenset(keys) for group, keys in built.items()}
        members = sets.get(address[0])
        return members is not None and address[1] in members

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[BlockAddress]:
        for group, key in self._keys():
            yield group, BlockKey(key)

    def __getitem__(self, index: int) -> BlockAddress:  # type: ignore[override]
        for i, address in enumerate(self):
            if i == index:
                return address
        raise IndexError(index)


class _Namespace:
    """The blocks of one namespace, by address, with the packed Lookup's fingerprint index beside them."""

    __slots__ = (
        "arena",
        "changed",
        "entries",
        "key_index",
        "leases",
        "pins",
        "pool",
        "tenant",
        "used_bytes",
    )

    def __init__(self, pool: _Pool, tenant: str | None, arena: Arena) -> None:
        self.pool = pool
        self.tenant = tenant  # None until a session of the namespace names it (assign_tenant)
        self.arena = arena
        self.entries: dict[BlockAddress, _Entry] = {}
        # group -> fingerprints of the stored keys with their mode numbers, for packed Lookups; it
        # lags `entries` by the addresses in `changed` (MemoryBackend._sync_key_index).
        self.key_index: dict[int, key_index.KeyIndex] = {}
        self.changed: list[BlockAddress] = []
        # Reads in progress and per-address leases: pin count per address (Counter.update runs in C).
        self.pins: Counter[BlockAddress] = Counter()
        # Packed Lookup leases, by identity: pinned and unpinned whole, in O(1).
        self.leases: dict[int, PinnedRuns] = {}
        self.used_bytes = 0

    def pinned(self, address: BlockAddress) -> bool:
        return address in self.pins or any(run.holds(address) for run in self.leases.values())

    def pinned_addresses(self) -> set[BlockAddress]:
        held = set(self.pins)
        for run in self.leases.values():
            held.update(run)
        return held


class MemoryBackend:
    """A BlockBackend in arena memory.

    Hot paths work on whole batches with C-level iteration (map, zip, Counter,
    OrderedDict.move_to_end) instead of a Python loop per key, because a
    4,096-key Lookup must stay around a millisecond. One lock guards the index
    and the arenas' slot tables; value copies and checksums run outside it, on
    slots that are reserved (writes) or pinned (reads).
    """

    name = "memory"

    def __init__(
        self,
        capacity_bytes: int,
        tenant_quotas: Mapping[str, int] | None = None,
        shm_dir: str | None = None,
        shm_groups: Mapping[str, int] | None = None,
    ) -> None:
        """`shm_dir` (e.g. /dev/shm): where tenant arenas are created as files same-host clients may map;
        None keeps values in anonymous memory (inline path only). `shm_groups`: tenant -> gid its arena
        file is shared with (mode 0660); other tenants' files stay 0600."""
        if capacity_bytes <= 0:
            raise ValueError("capacity must be positive")
        quotas = dict(tenant_quotas or {})
        if sum(quotas.values()) > capacity_bytes:
            raise ValueError(
                f"tenant quotas add up to {sum(quotas.values())} bytes, more than the capacity of "
                f"{capacity_bytes}; lower them or raise --capacity"
            )
        self._capacity = capacity_bytes
        self._shm_dir = shm_dir
        self._shm_groups = dict(shm_groups or {})
        if shm_dir is not None:
            remove_orphans(shm_dir)
        self._lock = threading.Lock()
        self._namespaces: dict[str, _Namespace] = {}
        self._arenas: dict[str, Arena] = {}  # tenant -> arena
        self._generations = itertools.count(1)
        self._reservations: dict[int, _Reservation] = {}  # slot generation -> reservation
        self._shared = _Pool(capacity_bytes - sum(quotas.values()), None)
        self._tenant_pools = {tenant: _Pool(quota, tenant) for tenant, quota in quotas.items()}
        self._pools = [self._shared, *self._tenant_pools.values()]
        self._evictions: Counter[str | None] = Counter()  # by tenant (None: not yet known)
        self._corrupted = 0
        self._mode_numbers: dict[str, int] = {}  # mode_id -> its number in the key indexes

    @property
    def max_value_bytes(self) -> int:
        return self._capacity

    # -- arenas ---------------------------------------------------------------

    def assign_tenant(self, namespace_id: str, tenant: str) -> None:
        """Record the namespace's tenant (the service calls this at OpenSession, before any put), so its
        blocks live in that tenant's pool and arena. Blocks stored before the call move to the pool;
        they stay in the arena they were written to (only a direct backend caller stores before)."""
        pool = self._tenant_pools.get(tenant, self._shared)
        with self._lock:
            ns = self._namespaces.get(namespace_id)
            if ns is None:
                self._namespaces[namespace_id] = _Namespace(pool, tenant, self._arena(tenant))
                return
            ns.tenant = tenant
            if not ns.entries:
                ns.arena = self._arena(tenant)
            if ns.pool is pool:
                return
            old = ns.pool
            for address, entry in ns.entries.items():
                del old.lru[(namespace_id, address)]
                pool.lru[(namespace_id, address)] = None
                old.used -= entry.slot.length
                pool.used += entry.slot.length
            ns.pool = pool

    def shared_arena(self, namespace_id: str) -> Arena | None:
        """The shared-memory arena holding the namespace's values, or None (anonymous memory)."""
        with self._lock:
            arena = self._ns(namespace_id).arena
        return arena if arena.shared else None

    def _arena(self, tenant: str) -> Arena:
        """The tenant's arena, created on first use. Caller holds the lock."""
        arena = self._arenas.get(tenant)
        if arena is not None:
            return arena
        size = arena_size(self._capacity)
        pool = self._tenant_pools.get(tenant, self._shared)
        eager, pool.eager_left = pool.eager_left, 0
        if self._shm_dir is not None:
            try:
                free = shared_memory_room(self._shm_dir)
                if free < self._capacity + (16 << 20):
                    raise OSError(
                        f"it has {free} bytes free and the store's capacity is {self._capacity} bytes "
                        "(give the container a larger /dev/shm, e.g. --shm-size, or lower --capacity)"
                    )
                arena = Arena(tenant, size, self._shm_dir, group=self._shm_groups.get(tenant), eager=eager)
            except OSError as exc:
                log.warning(
                    "cannot create a shared-memory arena in %s (%s); values stay in process memory and "
                    "clients use the inline path",
                    self._shm_dir,
                    exc,
                )
        if arena is None:
            arena = Arena(tenant, size, None, eager=eager)
        self._arenas[tenant] = arena
        return arena

    def _ns(self, namespace_id: str) -> _Namespace:
        """The namespace; created in the shared pool and arena if no session named its tenant. Caller
        holds the lock."""
        ns = self._namespaces.get(namespace_id)
        if ns is None:
            ns = self._namespaces[namespace_id] = _Namespace(self._shared, None, self._arena(""))
        return ns

    # -- writes -------------------------------------------------------------

    def put(self, namespace_id: str, mode_id: str, address: BlockAddress, value: bytes) -> PutResult:
        return self.put_many(namespace_id, mode_id, [(address, value)])[0]

    def put_many(
        self, namespace_id: str, mode_id: str, items: Sequence[tuple[BlockAddress, Payload]]
    ) -> list[PutResult]:
        """Per _PUT_CHUNK items: slots under the lock, then outside it each value copied into its slot
        and checksummed there, right after the copy, while the slot's bytes are in cache (on the
        received message, still cold, it cost ~5 GB/s against ~25), then inserts under the lock again
        (so a huge batch does not stall Lookups for long); a repeated address sees the earlier item."""
        results: list[PutResult] = []
        for start in range(0, len(items), _PUT_CHUNK):
            chunk = items[start : start + _PUT_CHUNK]
            with self._lock:
                ns = self._ns(namespace_id)
                granted = [self._reserve_locked(namespace_id, ns, mode_id, a, len(v)) for a, v in chunk]
            view = ns.arena.view
            digests: list[int] = []
            for (_, value), grant in zip(chunk, granted, strict=True):
                if isinstance(grant, Slot):
                    slot = view[grant.offset : grant.offset + grant.length]
                    slot[:] = value
                    digests.append(checksum(slot))
            stored = iter(digests)
            with self._lock:
                results.extend(
                    self._insert_locked(namespace_id, ns, mode_id, address, grant, next(stored))
                    if isinstance(grant, Slot)
                    else grant
                    for (address, _), grant in zip(chunk, granted, strict=True)
                )
        return results

    def reserve(
        self, namespace_id: str, mode_id: str, items: Sequence[tuple[BlockAddress, int]]
    ) -> list[SlotReference | PutResult]:
        """Shared-memory Put, step 1: a slot per item, or the outcome already known (ALREADY_PRESENT,
        CONFLICT, REJECTED). Slots stay reserved until commit() or cancel()."""
        out: list[SlotReference | PutResult] = []
        with self._lock:
            ns = self._ns(namespace_id)
            segment = ns.arena.segment
            for address, length in items:
                grant = self._reserve_locked(namespace_id, ns, mode_id, address, length)
                if isinstance(grant, Slot):
                    self._reservations[grant.generation] = _Reservation(namespace_id, address, grant)
                    out.append(SlotReference(segment, grant.offset, grant.length, grant.generation))
                else:
                    out.append(grant)
        return out

    def reserve_spare(self, namespace_id: str, lengths: Sequence[int]) -> list[SlotReference | PutResult]:
        """Slots reserved for no key yet (CommitSlotsRequest.spare_lengths), while the pool's spare
        slots stay within 1/SPARE_SHARE of its capacity; REJECTED for the rest. They evict like
        any reservation: a full store holds that much less, and a put writing into them saves
        a round trip."""
        with self._lock:
            ns = self._ns(namespace_id)
            pool, arena = ns.pool, ns.arena
            share = pool.capacity // SPARE_SHARE
            slots: list[Slot] = []
            if lengths and len(set(lengths)) == 1:
                # The usual request (one put's blocks, of one size): all at once when they fit in the
                # share and in free room, so there is no eviction to decide per slot.
                length, need = lengths[0], lengths[0] * len(lengths)
                if pool.spare + need <= share and pool.used + pool.reserved + need <= pool.capacity:
                    slots = arena.allocate_many(length, [next(self._generations) for _ in lengths])
                    pool.reserved += length * len(slots)
                    pool.spare += length * len(slots)
            granted: list[Slot | PutResult] = list(slots)
            for length in lengths[len(slots) :]:  # the others one by one, evicting as a put would
                if pool.spare + length > share:
                    granted.append(_SPARE_SHARE_FULL)
                    continue
                slot = self._allocate_locked(ns, length)
                if isinstance(slot, Slot):
                    pool.spare += length
                granted.append(slot)
            out: list[SlotReference | PutResult] = []
            for grant in granted:
                if isinstance(grant, PutResult):
                    out.append(grant)
                    continue
                self._reservations[grant.generation] = _Reservation(namespace_id, None, grant)
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
        """Shared-memory Put, step 2: the reserved slots (by generation) the client wrote. Each value is
        checksummed now, unless the writer sent `digests` (one per generation), and becomes visible
        only by its insert. A wrong client digest is caught by the first read's verification.
        `addresses` (one per generation) bind spare slots to their keys. Returns a result per
        generation and the bytes newly stored."""
        refused: dict[int, PutResult] = {}
        reservations = self._reservations
        with self._lock:
            ns = self._ns(namespace_id)
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
                    self._free_reservation_locked(reservation)
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
        insert = self._insert_locked
        with self._lock:
            for n, (t, digest) in enumerate(zip(taken, digests, strict=True)):
                if t is None:
                    results.append(refused.get(n, _NO_RESERVATION))
                    continue
                result = insert(namespace_id, ns, mode_id, t[0], t[1], digest)
                if result is _STORED:
                    stored += t[1].length
                results.append(result)
        return results, stored

    def cancel(self, generations: Iterable[int]) -> None:
        """Free reserved slots that were never committed (their session ended). Unknown ones are ignored."""
        with self._lock:
            for generation in generations:
                reservation = self._reservations.pop(generation, None)
                if reservation is not None:
                    self._free_reservation_locked(reservation)

    def _free_reservation_locked(self, reservation: _Reservation) -> None:
        ns = self._namespaces.get(reservation.namespace_id)
        if ns is not None:
            ns.arena.free(reservation.slot)
            ns.pool.reserved -= reservation.slot.length
            if reservation.address is None:
                ns.pool.spare -= reservation.slot.length

    def _reserve_locked(
        self, namespace_id: str, ns: _Namespace, mode_id: str, address: BlockAddress, size: int
    ) -> Slot | PutResult:
        """The known outcome of storing `size` bytes at `address`, or a slot for them (counted in
        reserved bytes until inserted or cancelled). Caller holds the lock."""
        pool = ns.pool
        if size > pool.capacity:
            return PutResult(PutOutcome.REJECTED, pool.too_large(size))
        existing = ns.entries.get(address)
        if existing is not None:
            if existing.mode_id != mode_id:
                return PutResult(PutOutcome.CONFLICT, f"key is held by mode {existing.mode_id}")
            pool.lru.move_to_end((namespace_id, address))
            return _ALREADY_PRESENT
        return self._allocate_locked(ns, size)

    def _allocate_locked(self, ns: _Namespace, size: int) -> Slot | PutResult:
        """A slot of `size` bytes, counted in reserved bytes, evicting to make room; REJECTED when the
        pool is full of leases or the arena has no room. Caller holds the lock."""
        pool = ns.pool
        if pool.used + pool.reserved + size > pool.capacity and not self._make_room(pool, size):
            return PutResult(PutOutcome.REJECTED, pool.full_of_leases(self._pinned_bytes(pool)))
        slot = ns.arena.allocate(size, next(self._generations))
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

    def _insert_locked(
        self, namespace_id: str, ns: _Namespace, mode_id: str, address: BlockAddress, slot: Slot, digest: int
    ) -> PutResult:
        """Make a written slot visible at `address`, or free it when the address was filled meanwhile.
        Caller holds the lock."""
        ns.pool.reserved -= slot.length
        existing = ns.entries.get(address)
        if existing is not None:
            ns.arena.free(slot)
            if existing.mode_id != mode_id:
                return PutResult(PutOutcome.CONFLICT, f"key is held by mode {existing.mode_id}")
            ns.pool.lru.move_to_end((namespace_id, address))  # as ReserveSlots' ALREADY_PRESENT does
            return _ALREADY_PRESENT
        ns.entries[address] = _Entry(mode_id, ns.arena, slot, digest)
        self._changed(ns, address)
        ns.pool.lru[(namespace_id, address)] = None
        ns.used_bytes += slot.length
        ns.pool.used += slot.length
        return _STORED

    def _pinned_bytes(self, pool: _Pool) -> int:
        """Bytes of the pool held by leases and reservations. Caller holds the lock. O(pinned keys):
        only needed when it is full."""
        total = pool.reserved
        for ns in self._namespaces.values():
            if ns.pool is not pool:
                continue
            for address in ns.pinned_addresses():
                entry = ns.entries.get(address)
                if entry is not None:
                    total += entry.slot.length
        return total

    def _make_room(self, pool: _Pool, size: int) -> bool:
        """Evict the pool's least recently used unpinned blocks until `size` more bytes fit; False (and
        evict nothing) when the leased blocks leave too little room. Caller holds the lock.

        Leased blocks met on the way move to the recent end (a second chance), so later scans do
        not walk past them again; they are in use, which is what recency means."""
        need = pool.used + pool.reserved + size - pool.capacity
        victims: list[_StoreKey] = []
        leased: list[_StoreKey] = []
        freed = 0
        namespaces = self._namespaces
        for store_key in pool.lru:
            ns_id, address = store_key
            ns = namespaces[ns_id]
            if ns.pinned(address):
                leased.append(store_key)
                continue
            victims.append(store_key)
            freed += ns.entries[address].slot.length
            if freed >= need:
                break
        deque(map(pool.lru.move_to_end, leased), maxlen=0)
        if freed < need:
            return False
        for ns_id, address in victims:
            ns = self._namespaces[ns_id]
            self._remove(ns_id, ns, address, ns.entries[address])
            self._evictions[ns.tenant] += 1
        return True

    def _evict_for_slot(self, arena: Arena, size: int) -> Slot | None:
        """The arena has bytes to spare but no slot that fits (mixed sizes, or a full file system):
        evict this arena's least recently used unpinned blocks until a slot of `size` frees up.
        Caller holds the lock."""
        namespaces = self._namespaces
        candidates = [
            (ns_id, address)
            for pool in self._pools
            for ns_id, address in pool.lru
            if namespaces[ns_id].arena is arena and not namespaces[ns_id].pinned(address)
        ]
        for ns_id, address in candidates:
            ns = namespaces[ns_id]
            self._remove(ns_id, ns, address, ns.entries[address])
            self._evictions[ns.tenant] += 1
            slot = arena.allocate(size, next(self._generations))
            if slot is not None:
                return slot
        return None

    def _remove(self, namespace_id: str, ns: _Namespace, address: BlockAddress, entry: _Entry) -> None:
        del ns.entries[address]
        self._changed(ns, address)
        del ns.pool.lru[(namespace_id, address)]
        ns.arena.free(entry.slot)
        size = entry.slot.length
        ns.used_bytes -= size
        ns.pool.used -= size

    # -- reads --------------------------------------------------------------

    def _find(
        self, namespace_id: str, mode_id: str, addresses: Sequence[BlockAddress], touch: bool
    ) -> tuple[list[KeyStatus], list[_Entry | None]]:
        """Statuses by tag, and the same-mode entry (or None) per address; `touch` marks the hits as
        recently used. Caller holds the lock."""
        ns = self._namespaces.get(namespace_id)
        if ns is None:
            return [_MISS] * len(addresses), [None] * len(addresses)
        stored = list(map(ns.entries.get, addresses))
        found = [e if e is not None and e.mode_id == mode_id else None for e in stored]
        all_hit = None not in found
        if all_hit:
            statuses = [_HIT] * len(found)
        else:
            statuses = [
                _HIT if e is not None else (_MISS if s is None else _MISMATCH)
                for e, s in zip(found, stored, strict=True)
            ]
        if touch:
            hits = (
                addresses if all_hit else [a for e, a in zip(found, addresses, strict=True) if e is not None]
            )
            deque(map(ns.pool.lru.move_to_end, zip(repeat(namespace_id), hits)), maxlen=0)
        return statuses, found

    def _read_pinned(
        self, namespace_id: str, mode_id: str, addresses: Sequence[BlockAddress]
    ) -> tuple[list[KeyStatus], list[_Entry | None], list[BlockAddress]]:
        """Statuses and entries of the addresses, the hits pinned (returned) so their slots stay put
        while they are read outside the lock."""
        with self._lock:
            statuses, found = self._find(namespace_id, mode_id, addresses, touch=True)
            ns = self._namespaces.get(namespace_id)
            pinned: list[BlockAddress] = []
            if ns is not None:
                pinned = [a for a, e in zip(addresses, found, strict=True) if e is not None]
                ns.pins.update(pinned)
        return statuses, found, pinned

    def _drop_corrupted(
        self,
        namespace_id: str,
        addresses: Sequence[BlockAddress],
        statuses: list[KeyStatus],
        found: list[_Entry | None],
        bad: list[int],
    ) -> None:
        """Answer the values at `bad` positions as MISS and drop them from the store (counted)."""
        with self._lock:
            ns = self._namespaces.get(namespace_id)
            for i in bad:
                entry = found[i]
                statuses[i] = _MISS
                found[i] = None
                if ns is not None and entry is not None and ns.entries.get(addresses[i]) is entry:
                    self._remove(namespace_id, ns, addresses[i], entry)
                    self._corrupted += 1

    def lookup(self, namespace_id: str, mode_id: str, addresses: Sequence[BlockAddress]) -> list[KeyStatus]:
        """A key query: presence by tag, no checksum pass (that would read every hit value: 256 MiB
        for 4,096 blocks of 64 KiB). Get verifies; a value corrupted since is a miss there, which the
        connector reports as a load error and the engine recomputes. Recency is not refreshed: the
        hits are pinned by the lease the service takes, and the Get that loads them refreshes them."""
        with self._lock:
            statuses, _ = self._find(namespace_id, mode_id, addresses, touch=False)
        return statuses

    def lookup_and_pin(
        self, namespace_id: str, mode_id: str, addresses: Sequence[BlockAddress]
    ) -> tuple[list[KeyStatus], Sequence[BlockAddress]]:
        """Lookup, pinning the hits under the same lock so no eviction slips between the two.
        Returns the statuses and exactly what was pinned (for the lease to unpin later)."""
        with self._lock:
            statuses, found = self._find(namespace_id, mode_id, addresses, touch=False)
            ns = self._namespaces.get(namespace_id)
            pinned: Sequence[BlockAddress] = []
            if ns is not None and statuses.count(_HIT):
                pinned = (
                    addresses
                    if None not in found
                    else [a for a, e in zip(addresses, found, strict=True) if e is not None]
                )
                ns.pins.update(pinned)
        return statuses, pinned

    def lookup_packed_and_pin(
        self, namespace_id: str, mode_id: str, runs: Sequence[tuple[int, bytes, int]]
    ) -> tuple[bytes, PinnedRuns | None]:
        """lookup_and_pin over runs of (group, packed keys, key length): a status byte per key, and the
        hits pinned as one PinnedRuns (unpin it whole). The keys are probed as fingerprints in the
        namespace's key index, in a few vectorised passes, with no object built per key."""
        parts: list[bytes] = []
        pinned: list[tuple[int, bytes, int, bytes | None]] = []
        with self._lock:
            ns = self._namespaces.get(namespace_id)
            if ns is not None:
                self._sync_key_index(ns)
            mine = self._mode_numbers.get(mode_id, _UNKNOWN_MODE)
            for group, packed, length in runs:
                index = ns.key_index.get(group) if ns is not None else None
                if index is None or not len(index):
                    parts.append(_MISS_BYTE * (len(packed) // length))
                    continue
                modes = index.find(key_index.fingerprints(packed, length))
                hit = modes == mine
                if hit.all():
                    parts.append(_HIT_BYTE * len(modes))
                    pinned.append((group, packed, length, None))
                    continue
                statuses = np.where(hit, int(_HIT), np.where(modes == _NO_MODE, int(_MISS), int(_MISMATCH)))
                part = statuses.astype(np.uint8).tobytes()
                parts.append(part)
                if hit.any():
                    pinned.append((group, packed, length, part))
            lease = None
            if pinned and ns is not None:
                lease = PinnedRuns(pinned)
                ns.leases[id(lease)] = lease
        return b"".join(parts), lease

    def _changed(self, ns: _Namespace, address: BlockAddress) -> None:
        """Note that the address was stored or removed, for the key index. Caller holds the lock."""
        changed = ns.changed
        changed.append(address)
        if len(changed) >= _KEY_INDEX_LAG:
            self._sync_key_index(ns)

    def _sync_key_index(self, ns: _Namespace) -> None:
        """Bring the key index up to `entries` for the changed addresses: a changed key's fingerprint
        is set to its entry's mode number, or removed when it has none. Caller holds the lock."""
        if not ns.changed:
            return
        changed = list(dict.fromkeys(ns.changed))  # each address once, in C
        ns.changed = []
        groups = set(map(itemgetter(0), changed))
        by_group = (
            {groups.pop(): changed}
            if len(groups) == 1
            else {g: [a for a in changed if a[0] == g] for g in groups}
        )
        entries, numbers = ns.entries, self._mode_numbers
        for group, addresses in by_group.items():
            fps = key_index.fingerprints_of(list(map(itemgetter(1), addresses)))
            found = list(map(entries.get, addresses))
            for mode_id in {e.mode_id for e in found if e is not None} - numbers.keys():
                numbers[mode_id] = len(numbers)
            modes = np.array([numbers[e.mode_id] if e is not None else _NO_MODE for e in found], np.int32)
            index = ns.key_index.get(group)
            if index is None:
                index = ns.key_index[group] = key_index.KeyIndex()
            stored = modes != _NO_MODE
            # Removals first: of two keys sharing a fingerprint, a stored one keeps it.
            index.remove(fps[~stored])
            unique, first = np.unique(fps[stored], return_index=True)
            index.set(unique, modes[stored][first])

    def get(self, namespace_id: str, mode_id: str, addresses: Sequence[BlockAddress]) -> list[ReadResult]:
        """Every hit is copied out of its (pinned) slot and the copy's checksum checked before it leaves;
        a failing value is dropped, counted in corrupted_dropped and answered as a MISS."""
        statuses, found, pinned = self._read_pinned(namespace_id, mode_id, addresses)
        try:
            values = [bytes(e.view()) if e is not None else None for e in found]
        finally:
            self.unpin(namespace_id, pinned)
        bad = [
            i
            for i, (e, v) in enumerate(zip(found, values, strict=True))
            if e is not None and v is not None and checksum(v) != e.checksum
        ]
        if bad:
            self._drop_corrupted(namespace_id, addresses, statuses, found, bad)
            for i in bad:
                values[i] = None
        return [ReadResult(status, value) for status, value in zip(statuses, values, strict=True)]

    def get_views(
        self, namespace_id: str, mode_id: str, addresses: Sequence[BlockAddress]
    ) -> tuple[list[ReadResult], list[BlockAddress]]:
        """get() without the copy: each verified hit's value is a view of its slot, pinned (returned)
        until the caller unpins it, so an inline Get reply is built straight from the arena."""
        statuses, found, pinned = self._verified_pinned(namespace_id, mode_id, addresses)
        results = [
            ReadResult(status, e.view() if e is not None else None)
            for status, e in zip(statuses, found, strict=True)
        ]
        return results, pinned

    def get_references(
        self, namespace_id: str, mode_id: str, addresses: Sequence[BlockAddress], verify: bool = True
    ) -> tuple[list[KeyStatus], list[SlotReference | None], list[BlockAddress]]:
        """Shared-memory Get: statuses, a reference per hit and the pinned addresses, which the caller
        holds under a lease until the reader released them (unpin). With `verify`, checksums are
        checked in place and a failing value is dropped and answered as a MISS, like get. Without
        it each reference carries the committed digest for the reader to check its copy against:
        the value is read once, by the reader, instead of once here and again there."""
        if verify:
            statuses, found, pinned = self._verified_pinned(namespace_id, mode_id, addresses)
        else:
            statuses, found, pinned = self._read_pinned(namespace_id, mode_id, addresses)
        references = [
            SlotReference(
                e.arena.segment,
                e.slot.offset,
                e.slot.length,
                e.slot.generation,
                None if verify else e.checksum,
            )
            if e is not None
            else None
            for e in found
        ]
        return statuses, references, pinned

    def _verified_pinned(
        self, namespace_id: str, mode_id: str, addresses: Sequence[BlockAddress]
    ) -> tuple[list[KeyStatus], list[_Entry | None], list[BlockAddress]]:
        """_read_pinned with every hit's checksum checked in place: a failing value is dropped, unpinned
        and answered as a MISS."""
        statuses, found, pinned = self._read_pinned(namespace_id, mode_id, addresses)
        bad = [i for i, e in enumerate(found) if e is not None and checksum(e.view()) != e.checksum]
        if bad:
            self._drop_corrupted(namespace_id, addresses, statuses, found, bad)
            dropped = {addresses[i] for i in bad}
            self.unpin(namespace_id, [a for a in pinned if a in dropped])
            pinned = [a for a in pinned if a not in dropped]
        return statuses, found, pinned

    # -- leases -------------------------------------------------------------

    def pin(self, namespace_id: str, addresses: Sequence[BlockAddress]) -> None:
        with self._lock:
            ns = self._namespaces.get(namespace_id)
            if ns is not None:
                ns.pins.update(addresses)

    def unpin(self, namespace_id: str, addresses: Sequence[BlockAddress]) -> None:
        with self._lock:
            ns = self._namespaces.get(namespace_id)
            if ns is None:
                return
            if isinstance(addresses, PinnedRuns):
                ns.leases.pop(id(addresses), None)
                return
            pins = ns.pins
            for address in addresses:
                count = pins.get(address, 0)
                if count > 1:
                    pins[address] = count - 1
                elif count == 1:
                    dict.__delitem__(pins, address)  # Counter.__delitem__ is a slow Python method

    # -- reporting ----------------------------------------------------------

    def stats(self) -> BackendStats:
        with self._lock:
            keys: Counter[str] = Counter()
            used: Counter[str] = Counter()
            for ns in self._namespaces.values():
                if ns.tenant is not None:
                    keys[ns.tenant] += len(ns.entries)
                    used[ns.tenant] += ns.used_bytes
            tenants = set(keys) | set(self._tenant_pools) | {t for t in self._evictions if t is not None}
            return BackendStats(
                backend=self.name,
                capacity_bytes=self._capacity,
                used_bytes=sum(pool.used for pool in self._pools),
                keys=sum(len(pool.lru) for pool in self._pools),
                evictions=sum(self._evictions.values()),
                leased_keys=sum(
                    1
                    for ns in self._namespaces.values()
                    for address in ns.pinned_addresses()
                    if address in ns.entries
                ),
                corrupted_dropped=self._corrupted,
                per_namespace={
                    ns_id: (len(ns.entries), ns.used_bytes)
                    for ns_id, ns in self._namespaces.items()
                    if ns.entries
                },
                per_tenant={
                    tenant: TenantUsage(
                        keys=keys[tenant],
                        used_bytes=used[tenant],
                        quota_bytes=pool.capacity if (pool := self._tenant_pools.get(tenant)) else 0,
                        evictions=self._evictions[tenant],
                    )
                    for tenant in tenants
                },
                shared_pool_bytes=self._shared.capacity,
                reserved_bytes=sum(pool.reserved for pool in self._pools),
                spare_bytes=sum(pool.spare for pool in self._pools),
            )

    def slots_in_use(self) -> int:
        """Slots held by values and reservations, across arenas: equals keys + reservations when
        nothing leaked."""
        with self._lock:
            return sum(arena.slots_in_use for arena in self._arenas.values())

    def close(self) -> None:
        with self._lock:
            self._namespaces.clear()
            self._reservations.clear()
            for pool in self._pools:
                pool.lru.clear()
                pool.used = 0
                pool.reserved = 0
            arenas, self._arenas = list(self._arenas.values()), {}
        for arena in arenas:
            arena.close()


class MemoryCensus:
    """CensusStore in process: first-writer-wins records for a single service replica."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._modes: dict[str, bytes] = {}
        self._probes: dict[tuple[str, str], ProbeRecord] = {}

    def establish_mode(self, namespace_id: str, mode_encoding: bytes) -> bytes:
        with self._lock:
            return self._modes.setdefault(namespace_id, mode_encoding)

    def reference_probe(self, namespace_id: str, mode_id: str, record: ProbeRecord) -> ProbeRecord:
        with self._lock:
            return self._probes.setdefault((namespace_id, mode_id), record)
