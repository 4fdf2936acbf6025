"""The disk tier's writer: write-behind with a bounded lag, one niced thread.

An insert appends (namespace, address, slot generation, length) to the queue in the memory tier's
critical section; the writer pins the entry, writes header and value straight from the arena with
os.pwritev (no Python copy, GIL released), then records where it went. Puts never wait for the disk,
and while they keep coming the writer stays out of their way (the page-cache copy competes with them
for the cores): it writes once puts pause for QUIET_S, or at once when the unwritten values pass half
the memory capacity, the oldest has waited MAX_LAG_S, or evictions are already copying unwritten
values (an entry evicted before it was written has its bytes copied into the queue, up to 1/8 of the
memory capacity pending; past that it is dropped, `spill_dropped`). A sustained put load therefore
writes through in the background.

What a crash loses: a SIGKILL loses the queued, unwritten tail only (the kernel keeps what was
written): at most MAX_LAG_S of puts or half the memory capacity, whichever is less, plus a batch in
flight. SIGTERM writes everything first. A host crash also loses what the kernel had not flushed:
segments are fsynced when sealed and at close. A record torn either way fails its checks at start-up
or at read and is never served.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, NamedTuple

from kvtag_store.backends.base import TIER_DISK, BlockAddress, EventRelay
from kvtag_store.backends.memory.disk import records
from kvtag_store.backends.memory.disk.index import DiskIndex
from kvtag_store.backends.memory.disk.ports import MemorySide
from kvtag_store.backends.memory.disk.records import encode_meta, index_key
from kvtag_store.backends.memory.disk.segments import Segment, Segments

log = logging.getLogger("kvtag_store.backends.memory.disk")

# One writer batch: at most this many records, and this many bytes (or 1/16 of the memory capacity,
# if smaller: the batch's entries are pinned while written).
_BATCH_RECORDS = 256
_BATCH_BYTES = 16 << 20
_IOV_MAX = 1024
# Niced enough that puts and Gets win the CPU on a busy host, not so much that a sustained put load
# starves it (nice 5 weighs about a third of nice 0 in the kernel's fair scheduler).
WRITER_NICE = 5
# Write-behind: puts run alone until they pause this long, unless the unwritten values pass half the
# memory capacity or the oldest has waited MAX_LAG_S (what a SIGKILL can lose).
QUIET_S = 0.02
MAX_LAG_S = 1.0


class WriteQueue(deque[tuple[Any, ...]]):
    """The writer's queue: references (namespace_id, address, generation, length) to inserted values,
    and copies (namespace_id, address, mode_id, digest, bytes) of values evicted before they were
    written. Counts the referenced bytes and when it last went from empty to not, for the lag."""

    def __init__(self) -> None:
        super().__init__()
        self.unwritten = 0
        self.since = 0.0

    def append(self, item: tuple[Any, ...]) -> None:
        if not self:
            self.since = time.monotonic()
        super().append(item)
        if len(item) == 4:
            self.unwritten += item[3]

    def clear(self) -> None:
        super().clear()
        self.unwritten = 0


class _Job(NamedTuple):
    namespace_id: str
    tenant: str | None
    address: BlockAddress
    mode_id: str
    digest: int
    value: memoryview | bytes
    pinned: bool  # written from a pinned memory entry (unpin after), else a spilled copy


_Placed = list[tuple[Segment, int, list[tuple[_Job, bytes, Any, int]]]]


class Writer:
    """The queue and the thread that drains it into segments."""

    def __init__(
        self,
        memory: MemorySide,
        segments: Segments,
        index_of: Callable[[str], DiskIndex],
        modes: dict[str, int],
        memory_capacity: int,
        faults: Callable[[str, str, OSError], None],
        turn_off: Callable[[str], None],
        events: EventRelay,
    ) -> None:
        """`faults(operation, path, error)` turns the tier off for an I/O error (it enters the critical
        section itself); `turn_off(reason)` does it from inside. `events`: told of each record written."""
        self._memory = memory
        self._segments = segments
        self._index_of = index_of
        self._modes = modes
        self._fault = faults
        self._turn_off = turn_off
        self._events = events
        self.queue = WriteQueue()
        self._spill_limit = memory_capacity // 8
        self._batch_bytes = max(1, min(_BATCH_BYTES, memory_capacity // 16))
        self._lag_bytes = memory_capacity // 2
        self._last_put = 0.0
        self._flush = 0  # drain() callers waiting: no lag
        self.pending_copies = 0  # bytes of evicted values waiting in the queue
        self.spills = 0
        self.spill_dropped = 0
        self.failures = 0
        self.degraded = False
        self._wakeup = threading.Event()
        self._stopping = False
        self._busy = False
        self._thread = threading.Thread(target=self._run, name="kvtag-disk-writer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def wake(self) -> None:
        """A put inserted values: the writer takes them once puts pause (or the lag is used up)."""
        self._last_put = time.monotonic()
        self._wakeup.set()

    def spill_evicted(
        self, namespace_id: str, address: BlockAddress, mode_id: str, digest: int, value: memoryview
    ) -> None:
        """An entry not yet on disk is being evicted: queue a copy of its bytes (bounded). Runs in the
        critical section."""
        if self.degraded:
            return
        length = len(value)
        if self.pending_copies + length > self._spill_limit:
            self.spill_dropped += 1
            return
        self.pending_copies += length
        self.queue.append((namespace_id, address, mode_id, digest, bytes(value)))

    def drain(self, timeout: float = 10.0) -> bool:
        """Wait until everything queued so far is written (or the tier is off); False on timeout. For
        tests, benchmarks and close: puts never call it."""
        deadline = time.monotonic() + timeout
        self._flush += 1
        try:
            while self.queue or self._busy:
                if self.degraded or time.monotonic() > deadline:
                    return self.degraded
                self._wakeup.set()
                time.sleep(0.002)
            return True
        finally:
            self._flush -= 1

    def stop(self) -> None:
        """Write what is queued (unless the tier is off), then end the thread."""
        self._stopping = True
        self._wakeup.set()
        self._thread.join()

    def _lagging(self) -> bool:
        """Whether to leave the queue to the puts a little longer (write-behind, bounded)."""
        queue = self.queue
        if not queue or self._flush or self._stopping or self.pending_copies:
            return False
        now = time.monotonic()
        return (
            now - self._last_put < QUIET_S
            and queue.unwritten < self._lag_bytes
            and now - queue.since < MAX_LAG_S
        )

    def _run(self) -> None:
        # The writer runs niced: puts and Gets get the CPU first (on a busy host the copy into the page
        # cache is what a disk write costs); the bounded spill queue is what a long burst can overrun.
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
        while True:
            self._wakeup.wait(0.05)
            self._wakeup.clear()
            try:
                # Once it starts, the writer catches up on the whole queue (a sustained load keeps it
                # writing beside the puts: write-through in the background).
                self._busy = True
                if not self._lagging():
                    while self._write_batch():
                        pass
            except Exception:  # a bug must not kill the writer silently: turn the tier off instead
                log.exception("disk tier: writer failed")
                self._fault(
                    "writer", self._segments.dir.path, OSError(errno.EIO, "internal error in the writer")
                )
            finally:
                self._busy = False
            if self._stopping and (self.degraded or not self.queue):
                return

    def _take_jobs(self) -> list[_Job]:
        """The next batch from the queue, entries pinned. Runs in the critical section."""
        jobs: list[_Job] = []
        total = 0
        queue = self.queue
        memory = self._memory
        taken: set[tuple[str, BlockAddress]] = set()  # an address queued twice is written once
        while queue and len(jobs) < _BATCH_RECORDS and total < self._batch_bytes:
            item = queue.popleft()
            if len(item) == 5:
                self.pending_copies -= len(item[4])
            if (item[0], item[1]) in taken:
                continue
            if len(item) == 4:
                ns_id, address, generation, length = item
                queue.unwritten -= length
                unwritten = memory.pin_unwritten(ns_id, address, generation)
                if unwritten is None:
                    continue
                tenant, mode_id, digest, value = unwritten
                jobs.append(_Job(ns_id, tenant, address, mode_id, digest, value, True))
                total += len(value)
            else:
                ns_id, address, mode_id, digest, value = item
                absent, tenant = memory.tenant_if_absent(ns_id, address)
                if not absent:
                    continue
                jobs.append(_Job(ns_id, tenant, address, mode_id, digest, value, False))
                total += len(value)
            taken.add((ns_id, address))  # only once a job is made: a skipped reference leaves it to its copy
        return jobs

    def _write_batch(self) -> bool:
        """Write one batch; False when the queue is empty (or the tier is off)."""
        with self._memory.critical():
            if self.degraded:
                self.queue.clear()
                self.pending_copies = 0
                return False
            jobs = self._take_jobs()
            if not jobs:
                return False
            placed = self._place(jobs)
        failure: tuple[str, OSError] | None = None
        written = 0
        for segment, start, items in placed:
            try:
                _write_all(segment.fd, [part for _, meta, value, _ in items for part in (meta, value)], start)
            except OSError as exc:
                failure = (segment.path, exc)
                break
            written += 1
        sealing, self._segments.to_seal = self._segments.to_seal, []
        for segment in sealing:
            if failure is None:
                try:
                    os.fsync(segment.fd)
                except OSError as exc:
                    failure = (segment.path, exc)
        with self._memory.critical():
            self._publish(jobs, placed, written)
        if failure is not None:
            self._fault("write", *failure)
            return False
        return True

    def _publish(self, jobs: list[_Job], placed: _Placed, written: int) -> None:
        """Unpin the batch's entries and index the records written whole. Runs in the critical section."""
        memory = self._memory
        for job in jobs:
            if job.pinned:
                memory.unpin(job.namespace_id, job.address)
        for n, (segment, _, items) in enumerate(placed):
            segment.pending = False
            if n >= written or self.degraded:
                continue
            held = segment.keys
            for job, _, _, packed in items:
                key = index_key(job.address[0], job.address[1])
                self._index_of(job.namespace_id)[key] = packed
                keys = held.get(job.namespace_id)
                if keys is None:
                    keys = held[job.namespace_id] = []
                keys.append(key)
                memory.written(job.namespace_id, job.address, job.mode_id, packed)
                self._events.stored(job.namespace_id, job.mode_id, job.address, TIER_DISK)
                self.spills += 1

    def _place(self, jobs: list[_Job]) -> _Placed:
        """Where each record goes: its tenant's active segment, rolled when full, within its share of
        the disk (dropping least recently hit segments). Runs in the critical section."""
        runs: dict[int, tuple[Segment, int, list[tuple[_Job, bytes, Any, int]]]] = {}
        numbers = self._modes
        segments = self._segments
        for job in jobs:
            number = numbers.get(job.mode_id)
            if number is None:
                number = numbers[job.mode_id] = len(numbers)
            if number > records.MAX_MODE_NUMBER or len(job.value) > records.MAX_VALUE:
                self.spill_dropped += 1
                continue
            meta = encode_meta(
                job.namespace_id,
                job.tenant,
                job.mode_id,
                job.address[0],
                job.address[1],
                len(job.value),
                job.digest,
            )
            if len(meta) > records.MAX_META:  # names longer than a rebuild would trust: kept in memory only
                self.spill_dropped += 1
                continue
            size = len(meta) + len(job.value)
            share = segments.share_of(job.tenant)
            if share.used + size > share.budget and not segments.make_room(share, size):
                self.spill_dropped += 1
                continue
            try:
                segment = segments.segment_for(job.tenant, share, size)
            except OSError as exc:
                segments.to_seal.clear()
                self.failures += 1
                self._turn_off(f"create segment in {segments.dir.path}: {exc.strerror}")
                log.warning(
                    "disk tier turned off, serving from memory only: cannot create a segment in %s (%s)",
                    segments.dir.path,
                    exc.strerror,
                )
                break
            run = runs.get(segment.seq)
            if run is None:  # a segment's records of one batch are contiguous: only _place appends
                run = runs[segment.seq] = (segment, segment.size, [])
            packed = records.location(segment.seq, segment.size, len(meta), len(job.value), number)
            run[2].append((job, meta, job.value, packed))
            segment.size += size
            segment.pending = True
            share.used += size
            segment.last_hit = segments.tick()
        return list(runs.values())


def _write_all(fd: int, parts: list[Any], offset: int) -> None:
    """pwritev every part at `offset`, resuming after short writes, IOV_MAX parts at a time."""
    views = [memoryview(p).cast("B") for p in parts]
    i = 0
    while i < len(views):
        chunk = views[i : i + _IOV_MAX]
        want = sum(len(v) for v in chunk)
        done = os.pwritev(fd, chunk, offset)
        offset += done
        if done == want:
            i += len(chunk)
            continue
        if done == 0:
            raise OSError(errno.EIO, "write made no progress")
        # Skip the parts written whole, trim the one written in part.
        while done >= len(views[i]):
            done -= len(views[i])
            i += 1
        views[i] = views[i][done:]
