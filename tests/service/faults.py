"""Injected faults: the one place tests reach inside the memory backend."""

from __future__ import annotations

from kvtag_store.backends.base import BlockAddress
from kvtag_store.backends.memory import MemoryBackend


def flip_memory_bit(backend: MemoryBackend, namespace_id: str, address: BlockAddress, position: int) -> None:
    """Flip one bit of a stored value in its arena slot without touching its checksum, as a memory
    fault (or a stray write through a shared mapping) would."""
    entry = backend._namespaces[namespace_id].entries[address]
    view = entry.view()
    view[position] ^= 0x80


def corrupt_memory_value(backend: MemoryBackend, namespace_id: str, address: BlockAddress) -> None:
    """Flip one bit in the middle of a stored value."""
    entry = backend._namespaces[namespace_id].entries[address]
    flip_memory_bit(backend, namespace_id, address, entry.slot.length // 2)
