"""The disk tier's segment files: append-only records of one tenant, dropped whole by the disk LRU.

The disk LRU works on whole segments (as CacheLib's BlockCache regions): a share over its part of
the disk capacity drops its least recently hit sealed segment, unless a record in it is held (pinned
or leased in the memory tier). A value read back is promoted to memory; if its segment is dropped
later, evicting it writes it again to the newest segment, so hot records keep moving to the head.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Mapping

from kvtag_store.backends.base import TIER_DISK, BlockKey, EventRelay
from kvtag_store.backends.memory.disk import records
from kvtag_store.backends.memory.disk.index import DiskIndex
from kvtag_store.backends.memory.disk.layout import DiskDir, create_segment, tenant_dir_name
from kvtag_store.backends.memory.disk.ports import MemorySide

log = logging.getLogger("kvtag_store.backends.memory.disk")


class Share:
    """The part of the disk capacity one memory pool's namespaces use: as the pool's part of memory."""

    __slots__ = ("budget", "used")

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.used = 0  # bytes of its records placed in segments


class Segment:
    """One <seq>.seg file. Its fields change in the memory tier's critical section; its fd is read
    (preadv) by Gets and written (pwritev) by the writer thread outside it, which is why a dropped
    segment is only unlinked at once and closed when its last reader is done."""

    __slots__ = (
        "dropped",
        "fd",
        "keys",
        "last_hit",
        "path",
        "pending",
        "readers",
        "sealed",
        "seq",
        "share",
        "size",
    )

    def __init__(self, seq: int, path: str, fd: int, size: int, share: Share, last_hit: int) -> None:
        self.seq = seq
        self.path = path
        self.fd = fd
        self.size = size  # bytes placed: written, or being written by the writer (pending)
        self.share = share  # the share whose disk budget its bytes count against
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


def read_ahead(fd: int) -> None:
    """Ask for the kernel's wider read-ahead on a segment: a request's blocks were put, and so
    written, in order, and a Get of a prefix reads them back in that order (docs/benchmarks.md)."""
    with contextlib.suppress(OSError):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)


class Segments:
    """Every segment of the tier by sequence number, the one each tenant appends to, and the LRU
    that drops whole segments to keep each share within its budget. Runs in the critical section."""

    def __init__(
        self,
        directory: DiskDir,
        memory: MemorySide,
        indexes: Mapping[str, DiskIndex],
        shares: Mapping[str | None, Share],
        groups: Mapping[str, int],
        segment_bytes: int,
        events: EventRelay,
    ) -> None:
        """`shares`: tenant -> its share (None: the share of every tenant without one of its own).
        `events`: told of each record a dropped segment takes with it."""
        self.dir = directory
        self._memory = memory
        self._indexes = indexes
        self.shares = shares
        self._groups = groups
        self._segment_bytes = segment_bytes
        self._events = events
        self.by_seq: dict[int, Segment] = {}
        self._active: dict[str, Segment] = {}  # tenant dir name -> the segment appended to
        self.to_seal: list[Segment] = []
        self.clock = 0
        self.next_seq = 1
        self.evictions = 0  # records dropped with their segments

    def share_of(self, tenant: str | None) -> Share:
        shared = self.shares[None]
        return shared if tenant is None else self.shares.get(tenant, shared)

    def tick(self) -> int:
        self.clock += 1
        return self.clock

    def segment_for(self, tenant: str | None, share: Share, size: int) -> Segment:
        """The tenant's segment with room for `size` more bytes (a new one when full). Raises OSError
        when a segment file cannot be created."""
        name = tenant_dir_name(tenant)
        segment = self._active.get(name)
        # At most 1/8 of the share's budget per segment, so its LRU always has sealed ones to drop.
        limit = min(self._segment_bytes, share.budget // 8)
        if segment is not None and not segment.dropped and (segment.size + size <= limit or not segment.size):
            return segment
        if segment is not None and not segment.dropped:
            segment.sealed = True
            self.to_seal.append(segment)
        gid = self._groups.get(tenant) if tenant is not None else None
        directory = self.dir.tenant_dir(tenant, gid)
        seq = self.next_seq
        self.next_seq += 1
        path, fd = create_segment(directory, seq, gid)
        read_ahead(fd)
        segment = Segment(seq, path, fd, 0, share, self.clock)
        self.by_seq[seq] = segment
        self._active[name] = segment
        return segment

    def make_room(self, share: Share, size: int) -> bool:
        """Drop the share's least recently hit sealed segments until `size` more bytes fit its budget."""
        candidates = sorted(
            (s for s in self.by_seq.values() if s.share is share and s.sealed and not s.pending),
            key=lambda s: s.last_hit,
        )
        for segment in candidates:
            if share.used + size <= share.budget:
                break
            self.drop(segment)
        return share.used + size <= share.budget

    def drop(self, segment: Segment) -> bool:
        """Drop a segment whole unless a record of it is held."""
        seq = segment.seq
        victims: list[tuple[str, DiskIndex, bytes, int]] = []
        for ns_id, keys in segment.keys.items():
            index = self._indexes.get(ns_id)
            if index is None:
                continue
            for key in keys:
                packed = index.get(key)
                if packed is not None and records.segment_of(packed) == seq:  # not rewritten since
                    group, raw = records.index_address(key)
                    if self._memory.held(ns_id, (group, BlockKey(raw))):
                        return False
                    victims.append((ns_id, index, key, packed))
        for ns_id, index, key, packed in victims:
            del index[key]
            group, raw = records.index_address(key)
            address = (group, BlockKey(raw))
            self._memory.dropped(ns_id, address, packed)
            self._events.removed(ns_id, index.mode_of(packed), address, TIER_DISK)
        self.evictions += len(victims)
        segment.share.used -= segment.size
        segment.dropped = True
        del self.by_seq[seq]
        try:
            os.unlink(segment.path)
        except OSError as exc:
            log.warning("disk tier: cannot remove segment %s (%s)", segment.path, exc.strerror)
        if segment.readers == 0:
            segment.release()
        return True

    def close(self) -> list[Segment]:
        """Forget every segment; the caller fsyncs and releases them."""
        segments = list(self.by_seq.values())
        self.by_seq.clear()
        self._active.clear()
        return segments
