"""Shared-memory staging for the Mooncake backend: arena slots Mooncake reads into and writes from.

Over Mooncake the arena is not where values live, only where they pass: a
same-host engine writes a value into a reserved slot and the commit puts it
into the cluster straight from the slot (`batch_put_from_multi_buffers`, the
arena being registered with Mooncake); a shared-memory Get reads each value
from the cluster straight into a slot (`batch_get_into_multi_buffers`), checks
it there, and hands out a reference, the slot staying pinned until the lease
that holds it is released. No value passes through a Python `bytes`.

Each slot keeps room for kvtag's value header right in front of the payload, so
the whole Mooncake object (header then payload) is one range of the slot:

    [o+24, o+128)       the value header (mooncake.format, 104 bytes)
    [o+120, o+128)      the generation word the client checks (8 bytes before the payload)
    [o+128, o+128+n)    the payload: what the client's SharedMemoryRef names

The header's last 8 bytes and the generation word share a place: while a value
is read into the slot, or sent from it, that place holds header bytes, and
`Staged.restore_generation` writes the word back before any reference to the
slot is handed out (a Get) or the slot is freed (a put). No client holds a
reference to a slot in that window; a stale one (of a slot freed and reused)
already sees a generation that is not its own, and header bytes equal to it
would still fail the digest check of its copy. One range instead of two is one
transfer slice per object instead of two (docs/benchmarks.md has what that saves).

One arena per tenant, as with the memory backend, so a client never maps
another tenant's values.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass

from kvtag_proto.arena_layout import ARENA_HEADER, EXTENT, write_generation

from kvtag_store.backends.base import BlockAddress, BlockKey
from kvtag_store.backends.mooncake.client import MooncakeClient
from kvtag_store.backends.mooncake.errors import describe
from kvtag_store.backends.mooncake.format import HEADER_BYTES
from kvtag_store.backends.shm import Arena, Slot, remove_orphans, shared_memory_room

log = logging.getLogger(__name__)

PREFIX = 128


@dataclass(frozen=True, slots=True)
class Staged:
    """A staging slot of one value: the Mooncake object is its header range, then its payload range."""

    arena: Arena
    slot: Slot
    base: int  # the arena's address in this process
    length: int  # payload bytes
    generation: int

    @property
    def header_offset(self) -> int:
        return self.payload_offset - HEADER_BYTES

    @property
    def payload_offset(self) -> int:
        return self.slot.offset + PREFIX

    def buffers(self) -> tuple[list[int], list[int]]:
        """Mooncake's (pointers, sizes) of the object: one range, the header then the payload."""
        return [self.base + self.header_offset], [HEADER_BYTES + self.length]

    def restore_generation(self) -> None:
        """Put the generation word back over the header's last 8 bytes (see the module docstring):
        once the header has been checked (a Get) or sent (a put)."""
        write_generation(self.arena.view, self.payload_offset, self.generation)

    def header(self) -> memoryview:
        return self.arena.view[self.header_offset : self.header_offset + HEADER_BYTES]

    def payload(self) -> memoryview:
        return self.arena.view[self.payload_offset : self.payload_offset + self.length]


class StagedAddress(tuple[int, BlockKey]):
    """A block address that also names the staged slot a reader holds: the service keeps the
    addresses it is given in the lease, and releasing the lease (unpin) frees exactly that slot."""

    staged: Staged

    def __new__(cls, address: BlockAddress, staged: Staged) -> StagedAddress:
        self = super().__new__(cls, address)
        self.staged = staged
        return self


class Staging:
    """Per-tenant staging arenas in `directory`, registered with the Mooncake client."""

    def __init__(
        self, client: MooncakeClient, directory: str, size_bytes: int, groups: Mapping[str, int] | None = None
    ) -> None:
        """`groups`: tenant -> gid of its arena file (--shm-group), as the memory backend's arenas."""
        remove_orphans(directory)
        self._client = client
        self._directory = directory
        self._groups = dict(groups or {})
        self._size = (ARENA_HEADER + size_bytes + EXTENT - 1) // EXTENT * EXTENT
        self.size_bytes = size_bytes
        self._lock = threading.Lock()
        self._arenas: dict[str, tuple[Arena, int] | None] = {}  # tenant -> (arena, address); None: failed
        self._tenants: dict[str, str] = {}  # namespace_id -> whose staging arena it uses
        self._generations = itertools.count(1)
        self._held: set[int] = set()  # generations of slots handed out and not freed
        self.in_use_bytes = 0

    def assign_tenant(self, namespace_id: str, tenant: str, arena: str | None = None) -> None:
        """The namespace's staging arena is `arena`'s (None: its tenant's own), but an --shm-group
        tenant's own always, as the memory backend's: arenas only for tenants the operator named."""
        key = tenant if arena is None or tenant in self._groups else arena
        with self._lock:
            self._tenants[namespace_id] = key

    def arena(self, namespace_id: str) -> Arena | None:
        """The namespace's tenant arena (created on first use), or None when it cannot be created."""
        with self._lock:
            found = self._arena_locked(self._tenants.get(namespace_id, ""))
        return found[0] if found is not None else None

    def _arena_locked(self, tenant: str) -> tuple[Arena, int] | None:
        if tenant in self._arenas:
            return self._arenas[tenant]
        made: tuple[Arena, int] | None = None
        try:
            free = shared_memory_room(self._directory)
            if free < self._size:
                raise OSError(f"it has {free} bytes free and the staging arena needs {self._size}")
            # Registered with Mooncake (register_buffer): an RDMA registration keeps the pages it
            # pinned, so free slots keep theirs too (no give-back).
            group = self._groups.get(tenant)
            arena = Arena(tenant, self._size, self._directory, group=group, give_back=False)
            holder = ctypes.c_char.from_buffer(arena.view)
            base = ctypes.addressof(holder)
            del holder  # the address stays valid while the arena is mapped
            rc = self._client.register_buffer(base, self._size)
            if rc != 0:
                arena.close()
                raise OSError(f"Mooncake refused to register it: {describe(rc)}")
            made = (arena, base)
        except OSError as exc:
            log.warning(
                "cannot create a shared-memory staging arena for Mooncake in %s (%s); clients use the "
                "inline path",
                self._directory,
                exc,
            )
        self._arenas[tenant] = made
        return made

    def allocate(self, namespace_id: str, lengths: list[int]) -> list[Staged | None]:
        """A slot per payload length, None where the arena has no room left (or cannot exist)."""
        out: list[Staged | None] = []
        with self._lock:
            found = self._arena_locked(self._tenants.get(namespace_id, ""))
            for length in lengths:
                if found is None:
                    out.append(None)
                    continue
                arena, base = found
                generation = next(self._generations)
                slot = arena.allocate(PREFIX + length, generation)
                if slot is None:
                    out.append(None)
                    continue
                write_generation(arena.view, slot.offset + PREFIX, generation)
                self._held.add(generation)
                self.in_use_bytes += slot.span
                out.append(Staged(arena, slot, base, length, generation))
        return out

    def free(self, staged: list[Staged]) -> None:
        """Return slots; one already freed (a lease released twice) is ignored."""
        with self._lock:
            for entry in staged:
                if entry.generation in self._held:
                    self._held.discard(entry.generation)
                    entry.arena.free(entry.slot)
                    self.in_use_bytes -= entry.slot.span

    @property
    def slots_in_use(self) -> int:
        with self._lock:
            return len(self._held)

    def close(self) -> None:
        with self._lock:
            arenas, self._arenas = [a for a in self._arenas.values() if a is not None], {}
        for arena, base in arenas:
            with contextlib.suppress(Exception):
                self._client.unregister_buffer(base)
            arena.close()
