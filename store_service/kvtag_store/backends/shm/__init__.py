"""Shared-memory arenas: the value memory of the memory backend and the staging memory of the
Mooncake backend, one per tenant, in a file same-host clients may map (anonymous memory otherwise).

files.py makes, locks and removes the arena files; faulting.py reserves and touches their pages ahead
of use (the prefault threads); arena.py carves a mapping into slots and gives idle pages back. The
layout a client reads is kvtag_proto.arena_layout.
"""

from kvtag_store.backends.shm.arena import Arena, Slot, arena_size
from kvtag_store.backends.shm.files import remove_orphans, shared_memory_room

__all__ = ["Arena", "Slot", "arena_size", "remove_orphans", "shared_memory_room"]
