"""Mapping a shared-memory range's pages ahead of use, without holding the GIL.

Both the service (prefaulting its arenas) and the client (mapping them into its own page tables) do
this in a background thread while other threads serve calls or run an engine. `mmap.madvise` keeps
the GIL for the whole call (about a millisecond per 2 MiB here), so every other thread of the process
waits; the same madvise(2) through ctypes releases it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import struct

# madvise(MADV_POPULATE_WRITE): map a range writable in one call instead of a fault per page (Linux 5.14).
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
# madvise(MADV_REMOVE): free a shared range and its backing store (a hole punched in a tmpfs file).
MADV_REMOVE = getattr(mmap, "MADV_REMOVE", 9)

# The arena header's faulted word: bytes from the arena's start whose pages the service has reserved
# and touched (u64 little-endian), written by the service after each extent, read by clients.
FAULTED_OFFSET = 32
_FAULTED = struct.Struct("<Q")

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_madvise = _libc.madvise
_madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_madvise.restype = ctypes.c_int


def base_address(memory: mmap.mmap) -> int:
    """The address of a writable mapping's first byte (stable while the mapping is open)."""
    anchor = ctypes.c_char.from_buffer(memory)
    try:
        return ctypes.addressof(anchor)
    finally:
        del anchor  # releases the buffer export, so the mapping can still be closed


def populate_write(base: int, start: int, length: int) -> None:
    """MADV_POPULATE_WRITE over [start, start+length) of the mapping at `base` (page-aligned start),
    with the GIL released. Raises OSError as madvise(2) fails (EINVAL: the kernel lacks it)."""
    if _madvise(base + start, length, MADV_POPULATE_WRITE) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))


def remove_pages(base: int, start: int, length: int) -> bool:
    """MADV_REMOVE over [start, start+length) of the shared mapping at `base` (page-aligned), with the
    GIL released. False when the kernel refuses (the pages then stay, which is only memory kept)."""
    return int(_madvise(base + start, length, MADV_REMOVE)) == 0


def publish_faulted(memory: mmap.mmap, end: int) -> None:
    _FAULTED.pack_into(memory, FAULTED_OFFSET, end)


def faulted(memory: mmap.mmap | memoryview) -> int:
    """The touched prefix the arena header publishes (a mapping or a view over one)."""
    value: int = _FAULTED.unpack_from(memory, FAULTED_OFFSET)[0]
    return value


__all__ = [
    "FAULTED_OFFSET",
    "MADV_POPULATE_WRITE",
    "MADV_REMOVE",
    "base_address",
    "faulted",
    "populate_write",
    "publish_faulted",
    "remove_pages",
]
