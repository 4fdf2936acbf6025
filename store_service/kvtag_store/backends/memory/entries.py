"""A namespace's stored blocks: its entries by address, the pins and leases that hold them in place,
and the packed Lookup's key index kept beside them.

Every method here runs under the backend's lock (MemoryBackend._lock); none takes it.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Iterator, Sequence
from itertools import repeat
from operator import itemgetter

import numpy as np

from kvtag_store.backends import key_index
from kvtag_store.backends.base import (
    TIER_MEMORY,
    BlockAddress,
    BlockKey,
    EventRelay,
    KeyStatus,
    PutOutcome,
    PutResult,
)
from kvtag_store.backends.memory.disk.index import DiskIndex
from kvtag_store.backends.memory.disk.records import value_digest
from kvtag_store.backends.memory.pools import Pool
from kvtag_store.backends.shm.arena import Arena, Slot

_HIT = KeyStatus.HIT
_MISS = KeyStatus.MISS
_MISMATCH = KeyStatus.MODE_MISMATCH
# Results without a reason are immutable and shared: no allocation per stored item.
STORED = PutResult(PutOutcome.STORED)
ALREADY_PRESENT = PutResult(PutOutcome.ALREADY_PRESENT)

HIT_BYTE = bytes([_HIT])
MISS_BYTE = bytes([_MISS])
_NO_MODE = key_index.NOT_FOUND
_UNKNOWN_MODE = -2  # a mode that stored nothing yet: matches no index entry, not even NOT_FOUND
# The disk index of a namespace without a disk tier: always empty (only the tier fills the ones it owns).
NO_DISK = DiskIndex({})
# The events of a namespace built without its backend's (tells no one).
NO_EVENTS = EventRelay()
# The key index catches up with stores and removals at the next packed Lookup, or after this many
# changes: the bound on how long a write or a scheduler's Lookup waits under the lock for it.
KEY_INDEX_LAG = 4096


# The checksum of every stored value, chosen here only: xxh3-64. It is faster than zlib's CRC-32
# (docs/benchmarks.md has the figures and the A/B) and releases the GIL like it.
# A corrupted value passes unnoticed with probability 2**-64 (CRC-32 catches every single-bit flip
# for certain, any other damage with 2**-32). The disk tier stores this digest in each record's
# header, so it is defined there (disk.records.value_digest): changing it means a new disk format.
checksum = value_digest


class Entry:
    """One stored block. A slotted class, not a dataclass: millions may exist."""

    __slots__ = ("arena", "checksum", "disk", "mode_id", "slot")

    def __init__(self, mode_id: str, arena: Arena, slot: Slot, digest: int, disk: int | None = None) -> None:
        self.mode_id = mode_id
        self.arena = arena
        self.slot = slot
        self.checksum = digest
        # Its record's location in the disk tier (disk.records.location), None while in memory only:
        # evicting an entry already on disk costs nothing.
        self.disk = disk

    def view(self) -> memoryview:
        """The value's bytes in the arena: valid while the entry is pinned or the lock is held."""
        return self.arena.view[self.slot.offset : self.slot.offset + self.slot.length]


def conflict(existing: Entry) -> PutResult:
    """The answer to a put at an address another mode holds."""
    return PutResult(PutOutcome.CONFLICT, f"key is held by mode {existing.mode_id}")


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


class LeaseHold(list[BlockAddress]):
    """The hits a Lookup leased (lookup_and_pin), as unpin gets them back: held in Namespace.holds, not
    in its slot pins, because a Lookup's lease promises that the block loads, not that its memory slot
    stays put. A leased block whose bytes are on disk may leave memory (Namespace.evictable)."""

    __slots__ = ()


class ReadPins(list[BlockAddress]):
    """What a shared-memory Get holds under its lease: the addresses it pinned in memory, and `around`,
    the slots it read disk records into when memory had no room for them (in no table, freed when
    the lease ends: MemoryBackend.unpin). True when either holds something."""

    __slots__ = ("around",)

    def __init__(self, addresses: Sequence[BlockAddress], around: list[tuple[Arena, Slot, Pool]]) -> None:
        super().__init__(addresses)
        self.around = around

    def __bool__(self) -> bool:
        return bool(len(self) or self.around)


class Namespace:
    """The blocks of one namespace, by address, with the packed Lookup's fingerprint index beside them."""

    __slots__ = (
        "arena",
        "changed",
        "disk",
        "entries",
        "events",
        "holds",
        "key_index",
        "key_index_lag",
        "leases",
        "mode_blocks",
        "mode_numbers",
        "namespace_id",
        "pins",
        "pool",
        "spill",
        "tenant",
        "touched",
        "used_bytes",
        "writers",
    )

    def __init__(
        self,
        namespace_id: str,
        pool: Pool,
        tenant: str | None,
        arena: Arena,
        mode_numbers: dict[str, int],
        key_index_lag: int = KEY_INDEX_LAG,
        disk: DiskIndex = NO_DISK,
        spill: deque[tuple[object, ...]] | None = None,
        events: EventRelay = NO_EVENTS,
    ) -> None:
        """`mode_numbers`: mode_id -> its number in the key indexes, one table shared by the store's
        namespaces. `key_index_lag`: changes the key index may trail `entries` by. `disk`: the
        namespace's index in the disk tier, `spill`: the disk writer's queue (disk.writer.WriteQueue),
        each insert appends its reference (namespace_id, address, generation, length) to it; both only
        with the disk tier on. `events`: told of every block entering or leaving memory (KV events)."""
        self.namespace_id = namespace_id
        self.pool = pool
        self.tenant = tenant  # None until a session of the namespace names it (assign_tenant)
        self.arena = arena
        self.entries: dict[BlockAddress, Entry] = {}
        # mode_id -> its entries in memory: which modes hold blocks here, without a pass over them.
        self.mode_blocks: Counter[str] = Counter()
        # group -> fingerprints of the stored keys with their mode numbers, for packed Lookups; it
        # lags `entries` by the addresses in `changed` (sync_key_index).
        self.key_index: dict[int, key_index.KeyIndex] = {}
        self.changed: list[BlockAddress] = []
        self.mode_numbers = mode_numbers
        self.key_index_lag = key_index_lag
        # Slot pins: reads in progress, shared-memory read leases, the disk writer's copies. A pinned
        # slot is never evicted. Pin count per address (Counter.update runs in C).
        self.pins: Counter[BlockAddress] = Counter()
        # Lookup leases (LeaseHold): the block must load while one holds, from memory or from disk.
        self.holds: Counter[BlockAddress] = Counter()
        # Packed Lookup leases, by identity: pinned and unpinned whole, in O(1).
        self.leases: dict[int, PinnedRuns] = {}
        self.used_bytes = 0
        # The disk tier's index of this namespace (owned by the tier; read here under the lock).
        self.disk = disk
        self.spill = spill
        self.events = events
        # When a session last named the namespace (time.monotonic()), and puts between taking their
        # slots and inserting them: forget_namespaces keeps a namespace either says is in use.
        self.touched = time.monotonic()
        self.writers = 0

    def idle(self, since: float) -> bool:
        """Holds nothing (blocks, pins, leases, puts in flight) and untouched since `since`."""
        busy = self.entries or self.disk or self.pins or self.holds or self.leases or self.writers
        return not busy and self.touched <= since

    # -- pins and leases ------------------------------------------------------

    def pinned(self, address: BlockAddress) -> bool:
        """Held by anything: a slot pin or a Lookup's lease (its disk record stays too)."""
        return address in self.pins or self.leased(address)

    def leased(self, address: BlockAddress) -> bool:
        return address in self.holds or any(run.holds(address) for run in self.leases.values())

    def evictable(self, address: BlockAddress, entry: Entry) -> bool:
        """May leave memory: no slot pin, and no Lookup lease unless its bytes are on disk. A lease
        promises the block loads; a copy on disk keeps that promise (its record stays while leased and
        a Get reads it back), so leased blocks on disk never fill memory for the Gets that follow."""
        return address not in self.pins and (entry.disk is not None or not self.leased(address))

    def pinned_addresses(self) -> set[BlockAddress]:
        held = set(self.pins)
        held.update(self.holds)
        for run in self.leases.values():
            held.update(run)
        return held

    def unpin(self, addresses: Sequence[BlockAddress]) -> None:
        if isinstance(addresses, PinnedRuns):
            self.leases.pop(id(addresses), None)
            return
        pins = self.holds if isinstance(addresses, LeaseHold) else self.pins
        for address in addresses:
            count = pins.get(address, 0)
            if count > 1:
                pins[address] = count - 1
            elif count == 1:
                dict.__delitem__(pins, address)  # Counter.__delitem__ is a slow Python method

    # -- entries --------------------------------------------------------------

    def insert(
        self, mode_id: str, address: BlockAddress, slot: Slot, digest: int, disk: int | None = None
    ) -> PutResult:
        """Make a written (reserved) slot visible at `address`, or free it when the address was filled
        meanwhile. `disk`: the value was read back from this disk record (not written again); any other
        insert is queued for the disk writer when the tier is on."""
        pool = self.pool
        pool.reserved -= slot.length
        existing = self.entries.get(address)
        if existing is not None:
            self.arena.free(slot)
            if existing.mode_id != mode_id:
                return conflict(existing)
            pool.lru.move_to_end((self.namespace_id, address))  # as ReserveSlots' ALREADY_PRESENT does
            return ALREADY_PRESENT
        self.entries[address] = Entry(mode_id, self.arena, slot, digest, disk)
        self.mode_blocks[mode_id] += 1
        self.events.stored(self.namespace_id, mode_id, address, TIER_MEMORY)
        if disk is None and self.spill is not None:
            self.spill.append((self.namespace_id, address, slot.generation, slot.length))
        self.note_changed(address)
        pool.lru[(self.namespace_id, address)] = None
        self.used_bytes += slot.length
        pool.used += slot.length
        return STORED

    def remove(self, address: BlockAddress, entry: Entry) -> None:
        del self.entries[address]
        self.events.removed(self.namespace_id, entry.mode_id, address, TIER_MEMORY)
        left = self.mode_blocks[entry.mode_id] - 1
        if left > 0:
            self.mode_blocks[entry.mode_id] = left
        else:
            del self.mode_blocks[entry.mode_id]
        self.note_changed(address)
        del self.pool.lru[(self.namespace_id, address)]
        self.arena.free(entry.slot)
        size = entry.slot.length
        self.used_bytes -= size
        self.pool.used -= size

    def find(
        self, mode_id: str, addresses: Sequence[BlockAddress], touch: bool
    ) -> tuple[list[KeyStatus], list[Entry | None]]:
        """Statuses by tag, and the same-mode entry (or None) per address; `touch` marks the hits as
        recently used."""
        stored = list(map(self.entries.get, addresses))
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
            deque(map(self.pool.lru.move_to_end, zip(repeat(self.namespace_id), hits)), maxlen=0)
        return statuses, found

    # -- the key index --------------------------------------------------------

    def lookup_packed_and_pin(
        self, mode_id: str, runs: Sequence[tuple[int, bytes, int]]
    ) -> tuple[bytes, PinnedRuns | None]:
        """A status byte per key of the runs of (group, packed keys, key length), probed as fingerprints
        in the key index, and the hits pinned as one PinnedRuns lease (None when nothing hit)."""
        self.sync_key_index()
        mine = self.mode_numbers.get(mode_id, _UNKNOWN_MODE)
        parts: list[bytes] = []
        pinned: list[tuple[int, bytes, int, bytes | None]] = []
        on_disk = bool(self.disk)
        for group, packed, length in runs:
            index = self.key_index.get(group)
            if index is None or not len(index):
                part = MISS_BYTE * (len(packed) // length)
                if on_disk:
                    part = self.disk.packed_statuses(mode_id, group, packed, length, part)
                    if HIT_BYTE in part:
                        pinned.append((group, packed, length, part if part.count(_HIT) < len(part) else None))
                parts.append(part)
                continue
            modes = index.find(key_index.fingerprints(packed, length))
            hit = modes == mine
            if hit.all():
                parts.append(HIT_BYTE * len(modes))
                pinned.append((group, packed, length, None))
                continue
            statuses = np.where(hit, int(_HIT), np.where(modes == _NO_MODE, int(_MISS), int(_MISMATCH)))
            part = statuses.astype(np.uint8).tobytes()
            if on_disk:
                part = self.disk.packed_statuses(mode_id, group, packed, length, part)
                if part.count(_HIT) == len(part):
                    parts.append(part)
                    pinned.append((group, packed, length, None))
                    continue
            parts.append(part)
            if HIT_BYTE in part:
                pinned.append((group, packed, length, part))
        lease = None
        if pinned:
            lease = PinnedRuns(pinned)
            self.leases[id(lease)] = lease
        return b"".join(parts), lease

    def note_changed(self, address: BlockAddress) -> None:
        """Note that the address was stored or removed, for the key index."""
        changed = self.changed
        changed.append(address)
        if len(changed) >= self.key_index_lag:
            self.sync_key_index()

    def sync_key_index(self) -> None:
        """Bring the key index up to `entries` for the changed addresses: a changed key's fingerprint
        is set to its entry's mode number, or removed when it has none."""
        if not self.changed:
            return
        changed = list(dict.fromkeys(self.changed))  # each address once, in C
        self.changed = []
        groups = set(map(itemgetter(0), changed))
        by_group = (
            {groups.pop(): changed}
            if len(groups) == 1
            else {g: [a for a in changed if a[0] == g] for g in groups}
        )
        entries, numbers = self.entries, self.mode_numbers
        for group, addresses in by_group.items():
            fps = key_index.fingerprints_of(list(map(itemgetter(1), addresses)))
            found = list(map(entries.get, addresses))
            for mode_id in {e.mode_id for e in found if e is not None} - numbers.keys():
                numbers[mode_id] = len(numbers)
            modes = np.array([numbers[e.mode_id] if e is not None else _NO_MODE for e in found], np.int32)
            index = self.key_index.get(group)
            if index is None:
                index = self.key_index[group] = key_index.KeyIndex()
            stored = modes != _NO_MODE
            # Removals first: of two keys sharing a fingerprint, a stored one keeps it.
            index.remove(fps[~stored])
            unique, first = np.unique(fps[stored], return_index=True)
            index.set(unique, modes[stored][first])
