"""The memory tier as the disk tier sees it: the one implementation of disk.ports.MemorySide.

The disk tier gets this object, not the backend's lock or tables: each method is one narrow question
or change about an entry, made in the critical section the disk tier enters through `critical()`.
"""

from __future__ import annotations

import threading

from kvtag_store.backends.base import BlockAddress
from kvtag_store.backends.memory.disk.ports import Unwritten
from kvtag_store.backends.memory.entries import Namespace


class MemoryPort:
    """disk.ports.MemorySide over the backend's namespaces."""

    def __init__(self, lock: threading.Lock, namespaces: dict[str, Namespace]) -> None:
        self._lock = lock
        self._namespaces = namespaces

    def critical(self) -> threading.Lock:
        return self._lock

    def pin_unwritten(self, namespace_id: str, address: BlockAddress, generation: int) -> Unwritten | None:
        ns = self._namespaces.get(namespace_id)
        entry = ns.entries.get(address) if ns is not None else None
        if ns is None or entry is None or entry.slot.generation != generation or entry.disk is not None:
            return None
        ns.pins[address] += 1
        return Unwritten(ns.tenant, entry.mode_id, entry.checksum, entry.view())

    def tenant_if_absent(self, namespace_id: str, address: BlockAddress) -> tuple[bool, str | None]:
        ns = self._namespaces.get(namespace_id)
        if ns is None or address in ns.entries:
            return False, None
        return True, ns.tenant

    def unpin(self, namespace_id: str, address: BlockAddress) -> None:
        ns = self._namespaces.get(namespace_id)
        if ns is not None:
            ns.unpin([address])

    def written(self, namespace_id: str, address: BlockAddress, mode_id: str, location: int) -> None:
        ns = self._namespaces.get(namespace_id)
        entry = ns.entries.get(address) if ns is not None else None
        if entry is not None and entry.disk is None and entry.mode_id == mode_id:
            entry.disk = location

    def held(self, namespace_id: str, address: BlockAddress) -> bool:
        ns = self._namespaces.get(namespace_id)
        return ns is not None and ns.pinned(address)

    def dropped(self, namespace_id: str, address: BlockAddress, location: int) -> None:
        ns = self._namespaces.get(namespace_id)
        entry = ns.entries.get(address) if ns is not None else None
        if entry is not None and entry.disk == location:
            entry.disk = None  # in memory only again: evicting it writes it anew

    def disk_off(self) -> None:
        for ns in self._namespaces.values():
            ns.spill = None
            for entry in ns.entries.values():
                entry.disk = None
