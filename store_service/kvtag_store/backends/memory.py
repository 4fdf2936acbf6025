"""The embedded default backend: tagged values in process memory, LRU-evicted, checksummed.

What counts as used bytes: the length of each stored value, exactly. Keys,
tags, checksums and index overhead are not counted (they are small and
bounded by the key count).
"""

from __future__ import annotations

import threading
import zlib
from collections import OrderedDict
from collections.abc import Sequence

from kvtag_store.backends.base import (
    BackendStats,
    BlockAddress,
    KeyStatus,
    ProbeRecord,
    PutOutcome,
    PutResult,
    ReadResult,
)

_HIT = KeyStatus.HIT
_MISS = KeyStatus.MISS
_MISMATCH = KeyStatus.MODE_MISMATCH


def checksum(value: bytes) -> int:
    """CRC-32 (zlib): about 5 GiB/s here and releases the GIL on large buffers."""
    return zlib.crc32(value)


class _Entry:
    """One stored block. A slotted class, not a dataclass: millions may exist."""

    __slots__ = ("checksum", "mode_id", "pins", "value")

    def __init__(self, mode_id: str, value: bytes, crc: int) -> None:
        self.mode_id = mode_id
        self.value = value
        self.checksum = crc
        self.pins = 0


class _Namespace:
    """The blocks of one namespace plus the LRU order of its unpinned ones."""

    __slots__ = ("entries", "lru", "used_bytes")

    def __init__(self) -> None:
        self.entries: dict[BlockAddress, _Entry] = {}
        # Unpinned entries only, least recently used first; value = last-use tick.
        # Pinned entries leave this order, so eviction never has to skip them.
        self.lru: OrderedDict[BlockAddress, int] = OrderedDict()
        self.used_bytes = 0


class MemoryBackend:
    """A BlockBackend in process memory. One lock guards the index; checksums run outside it."""

    name = "memory"

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError("capacity must be positive")
        self._capacity = capacity_bytes
        self._lock = threading.Lock()
        self._namespaces: dict[str, _Namespace] = {}
        self._used = 0
        self._pinned_bytes = 0
        self._pinned_keys = 0
        self._keys = 0
        self._evictions = 0
        self._corrupted = 0
        self._tick = 0

    @property
    def max_value_bytes(self) -> int:
        return self._capacity

    # -- writes -------------------------------------------------------------

    def put(self, namespace_id: str, mode_id: str, address: BlockAddress, value: bytes) -> PutResult:
        size = len(value)
        if size > self._capacity:
            return PutResult(
                PutOutcome.REJECTED,
                f"value of {size} bytes exceeds the store capacity of {self._capacity} bytes; "
                "raise --capacity or store smaller blocks",
            )
        crc = checksum(value)
        with self._lock:
            ns = self._namespaces.get(namespace_id)
            if ns is None:
                ns = self._namespaces[namespace_id] = _Namespace()
            existing = ns.entries.get(address)
            if existing is not None:
                if existing.mode_id != mode_id:
                    return PutResult(PutOutcome.CONFLICT, f"key is held by mode {existing.mode_id}")
                self._touch(ns, address, existing)
                return PutResult(PutOutcome.ALREADY_PRESENT)
            if self._capacity - self._pinned_bytes < size:
                return PutResult(
                    PutOutcome.REJECTED,
                    f"store full of leased blocks: {self._pinned_bytes} of {self._capacity} bytes are "
                    "leased; release leases (Get with lease_id, ReleaseLeases) or raise --capacity",
                )
            while self._used + size > self._capacity:
                self._evict_one()
            ns.entries[address] = _Entry(mode_id, value, crc)
            self._tick += 1
            ns.lru[address] = self._tick
            ns.used_bytes += size
            self._used += size
            self._keys += 1
            return PutResult(PutOutcome.STORED)

    def _evict_one(self) -> None:
        """Drop the least recently used unpinned block of any namespace. Caller holds the lock."""
        oldest_ns: _Namespace | None = None
        oldest_tick = -1
        for ns in self._namespaces.values():
            if ns.lru:
                tick = next(iter(ns.lru.values()))
                if oldest_ns is None or tick < oldest_tick:
                    oldest_ns, oldest_tick = ns, tick
        if oldest_ns is None:  # unreachable: put checks pinned bytes first
            raise RuntimeError("no evictable block although capacity is not pinned")
        address, _ = oldest_ns.lru.popitem(last=False)
        self._remove(oldest_ns, address, oldest_ns.entries[address])
        self._evictions += 1

    def _remove(self, ns: _Namespace, address: BlockAddress, entry: _Entry) -> None:
        del ns.entries[address]
        ns.lru.pop(address, None)
        size = len(entry.value)
        ns.used_bytes -= size
        self._used -= size
        self._keys -= 1
        if entry.pins:
            self._pinned_bytes -= size
            self._pinned_keys -= 1

    def _touch(self, ns: _Namespace, address: BlockAddress, entry: _Entry) -> None:
        self._tick += 1
        if entry.pins == 0:
            ns.lru[address] = self._tick
            ns.lru.move_to_end(address)

    # -- reads --------------------------------------------------------------

    def _candidates(
        self, namespace_id: str, mode_id: str, addresses: Sequence[BlockAddress]
    ) -> tuple[list[KeyStatus], list[tuple[int, _Entry]]]:
        """Statuses by tag alone, and the same-mode entries still to verify. Caller holds the lock."""
        ns = self._namespaces.get(namespace_id)
        if ns is None:
            return [_MISS] * len(addresses), []
        entries = ns.entries
        statuses: list[KeyStatus] = []
        hits: list[tuple[int, _Entry]] = []
        for i, address in enumerate(addresses):
            entry = entries.get(address)
            if entry is None:
                statuses.append(_MISS)
            elif entry.mode_id != mode_id:
                statuses.append(_MISMATCH)
            else:
                statuses.append(_HIT)
                hits.append((i, entry))
        return statuses, hits

    def _verify(
        self,
        namespace_id: str,
        addresses: Sequence[BlockAddress],
        statuses: list[KeyStatus],
        hits: list[tuple[int, _Entry]],
    ) -> None:
        """Check every hit's checksum (outside the lock); drop corrupted values and touch the good ones."""
        bad = [i for i, entry in hits if checksum(entry.value) != entry.checksum]
        with self._lock:
            ns = self._namespaces.get(namespace_id)
            if ns is None:
                return
            for i in bad:
                statuses[i] = _MISS
                entry = ns.entries.get(addresses[i])
                if entry is not None and checksum(entry.value) != entry.checksum:
                    self._remove(ns, addresses[i], entry)
                    self._corrupted += 1
            for i, entry in hits:
                if statuses[i] is _HIT and ns.entries.get(addresses[i]) is entry:
                    self._touch(ns, addresses[i], entry)

    def lookup(self, namespace_id: str, mode_id: str, addresses: Sequence[BlockAddress]) -> list[KeyStatus]:
        with self._lock:
            statuses, hits = self._candidates(namespace_id, mode_id, addresses)
        if hits:
            self._verify(namespace_id, addresses, statuses, hits)
        return statuses

    def get(self, namespace_id: str, mode_id: str, addresses: Sequence[BlockAddress]) -> list[ReadResult]:
        with self._lock:
            statuses, hits = self._candidates(namespace_id, mode_id, addresses)
        if hits:
            self._verify(namespace_id, addresses, statuses, hits)
        values = {i: entry.value for i, entry in hits}
        return [
            ReadResult(status, values[i] if status is _HIT else None) for i, status in enumerate(statuses)
        ]

    # -- leases -------------------------------------------------------------

    def pin(self, namespace_id: str, addresses: Sequence[BlockAddress]) -> None:
        with self._lock:
            ns = self._namespaces.get(namespace_id)
            if ns is None:
                return
            for address in addresses:
                entry = ns.entries.get(address)
                if entry is None:
                    continue
                entry.pins += 1
                if entry.pins == 1:
                    ns.lru.pop(address, None)
                    self._pinned_bytes += len(entry.value)
                    self._pinned_keys += 1

    def unpin(self, namespace_id: str, addresses: Sequence[BlockAddress]) -> None:
        with self._lock:
            ns = self._namespaces.get(namespace_id)
            if ns is None:
                return
            for address in addresses:
                entry = ns.entries.get(address)
                if entry is None or entry.pins == 0:
                    continue
                entry.pins -= 1
                if entry.pins == 0:
                    self._tick += 1
                    ns.lru[address] = self._tick
                    self._pinned_bytes -= len(entry.value)
                    self._pinned_keys -= 1

    # -- reporting ----------------------------------------------------------

    def stats(self) -> BackendStats:
        with self._lock:
            return BackendStats(
                backend=self.name,
                capacity_bytes=self._capacity,
                used_bytes=self._used,
                keys=self._keys,
                evictions=self._evictions,
                leased_keys=self._pinned_keys,
                corrupted_dropped=self._corrupted,
                per_namespace={
                    ns_id: (len(ns.entries), ns.used_bytes)
                    for ns_id, ns in self._namespaces.items()
                    if ns.entries
                },
            )

    def close(self) -> None:
        with self._lock:
            self._namespaces.clear()
            self._used = self._keys = self._pinned_bytes = self._pinned_keys = 0


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
