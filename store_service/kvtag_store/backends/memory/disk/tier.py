"""The disk tier as the memory tier holds it: one object over its parts, behind ports.MemorySide.

Promotion: a value read back always becomes a memory entry (already on disk, so evicting it again is
free). Both Get paths need its bytes in a slot anyway (the shared-memory reader copies from the slot,
the inline reply is built from it), so promoting costs nothing beyond that slot, and a block read
once is likely read again (a shared prefix). The memory tier drives it (memory/promotion.py) with
the record reads of reads.py.

Faults: any OSError writing or reading the tier turns the tier off (one warning, counted, degraded
with the reason); the store then serves from memory only. What it costs is measured by
benchmarks/disk_tier.py (docs/benchmarks.md, docs/disk-tier.md).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping

from kvtag_store.backends.base import TIER_DISK, BlockAddress, EventRelay, TierUsage
from kvtag_store.backends.memory.disk.errors import DiskDirError
from kvtag_store.backends.memory.disk.index import DiskIndex
from kvtag_store.backends.memory.disk.layout import DiskDir
from kvtag_store.backends.memory.disk.ports import MemorySide
from kvtag_store.backends.memory.disk.reads import RecordReads
from kvtag_store.backends.memory.disk.rebuild import rebuild
from kvtag_store.backends.memory.disk.segments import Segments, Share
from kvtag_store.backends.memory.disk.writer import WriteQueue, Writer

log = logging.getLogger("kvtag_store.backends.memory.disk")

SEGMENT_BYTES = 64 << 20


class DiskTier:
    """Segment files under a locked directory, an index per namespace, one writer, the record reads."""

    def __init__(
        self,
        path: str,
        capacity: int,
        memory: MemorySide,
        *,
        memory_capacity: int,
        pool_capacities: Mapping[str | None, int],
        groups: Mapping[str, int],
        events: EventRelay,
        segment_bytes: int = SEGMENT_BYTES,
    ) -> None:
        """`pool_capacities`: the memory tier's pools, tenant -> bytes (None: the pool of every tenant
        without a quota); each gets the same part of `capacity`. `events`: told of every record written
        and dropped (KV events; the memory backend's relay). Raises DiskDirError when the
        directory cannot be used. Rebuilds the indexes from the files before it returns."""
        if capacity <= 0:
            raise DiskDirError(
                path, "the disk capacity must be positive with a disk dir; set --disk-capacity"
            )
        self.dir = DiskDir(path)
        self.path = self.dir.path
        self.capacity = capacity
        self._memory = memory
        self._events = events
        self._modes: dict[str, int] = {}  # mode_id -> its number in the packed locations
        self._indexes: dict[str, DiskIndex] = {}
        shares = {
            tenant: Share(capacity * pool // memory_capacity) for tenant, pool in pool_capacities.items()
        }
        self._segments = Segments(
            self.dir, memory, self._indexes, shares, dict(groups), segment_bytes, self._events
        )
        self.reads = RecordReads(self._segments, self._events)
        self._writer = Writer(
            memory,
            self._segments,
            self.index,
            self._modes,
            memory_capacity,
            self._degrade,
            self._turn_off,
            self._events,
        )
        self.degraded = False
        self.degraded_reason = ""
        self._failures = 0
        self._corrupted_at_start = 0
        start = time.perf_counter()
        try:
            found = rebuild(self._segments, self._indexes, self._modes)
        except BaseException:
            self.dir.release()  # a store that failed to start must not keep the directory locked
            raise
        self.rebuild_seconds = time.perf_counter() - start
        self.rebuilt_records = found.records
        self._corrupted_at_start = found.corrupted
        self._failures = found.failures
        self.restored: dict[str, tuple[str | None, frozenset[str]]] = found.restored
        self._writer.start()

    # -- what the memory tier calls, in its critical section ---------------------

    def index(self, namespace_id: str) -> DiskIndex:
        """The namespace's disk index (created empty on first use): the memory tier keeps it beside the
        namespace and answers its misses from it."""
        index = self._indexes.get(namespace_id)
        if index is None:
            index = self._indexes[namespace_id] = DiskIndex(self._modes)
        return index

    def forget(self, namespace_id: str) -> None:
        """The memory tier forgot the namespace (it held nothing here either)."""
        index = self._indexes.get(namespace_id)
        if index is not None and not index:
            del self._indexes[namespace_id]

    @property
    def queue(self) -> WriteQueue:
        """Where an insert queues its value for the writer (Namespace.spill)."""
        return self._writer.queue

    def spill_evicted(
        self, namespace_id: str, address: BlockAddress, mode_id: str, digest: int, value: memoryview
    ) -> None:
        """An entry not yet on disk is being evicted: queue a copy of its bytes (bounded)."""
        self._writer.spill_evicted(namespace_id, address, mode_id, digest, value)

    def wake(self) -> None:
        self._writer.wake()

    def drain(self, timeout: float = 10.0) -> bool:
        """Wait until everything queued so far is written (or the tier is off); False on timeout."""
        return self._writer.drain(timeout)

    @property
    def spill_dropped(self) -> int:
        return self._writer.spill_dropped

    def degrade(self, operation: str, path: str, exc: OSError) -> None:
        """An I/O error: turn the tier off (called outside the critical section)."""
        self._degrade(operation, path, exc)

    # -- faults, reports, close --------------------------------------------------

    def _degrade(self, operation: str, path: str, exc: OSError) -> None:
        with self._memory.critical():
            if self.degraded:
                return
            self._failures += 1
            self._turn_off(f"{operation} {path}: {exc.strerror or exc}")
        log.warning(
            "disk tier turned off, serving from memory only: %s failed (%s); fix the disk and restart the "
            "store to use it again",
            operation + " " + path,
            exc.strerror or exc,
        )

    def _turn_off(self, reason: str) -> None:
        """Stop using the disk: memory only from now on (the files stay for the next start). Runs in
        the critical section."""
        self.degraded = True
        self.degraded_reason = reason
        self._writer.degraded = True
        self._writer.queue.clear()
        self._writer.pending_copies = 0
        for namespace_id, index in self._indexes.items():
            self._events.removed_each(namespace_id, index.records(), TIER_DISK)
            index.clear()
        self._memory.disk_off()

    def usage(self) -> TierUsage:
        """The disk row of the backend's stats. Runs in the critical section."""
        indexes = self._indexes.values()
        return TierUsage(
            tier="disk",
            used_bytes=sum(share.used for share in self._segments.shares.values()),
            capacity_bytes=self.capacity,
            keys=sum(len(index) for index in indexes),
            hits=sum(index.hits for index in indexes),
            spills=self._writer.spills,
            reads_back=self.reads.reads_back,
            corrupted_dropped=self._corrupted_at_start + self.reads.corrupted,
            evictions=self._segments.evictions,
            failures=self._failures + self._writer.failures,
            degraded=self.degraded,
            degraded_reason=self.degraded_reason,
        )

    def close(self) -> None:
        """Drain the writer (the caller queued what is only in memory), fsync, release the directory."""
        self._writer.stop()
        self.reads.close()
        with self._memory.critical():
            segments = self._segments.close()
        for segment in segments:
            if not self.degraded and not segment.sealed:
                try:
                    os.fsync(segment.fd)
                except OSError as exc:
                    log.warning("disk tier: fsync of %s failed at close (%s)", segment.path, exc.strerror)
            segment.release()
        self.dir.release()
