"""Store arena mappings registered with CUDA as pinned host memory, once per mapping.

A device copy from pageable memory runs through a driver bounce buffer at a fraction of PCIe speed
and blocks the host; from registered memory it is a DMA. The arena is the store's shared-memory file
mapped into this process; kvtag finds the whole mapping around a slot in /proc/self/maps (the
client's mapping object is not part of its public API) and registers it the first time a slot of it
is copied. A mapping can be replaced by another at the same addresses (a new session's arena), so a
registration is trusted only while /proc/self/map_files shows the same file at the same range.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger("kvtag.connector")

# cudaHostRegister(address, length) -> True on success; cudaHostUnregister(address).
Register = Callable[[int, int], bool]
Unregister = Callable[[int], None]


@dataclass(frozen=True, slots=True)
class Mapping:
    """One virtual memory area of this process and the file it maps."""

    start: int
    end: int
    device: int
    inode: int

    def holds(self, address: int, length: int) -> bool:
        return self.start <= address and address + length <= self.end

    def still_mapped(self) -> bool:
        """Whether the same file is still mapped over exactly this range (one stat, no parsing)."""
        try:
            st = os.stat(f"/proc/self/map_files/{self.start:x}-{self.end:x}")
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == (self.device, self.inode)


def mapping_of(address: int) -> Mapping | None:
    """The file mapping holding `address`, from /proc/self/maps; None for anonymous memory."""
    with open("/proc/self/maps", encoding="ascii", errors="replace") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            bounds = fields[0].split("-")
            start, end = int(bounds[0], 16), int(bounds[1], 16)
            if not start <= address < end:
                continue
            inode = int(fields[4])
            if inode == 0:
                return None
            try:
                st = os.stat(f"/proc/self/map_files/{start:x}-{end:x}")
            except OSError:
                return None
            return Mapping(start, end, st.st_dev, st.st_ino)
    return None


class ArenaPins:
    """Registers each arena mapping once; thread-safe (write_slots fills slots from two threads)."""

    def __init__(self, register: Register, unregister: Unregister) -> None:
        self._register = register
        self._unregister = unregister
        self._lock = threading.Lock()
        self._pinned: list[Mapping] = []
        self._refused: list[Mapping] = []

    @property
    def pinned(self) -> list[Mapping]:
        with self._lock:
            return list(self._pinned)

    def ensure(self, address: int, length: int) -> bool:
        """True when [address, address + length) lies in a registered mapping (registering it now if
        needed); False when it cannot be (anonymous memory, a refused registration): copies then run
        from pageable memory, slower but correct."""
        with self._lock:
            for known in (*self._pinned, *self._refused):
                if known.holds(address, length):
                    if known.still_mapped():
                        return known in self._pinned
                    self._forget(known)
                    break
            mapping = mapping_of(address)
            if mapping is None or not mapping.holds(address, length):
                return False
            for stale in [m for m in self._pinned if m.start < mapping.end and mapping.start < m.end]:
                self._forget(stale)
            if self._register(mapping.start, mapping.end - mapping.start):
                self._pinned.append(mapping)
                return True
            logger.warning(
                "kvtag: registering the store arena (%d MiB) as pinned memory failed; device copies "
                "run from pageable memory",
                (mapping.end - mapping.start) >> 20,
            )
            self._refused.append(mapping)
            return False

    def release(self) -> None:
        """Unregister every mapping (at shutdown: the pages stay pinned otherwise)."""
        with self._lock:
            for mapping in list(self._pinned):
                self._forget(mapping)
            self._refused.clear()

    def _forget(self, mapping: Mapping) -> None:
        if mapping in self._pinned:
            self._pinned.remove(mapping)
            self._unregister(mapping.start)
        elif mapping in self._refused:
            self._refused.remove(mapping)
