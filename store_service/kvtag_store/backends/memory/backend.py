"""The embedded default backend: tagged values in arena slots, LRU-evicted, checksummed.

What counts as used bytes: the length of each stored value, exactly. Keys,
tags, checksums, slot headers and index overhead are not counted (they are
small and bounded by the key count). Slots reserved for a shared-memory Put
and not yet committed count against the capacity too (`reserved_bytes`), so
committed plus reserved never exceeds it.

Values live in arenas (kvtag_store.backends.shm.arena), one per tenant: shared-memory files
a same-host client maps when the service has a directory for them (--shm-dir),
anonymous memory otherwise. Either way a value is written into a slot, checksummed,
and inserted under the lock only once complete, so no reader ever sees half a value.

Which pool and which arena each namespace's values go to, and when an arena is freed, is tenancy.py's.

Tenant quotas split the capacity into pools (pools.py), each evicted LRU on its own
(allocation.py). This facade owns the lock and the tables; the modules beside it do
the work under it: entries.py (a namespace's blocks, pins and key index), tenancy.py (namespaces'
pools and arenas), reservations.py (the two-phase put) and reads.py (verified Gets).

With a disk dir (disk_dir), every stored value is also written to the disk tier in the background
(disk/writer.py has the policy and what a crash loses): Lookups answer memory misses from its index,
a Get reads a disk-only value back into a slot first (promotion.py), and a restart on the same dir
rebuilds the namespaces from its records. The disk tier sees this tier only through tiering.py.

KV events (observe_blocks): the parts get the backend's EventRelay when they are built; the entries
tell it of blocks entering and leaving memory, the disk tier of records written and dropped.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Mapping, Sequence

from kvtag_store.backends.base import (
    BackendStats,
    BlockAddress,
    BlockEvents,
    EventRelay,
    KeyStatus,
    Payload,
    PutResult,
    ReadResult,
    SlotReference,
)
from kvtag_store.backends.memory.allocation import Allocator
from kvtag_store.backends.memory.disk.tier import SEGMENT_BYTES, DiskTier
from kvtag_store.backends.memory.entries import (
    KEY_INDEX_LAG,
    MISS_BYTE,
    LeaseHold,
    Namespace,
    PinnedRuns,
    ReadPins,
    checksum,
)
from kvtag_store.backends.memory.pools import Pool
from kvtag_store.backends.memory.promotion import Promoter
from kvtag_store.backends.memory.reads import Reader
from kvtag_store.backends.memory.reservations import Reservations
from kvtag_store.backends.memory.tenancy import Tenancy
from kvtag_store.backends.memory.tiering import MemoryPort
from kvtag_store.backends.memory.usage import blocks_held, disk_modes, modes_in_memory_and_disk, usage_report
from kvtag_store.backends.shm import Arena, Slot

_HIT = KeyStatus.HIT
_MISS = KeyStatus.MISS
# Items stored per lock acquisition in put_many, so a huge batch does not hold the lock long
# enough to stall the Lookups waiting behind it.
_PUT_CHUNK = 1024


class MemoryBackend:
    """A BlockBackend in arena memory.

    Hot paths work on whole batches with C-level iteration (map, zip, Counter,
    OrderedDict.move_to_end) instead of a Python loop per key, because a Lookup of
    thousands of keys sits on vLLM's scheduling path. One lock guards the index
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
        key_index_lag: int = KEY_INDEX_LAG,
        prefault: str = "full",
        disk_dir: str | None = None,
        disk_capacity: int = 0,
        disk_segment_bytes: int = SEGMENT_BYTES,
    ) -> None:
        """`shm_dir` (e.g. /dev/shm): where tenant arenas are created as files same-host clients may map;
        None keeps values in anonymous memory (inline path only). `shm_groups`: tenant -> gid its arena
        file is shared with (mode 0660); other tenants' files stay 0600. `key_index_lag`: stores and
        removals the packed Lookup's key index may trail by (it catches up at the next packed Lookup).
        `prefault`: "full" touches each pool's first arena up to the pool's capacity from its creation
        (RSS committed up front, puts never wait for first touches); "lazy" only a window ahead of use.
        `disk_dir`: the disk tier's directory (None: memory only), `disk_capacity` its size in bytes,
        split among the pools as the capacity is; raises disk.errors.DiskDirError when the directory
        cannot be used. `disk_segment_bytes`: the size of its segment files (the unit its LRU drops)."""
        if capacity_bytes <= 0:
            raise ValueError("capacity must be positive")
        if prefault not in ("full", "lazy"):
            raise ValueError(f"prefault must be full or lazy, got {prefault!r}")
        quotas = dict(tenant_quotas or {})
        if sum(quotas.values()) > capacity_bytes:
            raise ValueError(
                f"tenant quotas add up to {sum(quotas.values())} bytes, more than the capacity of "
                f"{capacity_bytes}; lower them or raise --capacity"
            )
        self._capacity = capacity_bytes
        self._lock = threading.Lock()
        self._namespaces: dict[str, Namespace] = {}
        self._shared = Pool(capacity_bytes - sum(quotas.values()), None)
        self._tenant_pools = {tenant: Pool(quota, tenant) for tenant, quota in quotas.items()}
        self._pools = [self._shared, *self._tenant_pools.values()]
        if prefault == "lazy":
            for pool in self._pools:
                pool.eager_left = 0
        self._events = EventRelay()
        self._tenancy = Tenancy(
            self._namespaces,
            capacity_bytes,
            self._shared,
            self._tenant_pools,
            shm_dir,
            dict(shm_groups or {}),
            key_index_lag,
            self._events,
        )
        self._disk: DiskTier | None = None
        if disk_dir is not None:
            self._disk = self._tenancy.disk = DiskTier(
                disk_dir,
                disk_capacity,
                MemoryPort(self._lock, self._namespaces),
                memory_capacity=capacity_bytes,
                pool_capacities={None: self._shared.capacity} | dict[str | None, int](quotas),
                groups=dict(shm_groups or {}),
                segment_bytes=disk_segment_bytes,
                events=self._events,
            )
        self._allocator = Allocator(
            self._namespaces, self._pools, self._disk.spill_evicted if self._disk is not None else None
        )
        self._reservations = Reservations(self._lock, self._namespaces, self._tenancy.ns, self._allocator)
        self._reader = Reader(self._lock, self._namespaces)
        self._promoter: Promoter | None = None
        if self._disk is not None:
            self._promoter = Promoter(self._lock, self._namespaces, self._allocator, self._reader, self._disk)
            with self._lock:
                for namespace_id, (tenant, _) in self._disk.restored.items():
                    self._tenancy.restore(namespace_id, tenant)

    @property
    def max_value_bytes(self) -> int:
        return self._capacity

    # -- tenants and arenas ---------------------------------------------------

    def assign_tenant(self, namespace_id: str, tenant: str, arena: str | None = None) -> None:
        """Record the namespace's tenant (the service calls this at OpenSession, before any put), so its
        blocks live in that tenant's pool, and in `arena`'s arena (None: the tenant's own; a quota or
        --shm-group tenant always has its own). Blocks stored before the call move to the pool; they
        stay in the arena they were written to (only a direct backend caller stores before)."""
        with self._lock:
            self._tenancy.assign(namespace_id, tenant, arena)

    def admit_tenant(self, tenant: str, arena: str | None = None) -> None:
        """Make the arena a session of the tenant will use (as assign_tenant picks it) ready before the
        session opens, and mark it used now, so a sweep does not free it in between."""
        with self._lock:
            self._tenancy.arena(self._tenancy.arena_key(tenant, arena)).last_used = time.monotonic()

    def forget_namespaces(self, namespace_ids: Sequence[str], idle_since: float) -> int:
        """Drop the namespaces (the census forgot them) that hold nothing and no session named since
        `idle_since`, then free every arena no namespace uses: not a quota tenant's or a pool's up-front
        prefaulted one, no slot in use, not admitted since `idle_since`. Returns the bytes unmapped."""
        with self._lock:
            idle = self._tenancy.forget(namespace_ids, idle_since, self._reservations.namespaces())
            for arena in idle:
                self._allocator.evictions.pop(arena.tenant, None)  # its per-tenant series goes with it
        freed = 0
        for arena in idle:
            freed += arena.faulted_bytes
            arena.close()
        return freed

    def arenas(self) -> int:
        """Arenas held, of every tenant."""
        with self._lock:
            return len(self._tenancy.arenas)

    def prefault_progress(self) -> tuple[int, int]:
        """(bytes touched, bytes to touch) of the up-front prefault, over every arena that has one."""
        with self._lock:
            eager = [arena for arena in self._tenancy.arenas.values() if arena.eager]
        return sum(min(a.faulted_bytes, a.eager) for a in eager), sum(a.eager for a in eager)

    def namespace_count(self) -> int:
        """Namespaces the backend keeps state for (with blocks or not)."""
        with self._lock:
            return len(self._namespaces)

    def shared_arena(self, namespace_id: str) -> Arena | None:
        """The shared-memory arena holding the namespace's values, or None (anonymous memory)."""
        with self._lock:
            arena = self._tenancy.ns(namespace_id).arena
        return arena if arena.shared else None

    def observe_blocks(self, events: BlockEvents) -> None:
        """KV events (Observable): the blocks held first (a restarted disk tier's), then each change."""
        with self._lock:
            self._tenancy.announce(events)
            self._events.observer = events

    def restored(self) -> dict[str, tuple[str | None, frozenset[str]]]:
        """namespace_id -> (tenant, mode_ids stored) of the records the disk tier found at start-up
        (empty without one): the census seeds itself from it."""
        return dict(self._disk.restored) if self._disk is not None else {}

    # -- writes -------------------------------------------------------------

    def put(self, namespace_id: str, mode_id: str, address: BlockAddress, value: bytes) -> PutResult:
        return self.put_many(namespace_id, mode_id, [(address, value)])[0]

    def put_many(
        self, namespace_id: str, mode_id: str, items: Sequence[tuple[BlockAddress, Payload]]
    ) -> list[PutResult]:
        """Per _PUT_CHUNK items: slots under the lock, then outside it each value copied into its slot
        and checksummed there, right after the copy, while the slot's bytes are in cache (the received
        message is still cold), then inserts under the lock again (so a huge batch does not stall
        Lookups for long); a repeated address sees the earlier item."""
        results: list[PutResult] = []
        claim = self._allocator.claim
        for start in range(0, len(items), _PUT_CHUNK):
            chunk = items[start : start + _PUT_CHUNK]
            with self._lock:
                ns = self._tenancy.ns(namespace_id)
                granted = [claim(ns, mode_id, a, len(v)) for a, v in chunk]
                ns.writers += 1  # its slots are in no table until inserted: not forgotten meanwhile
            view = ns.arena.view
            digests: list[int] = []
            for (_, value), grant in zip(chunk, granted, strict=True):
                if isinstance(grant, Slot):
                    slot = view[grant.offset : grant.offset + grant.length]
                    slot[:] = value
                    digests.append(checksum(slot))
            stored = iter(digests)
            insert = ns.insert
            with self._lock:
                ns.writers -= 1
                results.extend(
                    insert(mode_id, address, grant, next(stored)) if isinstance(grant, Slot) else grant
                    for (address, _), grant in zip(chunk, granted, strict=True)
                )
        if self._disk is not None:
            self._disk.wake()
        return results

    def reserve(
        self, namespace_id: str, mode_id: str, items: Sequence[tuple[BlockAddress, int]]
    ) -> list[SlotReference | PutResult]:
        """Shared-memory Put, step 1: a slot per item, or the outcome already known (ALREADY_PRESENT,
        CONFLICT, REJECTED). Slots stay reserved until commit() or cancel()."""
        return self._reservations.reserve(namespace_id, mode_id, items)

    def reserve_spare(self, namespace_id: str, lengths: Sequence[int]) -> list[SlotReference | PutResult]:
        """Slots reserved for no key yet (CommitSlotsRequest.spare_lengths), within a share of the
        pool's capacity (reservations.SPARE_SHARE); REJECTED for the rest."""
        return self._reservations.reserve_spare(namespace_id, lengths)

    def commit(
        self,
        namespace_id: str,
        mode_id: str,
        generations: Sequence[int],
        digests: Sequence[int] | None = None,
        addresses: Sequence[BlockAddress] | None = None,
    ) -> tuple[list[PutResult], int]:
        """Shared-memory Put, step 2: the reserved slots (by generation) the client wrote, checksummed
        (unless `digests` came with them) and inserted. `addresses` bind spare slots to their keys.
        Returns a result per generation and the bytes newly stored."""
        outcome = self._reservations.commit(namespace_id, mode_id, generations, digests, addresses)
        if self._disk is not None:
            self._disk.wake()
        return outcome

    def cancel(self, generations: Iterable[int]) -> None:
        """Free reserved slots that were never committed (their session ended). Unknown ones are ignored."""
        self._reservations.cancel(generations)

    # -- lookups ------------------------------------------------------------

    def lookup(self, namespace_id: str, mode_id: str, addresses: Sequence[BlockAddress]) -> list[KeyStatus]:
        """A key query: presence by tag, no checksum pass (that would read every hit value: 256 MiB
        for 4,096 blocks of 64 KiB). Get verifies; a value corrupted since is a miss there, which the
        connector reports as a load error and the engine recomputes. Recency is not refreshed: the
        hits are pinned by the lease the service takes, and the Get that loads them refreshes them."""
        with self._lock:
            ns = self._namespaces.get(namespace_id)
            if ns is None:
                return [_MISS] * len(addresses)
            statuses, _ = ns.find(mode_id, addresses, touch=False)
            if ns.disk and _MISS in statuses:
                ns.disk.statuses(mode_id, addresses, statuses)
        return statuses

    def lookup_and_pin(
        self, namespace_id: str, mode_id: str, addresses: Sequence[BlockAddress]
    ) -> tuple[list[KeyStatus], Sequence[BlockAddress]]:
        """Lookup, pinning the hits under the same lock so no eviction slips between the two.
        Returns the statuses and exactly what was pinned (a LeaseHold, for the lease to unpin later)."""
        with self._lock:
            ns = self._namespaces.get(namespace_id)
            if ns is None:
                return [_MISS] * len(addresses), []
            statuses, found = ns.find(mode_id, addresses, touch=False)
            pinned: Sequence[BlockAddress] = []
            if ns.disk and _MISS in statuses:
                ns.disk.statuses(mode_id, addresses, statuses)
                pinned = LeaseHold(a for a, s in zip(addresses, statuses, strict=True) if s is _HIT)
                ns.holds.update(pinned)
            elif statuses.count(_HIT):
                pinned = LeaseHold(
                    addresses
                    if None not in found
                    else (a for a, e in zip(addresses, found, strict=True) if e is not None)
                )
                ns.holds.update(pinned)
        return statuses, pinned

    def lookup_packed_and_pin(
        self, namespace_id: str, mode_id: str, runs: Sequence[tuple[int, bytes, int]]
    ) -> tuple[bytes, PinnedRuns | None]:
        """lookup_and_pin over runs of (group, packed keys, key length): a status byte per key, and the
        hits pinned as one PinnedRuns (unpin it whole). The keys are probed as fingerprints in the
        namespace's key index, in a few vectorised passes, with no object built per key."""
        with self._lock:
            ns = self._namespaces.get(namespace_id)
            if ns is not None:
                return ns.lookup_packed_and_pin(mode_id, runs)
        return b"".join(MISS_BYTE * (len(packed) // length) for _, packed, length in runs), None

    # -- reads --------------------------------------------------------------

    def get(self, namespace_id: str, mode_id: str, addresses: Sequence[BlockAddress]) -> list[ReadResult]:
        """Every hit is copied out of its (pinned) slot and the copy's checksum checked before it leaves;
        a failing value is dropped, counted in corrupted_dropped and answered as a MISS. Values held on
        disk only are read back into memory first, or into a private buffer when memory has no room
        (a failing record is dropped and answered as a MISS)."""
        if self._promoter is None:
            return self._reader.get(namespace_id, mode_id, addresses)
        return self._promoter.get(namespace_id, mode_id, addresses)

    def get_views(
        self, namespace_id: str, mode_id: str, addresses: Sequence[BlockAddress]
    ) -> tuple[list[ReadResult], list[BlockAddress]]:
        """get() without the copy: each verified hit's value is a view of its slot, pinned (returned)
        until the caller unpins it, so an inline Get reply is built straight from the arena. A value
        read around a full memory is a view of its own buffer (nothing to unpin)."""
        if self._promoter is None:
            return self._reader.get_views(namespace_id, mode_id, addresses)
        return self._promoter.get_views(namespace_id, mode_id, addresses)

    def get_references(
        self, namespace_id: str, mode_id: str, addresses: Sequence[BlockAddress], verify: bool = True
    ) -> tuple[list[KeyStatus], list[SlotReference | None], list[BlockAddress]]:
        """Shared-memory Get: statuses, a reference per hit and the pinned addresses, which the caller
        holds under a lease until the reader released them (unpin). With `verify` a failing value is
        dropped and answered as a MISS, like get; without it each reference carries the committed
        digest for the reader to check its copy against. A disk-resident value is read back first,
        straight into the slot the reader copies from: a new entry's, or when memory has no room, a
        slot of the arena outside the pool's bytes that the lease holds (ReadPins), at most the pool's
        capacity of them at once."""
        if self._promoter is None:
            return self._reader.get_references(namespace_id, mode_id, addresses, verify)
        return self._promoter.get_references(namespace_id, mode_id, addresses, verify)

    # -- leases -------------------------------------------------------------

    def pin(self, namespace_id: str, addresses: Sequence[BlockAddress]) -> None:
        with self._lock:
            ns = self._namespaces.get(namespace_id)
            if ns is not None:
                ns.pins.update(addresses)

    def unpin(self, namespace_id: str, addresses: Sequence[BlockAddress]) -> None:
        """Release pins or a lease; a shared-memory Get's (ReadPins) frees its read-around slots too."""
        with self._lock:
            ns = self._namespaces.get(namespace_id)
            if ns is not None:
                ns.unpin(addresses)
        if isinstance(addresses, ReadPins) and self._promoter is not None:
            around, addresses.around = addresses.around, []  # a lease released twice frees them once
            self._promoter.free_around(around)

    # -- reporting ----------------------------------------------------------

    def stats(self) -> BackendStats:
        """With the disk tier on, `tiers` is [memory, disk] and `errors` counts disk_spill_dropped."""
        prefault = self.prefault_progress()
        with self._lock:
            report = usage_report(
                prefault=prefault,
                name=self.name,
                capacity=self._capacity,
                namespaces=self._namespaces,
                pools=self._pools,
                tenant_pools=self._tenant_pools,
                shared=self._shared,
                evictions=self._allocator.evictions,
                corrupted=self._reader.corrupted,
            )
            if self._disk is not None:
                report.tiers.append(self._disk.usage())
                # Values evicted before the writer reached them, past its bounded queue: lost, not on
                # disk (TierStats has no field for it; backend errors by kind are shown beside it).
                report.errors["disk_spill_dropped"] = self._disk.spill_dropped
        return report

    def blocks_per_namespace(self) -> dict[str, int]:
        """namespace_id -> blocks held in either tier (NamespaceCounting), for the census's sweep."""
        with self._lock:
            return {ns_id: held for ns_id, ns in self._namespaces.items() if (held := blocks_held(ns))}

    def modes_holding(self, namespace_id: str) -> frozenset[str]:
        """The modes whose blocks the namespace holds in either tier (ModeHoldings)."""
        with self._lock:
            ns = self._namespaces.get(namespace_id)
            if ns is None:
                return frozenset()
            modes, on_disk = modes_in_memory_and_disk(ns)
            numbers = dict(ns.disk.modes) if on_disk else {}
        return frozenset(modes | disk_modes(on_disk, numbers)) if on_disk else frozenset(modes)

    def disk_tier(self) -> DiskTier | None:
        """The disk tier, for its own figures (spill_dropped, rebuild time); None without one."""
        return self._disk

    def slots_in_use(self) -> int:
        """Slots held by values and reservations, across arenas: equals keys + reservations when
        nothing leaked."""
        with self._lock:
            return sum(arena.slots_in_use for arena in self._tenancy.arenas.values())

    def close(self) -> None:
        """With the disk tier: first every value still only in memory is queued and written, the writer
        drained, the files fsynced and the directory's lock released (the server calls this on SIGTERM)."""
        disk, self._disk = self._disk, None
        if disk is not None:
            with self._lock:
                self._tenancy.queue_unwritten()
            disk.close()
        with self._lock:
            self._namespaces.clear()
            self._reservations.clear()
            for pool in self._pools:
                pool.lru.clear()
                pool.used = 0
                pool.reserved = 0
            arenas = list(self._tenancy.arenas.values())
            self._tenancy.arenas.clear()
        for arena in arenas:
            arena.close()
