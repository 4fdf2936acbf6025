"""Reading records back for a Get: find a block's record, hold its segment while it is read outside
the lock, read header and value with one preadv straight into the caller's buffer, check both.

The memory tier drives a read-back (which slot, which entry, which pins); this is the disk's half.
Records of one Get are read side by side on a few threads: preadv and xxh3 release the GIL, the
device sees a queue, and hashing overlaps reading.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

from kvtag_store.backends.base import TIER_DISK, BlockAddress, EventRelay
from kvtag_store.backends.memory.disk import records
from kvtag_store.backends.memory.disk.index import DiskIndex
from kvtag_store.backends.memory.disk.records import TornRecord, decode_meta, index_key, value_digest
from kvtag_store.backends.memory.disk.segments import Segment, Segments

log = logging.getLogger("kvtag_store.backends.memory.disk")

READ_THREADS = 4


class Located(NamedTuple):
    """A record found for a Get; once held, its segment stays open until `RecordReads.finish`."""

    address: BlockAddress
    key: bytes
    packed: int
    where: records.Location
    segment: Segment


class RecordReads:
    """The disk half of read-backs. `locate`, `hold` and `finish` run in the critical section; `read`
    outside it."""

    def __init__(self, segments: Segments, events: EventRelay) -> None:
        """`events`: told of each record dropped for failing its checks."""
        self._segments = segments
        self._events = events
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self.reads_back = 0
        self.corrupted = 0

    def locate(self, index: DiskIndex, mode_id: str, address: BlockAddress) -> Located | None:
        """The address's record in `mode_id`, or None when there is none."""
        number = index.modes.get(mode_id)
        if number is None:
            return None
        key = index_key(address[0], address[1])
        packed = index.get(key)
        if packed is None or records.mode_number_of(packed) != number:
            return None
        where = records.unpack_location(packed)
        segment = self._segments.by_seq.get(where.segment)
        if segment is None:
            return None
        return Located(address, key, packed, where, segment)

    def hold(self, found: Located) -> None:
        """Keep the record's segment open while it is read outside the critical section."""
        found.segment.readers += 1

    def read(
        self, namespace_id: str, mode_id: str, jobs: Sequence[tuple[Located, memoryview]]
    ) -> tuple[list[int | None], tuple[str, OSError] | None]:
        """Read each record's value into its view: its digest when whole and intact, else None; and
        the first I/O error met (the tier is turned off for it), after which nothing more is read."""
        failures: list[tuple[str, OSError]] = []

        def read_one(job: tuple[Located, memoryview]) -> int | None:
            found, view = job
            if failures:
                return None
            meta = bytearray(found.where.meta)
            try:
                got = os.preadv(found.segment.fd, [meta, view], found.where.offset)
            except OSError as exc:
                failures.append((found.segment.path, exc))
                return None
            return _verified(meta, view, got, namespace_id, mode_id, found.address, found.where)

        outcomes = list(self._threads().map(read_one, jobs)) if len(jobs) > 1 else [read_one(jobs[0])]
        return outcomes, failures[0] if failures else None

    def finish(
        self, namespace_id: str, index: DiskIndex, found: Located, ok: bool, count_failure: bool
    ) -> bool:
        """Release the record's segment after its read. A good read counts and marks the segment hit;
        returns whether the record is still on disk (its segment not dropped meanwhile). A failed one
        is dropped from the index when `count_failure` (a damaged record, not a failing disk)."""
        segment = found.segment
        segment.readers -= 1
        if segment.dropped and segment.readers == 0:
            segment.release()
        if ok:
            self.reads_back += 1
            segment.last_hit = self._segments.tick()
            return not segment.dropped
        if count_failure and index.get(found.key) == found.packed:
            del index[found.key]
            self._events.removed(namespace_id, index.mode_of(found.packed), found.address, TIER_DISK)
            self.corrupted += 1
            log.warning(
                "disk tier: a record in %s failed its checks; dropped (the engine recomputes it)",
                segment.path,
            )
        return False

    def _threads(self) -> ThreadPoolExecutor:
        """The threads a Get's read-backs run on, started at the first Get that needs them."""
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="kvtag-disk-read")
            return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


def _verified(
    meta: bytearray,
    value: memoryview,
    got: int,
    namespace_id: str,
    mode_id: str,
    address: BlockAddress,
    where: records.Location,
) -> int | None:
    """The value digest when the bytes read are the whole record the index expects, intact."""
    if got != where.meta + where.value_length:
        return None
    try:
        record = decode_meta(meta)
    except TornRecord:
        return None
    if (
        record.namespace_id != namespace_id
        or record.mode_id != mode_id
        or record.group != address[0]
        or record.key != address[1]
        or record.value_length != len(value)
    ):
        return None
    return record.value_digest if value_digest(value) == record.value_digest else None
