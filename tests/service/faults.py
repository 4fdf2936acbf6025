"""Injected faults: the one place tests reach inside the memory backend."""

from __future__ import annotations

from kvtag_store.backends.base import BlockAddress
from kvtag_store.backends.memory import MemoryBackend


def corrupt_memory_value(backend: MemoryBackend, namespace_id: str, address: BlockAddress) -> None:
    """Flip one bit of a stored value without touching its checksum, as a memory fault would."""
    entry = backend._namespaces[namespace_id].entries[address]
    damaged = bytearray(entry.value)
    damaged[len(damaged) // 2] ^= 0x01
    entry.value = bytes(damaged)
