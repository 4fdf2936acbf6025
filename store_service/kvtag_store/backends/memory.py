"""The embedded default backend: tagged values in process memory, LRU-evicted, checksummed.

What counts as used bytes: the length of each stored value, exactly. Keys,
tags, checksums and index overhead are not counted (they are small and
bounded by the key count).

Tenant quotas (--tenant-quota) split the capacity into pools: each tenant with
a quota gets a pool of that size, and the tenants without one share the rest.
Eviction is LRU within a pool, so a tenant over its quota evicts only its own
blocks, and no tenant can ever evict another pool's blocks.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict, deque
from collections.abc import Mapping, Sequence
from itertools import repeat
from operator import attrgetter

import xxhash

from kvtag_store.backends.base import (
    BackendStats,
    BlockAddress,
    KeyStatus,
    ProbeRecord,
    PutOutcome,
    PutResult,
    ReadResult,
    TenantUsage,
)

_HIT = KeyStatus.HIT
_MISS = KeyStatus.MISS
_MISMATCH = KeyStatus.MODE_MISMATCH
# Results without a reason are immutable and shared: no allocation per stored item.
_STORED = PutResult(PutOutcome.STORED)
_ALREADY_PRESENT = PutResult(PutOutcome.ALREADY_PRESENT)
# Items stored per lock acquisition in put_many: about a millisecond of lock hold.
_PUT_CHUNK = 1024

# (namespace_id, (group, key)): a block's address across the whole store.
_StoreKey = tuple[str, BlockAddress]


# The checksum of every stored value, chosen here only: xxh3-64. It runs at about 24 GB/s here against
# 5.7 for zlib's CRC-32 (which cost 26% of a 1 MiB Get's server time) and releases the GIL like it.
# A corrupted value passes unnoticed with probability 2**-64 (CRC-32 catches every single-bit flip
# for certain, any other damage with 2**-32). Values live in process memory only: nothing persisted
# depends on the choice.
checksum = xxhash.xxh3_64_intdigest


class _Entry:
    """One stored block. A slotted class, not a dataclass: millions may exist."""

    __slots__ = ("checksum", "mode_id", "value")

    def __init__(self, mode_id: str, value: bytes, digest: int) -> None:
        self.mode_id = mode_id
        self.value = value
        self.checksum = digest


_VALUE = attrgetter("value")
_CHECKSUM = attrgetter("checksum")


class _Pool:
    """Bytes shared by some namespaces (one quota tenant's, or all the others') and their LRU order."""

    __slots__ = ("capacity", "lru", "tenant", "used")

    def __init__(self, capacity: int, tenant: str | None) -> None:
        self.capacity = capacity
        self.tenant = tenant  # None: the shared pool
        self.used = 0
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
            f"{where} full of leased blocks: {leased} of {self.capacity} bytes are leased; "
            f"release leases (Get with lease_id, ReleaseLeases) or raise {knob}"
        )


class _Namespace:
    """The blocks of one namespace, indexed by address and, for reads, by (mode, address)."""

    __slots__ = ("by_mode", "entries", "pins", "pool", "tenant", "used_bytes")

    def __init__(self, pool: _Pool, tenant: str | None) -> None:
        self.pool = pool
        self.tenant = tenant  # None until a session of the namespace names it (assign_tenant)
        self.entries: dict[BlockAddress, _Entry] = {}
        # mode_id -> address -> entry: a read in mode M is one C-level dict lookup per key.
        self.by_mode: dict[str, dict[BlockAddress, _Entry]] = {}
        # Read leases: pin count per address (Counter.update over the caller's tuples runs in C).
        self.pins: Counter[BlockAddress] = Counter()
        self.used_bytes = 0


class MemoryBackend:
    """A BlockBackend in process memory.

    Hot paths work on whole batches with C-level iteration (map, zip, Counter,
    OrderedDict.move_to_end) instead of a Python loop per key, because a
    4,096-key Lookup must stay around a millisecond. One lock guards the index;
    checksums run outside it.
    """

    name = "memory"

    def __init__(self, capacity_bytes: int, tenant_quotas: Mapping[str, int] | None = None) -> None:
        if capacity_bytes <= 0:
            raise ValueError("capacity must be positive")
        quotas = dict(tenant_quotas or {})
        if sum(quotas.values()) > capacity_bytes:
            raise ValueError(
                f"tenant quotas add up to {sum(quotas.values())} bytes, more than the capacity of "
                f"{capacity_bytes}; lower them or raise --capacity"
            )
        self._capacity = capacity_bytes
        self._lock = threading.Lock()
        self._namespaces: dict[str, _Namespace] = {}
        self._shared = _Pool(capacity_bytes - sum(quotas.values()), None)
        self._tenant_pools = {tenant: _Pool(quota, tenant) for tenant, quota in quotas.items()}
        self._pools = [self._shared, *self._tenant_pools.values()]
        self._evictions: Counter[str | None] = Counter()  # by tenant (None: not yet known)
        self._corrupted = 0

    @property
    def max_value_bytes(self) -> int:
        return self._capacity

    def assign_tenant(self, namespace_id: str, tenant: str) -> None:
        """Record the namespace's tenant (the service calls this at OpenSession, before any put), so its
        blocks live in that tenant's pool. Blocks stored before the call move there."""
        pool = self._tenant_pools.get(tenant, self._shared)
        with self._lock:
            ns = self._namespaces.get(namespace_id)
            if ns is None:
                self._namespaces[namespace_id] = _Namespace(pool, tenant)
                return
            ns.tenant = tenant
            if ns.pool is pool:
                return
            old = ns.pool
            for address, entry in ns.entries.items():
                del old.lru[(namespace_id, address)]
                pool.lru[(namespace_id, address)] = None
                old.used -= len(entry.value)
                pool.used += len(entry.value)
            ns.pool = pool

    def _namespace(self, namespace_id: str) -> _Namespace:
        """The namespace; created in the shared pool if no session named its tenant. Caller holds the lock."""
        ns = self._namespaces.get(namespace_id)
        if ns is None:
            ns = self._namespaces[namespace_id] = _Namespace(self._shared, None)
        return ns

    # -- writes -------------------------------------------------------------

    def put(self, namespace_id: str, mode_id: str, address: BlockAddress, value: bytes) -> PutResult:
        return self.put_many(namespace_id, mode_id, [(address, value)])[0]

    def put_many(
        self, namespace_id: str, mode_id: str, items: Sequence[tuple[BlockAddress, bytes]]
    ) -> list[PutResult]:
        """Checksums first, outside the lock (the checksum releases the GIL); then the items in order under
        one lock acquisition per _PUT_CHUNK items (so a huge batch does not stall Lookups for long);
        a repeated address sees the earlier item."""
        digests = [checksum(value) if len(value) <= self._capacity else -1 for _, value in items]
        results: list[PutResult] = []
        for start in range(0, len(items), _PUT_CHUNK):
            with self._lock:
                ns = self._namespace(namespace_id)
                results.extend(
                    self._put_locked(namespace_id, ns, mode_id, address, value, digest)
                    for (address, value), digest in zip(
                        items[start : start + _PUT_CHUNK], digests[start : start + _PUT_CHUNK], strict=True
                    )
                )
        return results

    def _put_locked(
        self,
        namespace_id: str,
        ns: _Namespace,
        mode_id: str,
        address: BlockAddress,
        value: bytes,
        digest: int,
    ) -> PutResult:
        """One item of put_many. Caller holds the lock."""
        size = len(value)
        pool = ns.pool
        if size > pool.capacity:
            return PutResult(PutOutcome.REJECTED, pool.too_large(size))
        existing = ns.entries.get(address)
        if existing is not None:
            if existing.mode_id != mode_id:
                return PutResult(PutOutcome.CONFLICT, f"key is held by mode {existing.mode_id}")
            pool.lru.move_to_end((namespace_id, address))
            return _ALREADY_PRESENT
        if pool.used + size > pool.capacity and not self._make_room(pool, size):
            return PutResult(PutOutcome.REJECTED, pool.full_of_leases(self._pinned_bytes(pool)))
        entry = _Entry(mode_id, value, digest)
        ns.entries[address] = entry
        mode_entries = ns.by_mode.get(mode_id)
        if mode_entries is None:
            mode_entries = ns.by_mode[mode_id] = {}
        mode_entries[address] = entry
        pool.lru[(namespace_id, address)] = None
        ns.used_bytes += size
        pool.used += size
        return _STORED

    def _pinned_bytes(self, pool: _Pool) -> int:
        """Bytes of the pool held by leases. Caller holds the lock. O(pinned keys): only when it is full."""
        total = 0
        for ns in self._namespaces.values():
            if ns.pool is not pool:
                continue
            for address in ns.pins:
                entry = ns.entries.get(address)
                if entry is not None:
                    total += len(entry.value)
        return total

    def _make_room(self, pool: _Pool, size: int) -> bool:
        """Evict the pool's least recently used unpinned blocks until `size` more bytes fit; False (and
        evict nothing) when the leased blocks leave too little room. Caller holds the lock.

        Leased blocks met on the way move to the recent end (a second chance), so later scans do
        not walk past them again; they are in use, which is what recency means."""
        need = pool.used + size - pool.capacity
        victims: list[_StoreKey] = []
        leased: list[_StoreKey] = []
        freed = 0
        namespaces = self._namespaces
        for store_key in pool.lru:
            ns_id, address = store_key
            ns = namespaces[ns_id]
            if address in ns.pins:
                leased.append(store_key)
                continue
            victims.append(store_key)
            freed += len(ns.entries[address].value)
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

    def _remove(self, namespace_id: str, ns: _Namespace, address: BlockAddress, entry: _Entry) -> None:
        del ns.entries[address]
        del ns.by_mode[entry.mode_id][address]
        del ns.pool.lru[(namespace_id, address)]
        size = len(entry.value)
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
        mode_entries = ns.by_mode.get(mode_id, {})
        found = list(map(mode_entries.get, addresses))
        all_hit = None not in found
        if all_hit:
            statuses = [_HIT] * len(found)
        else:
            entries = ns.entries
            statuses = [
                _HIT if e is not None else (_MISMATCH if a in entries else _MISS)
                for e, a in zip(found, addresses, strict=True)
            ]
        if touch:
            hits = (
                addresses if all_hit else [a for e, a in zip(found, addresses, strict=True) if e is not None]
            )
            deque(map(ns.pool.lru.move_to_end, zip(repeat(namespace_id), hits)), maxlen=0)
        return statuses, found

    def _verify(
        self,
        namespace_id: str,
        addresses: Sequence[BlockAddress],
        statuses: list[KeyStatus],
        found: list[_Entry | None],
    ) -> None:
        """Check the hits' checksums outside the lock; drop corrupted values, turning their status to MISS."""
        hits = found if None not in found else [e for e in found if e is not None]
        if not hits:
            return
        if list(map(checksum, map(_VALUE, hits))) == list(map(_CHECKSUM, hits)):
            return
        with self._lock:
            ns = self._namespaces.get(namespace_id)
            for i, entry in enumerate(found):
                if entry is None or checksum(entry.value) == entry.checksum:
                    continue
                statuses[i] = _MISS
                found[i] = None
                if ns is not None and ns.entries.get(addresses[i]) is entry:
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

    def get(self, namespace_id: str, mode_id: str, addresses: Sequence[BlockAddress]) -> list[ReadResult]:
        """Every hit's checksum is checked before its bytes leave; a failing value is dropped,
        counted in corrupted_dropped and answered as a MISS."""
        with self._lock:
            statuses, found = self._find(namespace_id, mode_id, addresses, touch=True)
        self._verify(namespace_id, addresses, statuses, found)
        return [
            ReadResult(status, entry.value if entry is not None else None)
            for status, entry in zip(statuses, found, strict=True)
        ]

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
                    1 for ns in self._namespaces.values() for address in ns.pins if address in ns.entries
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
            )

    def close(self) -> None:
        with self._lock:
            self._namespaces.clear()
            for pool in self._pools:
                pool.lru.clear()
                pool.used = 0


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
