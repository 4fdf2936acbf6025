"""A client's mapping of the store's shared-memory arena: bounds-checked slot views and generation checks.

The service owns the arena (a file it created, e.g. under /dev/shm) and hands out slots; this side only
maps it, proves it did (the nonce), writes reserved slots and copies out of referenced ones. A slot's
generation word sits in the 8 bytes before its value and changes whenever the service hands the slot
out again, so a reader that sees the same word after its copy as in the reference copied bytes that
were not reused meanwhile (x86-64 keeps loads in order; the service writes the word before handing
the slot to a writer).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
import time

import xxhash
from kvtag.v1 import store_pb2 as pb
from kvtag_proto import pages
from kvtag_proto.arena_layout import EXTENT, FIRST_VALUE, SLOT_HEADER, read_generation

# The service reserves arena pages in extents of EXTENT; a slot's extents are all reserved, so mapping
# them whole here never allocates memory the service did not.
_EXTENT = EXTENT
# How long the follower below keeps watching the arena's faulted word once it stops growing.
_FOLLOW_IDLE_S = 5.0

# The store's checksum of a slot's value (CommitSlotsRequest.xxh3_64, GetReference.xxh3_64). It
# releases the GIL.
value_digest = xxhash.xxh3_64_intdigest


class UnusableOffer(Exception):
    """The offered arena cannot be mapped here (another host, no shared /dev/shm, permissions)."""


class ArenaMapping:
    """The mapped arena of one offer. Thread-safe for disjoint slots (each call touches its own)."""

    def __init__(self, offer: pb.SharedMemoryOffer) -> None:
        if not offer.path or offer.size_bytes <= FIRST_VALUE:
            raise UnusableOffer("the offer names no arena file")
        try:
            fd = os.open(offer.path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            raise UnusableOffer(f"cannot open {offer.path}: {exc.strerror}") from exc
        try:
            size = os.fstat(fd).st_size
            if size < offer.size_bytes:
                raise UnusableOffer(f"{offer.path} holds {size} bytes, the offer says {offer.size_bytes}")
            self._mmap = mmap.mmap(fd, offer.size_bytes, flags=mmap.MAP_SHARED)
        except OSError as exc:
            raise UnusableOffer(f"cannot map {offer.path}: {exc}") from exc
        finally:
            os.close(fd)
        self.segment = offer.segment
        self.size = offer.size_bytes
        self.view = memoryview(self._mmap)
        self._base = pages.base_address(self._mmap)
        end = offer.nonce_offset + offer.nonce_length
        if offer.nonce_length == 0 or end > self.size:
            raise UnusableOffer("the offer's nonce lies outside the arena")
        self.nonce = bytes(self.view[offer.nonce_offset : end])
        self._populated: set[int] = set()
        self._extents = -(-self.size // _EXTENT)
        self._populate = True
        self._closed = threading.Event()
        # Map what the service has touched into this process's page tables in the background, so a
        # put or get here does not pay the first access per page.
        threading.Thread(target=self._follow, name="kvtag-arena-map", daemon=True).start()

    def close(self) -> None:
        """Stop the background mapping; the mapping itself lives as long as views of it do."""
        self._closed.set()

    def _follow(self) -> None:
        """Map extents as the service publishes them (the faulted word), one at a time (each madvise
        releases the GIL); ends when the arena is covered or the word stopped growing."""
        done = 0
        quiet_since = time.monotonic()
        while not self._closed.is_set() and self._populate:
            faulted = min(self.size, pages.faulted(self._mmap))
            if faulted <= done:
                if done >= self.size or time.monotonic() - quiet_since > _FOLLOW_IDLE_S:
                    return
                self._closed.wait(0.05)
                continue
            for extent in range(done // _EXTENT, faulted // _EXTENT):
                if self._closed.is_set():
                    return
                self._map_extents(extent * _EXTENT, (extent + 1) * _EXTENT)
            done = faulted // _EXTENT * _EXTENT
            quiet_since = time.monotonic()

    def slot(self, segment: str, offset: int, length: int) -> memoryview:
        """The value bytes a reference names; ValueError when it does not lie inside this arena."""
        end = offset + length
        if segment != self.segment or offset < FIRST_VALUE or end > self.size:
            raise ValueError(f"reference outside the mapped arena: {segment} [{offset}, {end})")
        if self._populate:
            self._map_extents(offset - SLOT_HEADER, end)
        return self.view[offset:end]

    def _map_extents(self, start: int, end: int) -> None:
        """Map the extents of [start, end) into this process once each, ahead of the copy."""
        for extent in range(start // _EXTENT, (end - 1) // _EXTENT + 1):
            if extent in self._populated:
                continue
            base = extent * _EXTENT
            try:
                pages.populate_write(self._base, base, min(_EXTENT, self.size - base))
            except OSError:
                self._populate = False  # the kernel lacks it: first touches fault page by page
                return
            self._populated.add(extent)
        if len(self._populated) >= self._extents:
            self._populate = False  # all mapped: slot() has nothing left to check

    def current(self, offset: int, generation: int) -> bool:
        """True while the slot at `offset` still holds the generation its reference was issued for."""
        return read_generation(self._mmap, offset) == generation


# Slots at least this large are copied into with the GIL released (copy_into), and a put or get of such
# slots is split over two threads (DigestThread.in_halves): below it, handing work over costs more than
# it saves (docs/benchmarks.md, "Figures behind choices in the code").
LARGE_SLOT_BYTES = 256 << 10


def copy_into(slot: memoryview, value: bytes) -> None:
    """slot[:] = value, but a large `bytes` value is copied by ctypes.memmove, which releases the GIL:
    the other half of a put (SharedPuts.write_slots) then runs on another core meanwhile."""
    if type(value) is bytes and len(value) == slot.nbytes and len(value) >= LARGE_SLOT_BYTES:
        holder = ctypes.c_char.from_buffer(slot)
        try:
            ctypes.memmove(ctypes.addressof(holder), value, len(value))
        finally:
            del holder  # releases its export of the slot
        return
    slot[:] = value
