"""A segment file of the disk tier: append-only records of one tenant, dropped whole by the disk LRU."""

from __future__ import annotations

import contextlib
import os

from kvtag_store.backends.memory.pools import Pool


class Segment:
    """One <seq>.seg file. Its fields change under the backend's lock; its fd is read (preadv) by Gets
    and written (pwritev) by the writer thread outside it, which is why a dropped segment is only
    unlinked at once and closed when its last reader is done."""

    __slots__ = (
        "dropped",
        "fd",
        "keys",
        "last_hit",
        "path",
        "pending",
        "pool",
        "readers",
        "sealed",
        "seq",
        "size",
    )

    def __init__(self, seq: int, path: str, fd: int, size: int, pool: Pool, last_hit: int) -> None:
        self.seq = seq
        self.path = path
        self.fd = fd
        self.size = size  # bytes placed: written, or being written by the writer (pending)
        self.pool = pool  # the pool whose disk budget its bytes count against
        self.last_hit = last_hit  # the tier's clock at its last write or read back
        self.readers = 0  # Gets reading from it outside the lock
        self.pending = False  # the writer has records placed in it that it has not written yet
        self.sealed = False  # full (or found at start-up): no more appends; fsynced when sealed
        self.dropped = False
        # namespace_id -> the index keys of its records here (the very bytes objects the index holds,
        # so 8 bytes a record): dropping the segment visits its own records, not the whole index.
        self.keys: dict[str, list[bytes]] = {}

    def release(self) -> None:
        """The last use of a dropped segment is over: close its fd."""
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = -1
