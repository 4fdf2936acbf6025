"""The memory backend's second tier: values kept in segment files, found again after a restart.

Write policy: write-behind with a bounded lag. An insert appends (namespace, address, slot
generation, length) to `queue` under the backend's lock; one writer thread pins the entry, writes
header and value straight from the arena with os.pwritev (no Python copy, GIL released), then records
where it went. Puts never wait for the disk, and while they keep coming the writer stays out of their
way (the page-cache copy competes with them for the cores): it writes once puts pause for QUIET_S,
or at once when the unwritten values pass half the memory capacity, the oldest has waited MAX_LAG_S,
or evictions are already copying unwritten values (an entry evicted before it was written has its
bytes copied into the queue, up to 1/8 of the memory capacity pending; past that it is dropped,
`spill_dropped`). A sustained put load therefore writes through in the background.

What a crash loses: a SIGKILL loses the queued, unwritten tail only (the kernel keeps what was
written): at most MAX_LAG_S of puts or half the memory capacity, whichever is less, plus a batch in
flight. SIGTERM writes everything first. A host crash also loses what the kernel had not flushed:
segments are fsynced when sealed and at close. A record torn either way fails its checks at start-up
or at read and is never served.

The disk LRU works on whole segments (as CacheLib's BlockCache regions): a pool over its share of
the disk capacity drops its least recently hit sealed segment, unless a record in it is pinned. A
value read back is promoted to memory; if its segment is dropped later, evicting it writes it again
to the newest segment, so hot records keep moving to the head.

Promotion: a value read back always becomes a memory entry (already on disk, so evicting it again
is free). Both Get paths need its bytes in a slot anyway (the shared-memory reader copies from the
slot, the inline reply is built from it), so promoting costs nothing beyond that slot, and a block
read once is likely read again (a shared prefix).

What it costs (rebuild per record, memory per index entry, read-back and put rates with the tier on
and off) is measured by benchmarks/disk_tier.py; the figures are in docs/benchmarks.md and
docs/disk-tier.md.

Faults: any OSError writing or reading the tier turns the tier off (one warning, counted, degraded
with the reason); the store then serves from memory only.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, NamedTuple, TypeVar, cast

from kvtag_store.backends.base import BlockAddress, BlockKey, PutResult, TierUsage
from kvtag_store.backends.disk import records
from kvtag_store.backends.disk.errors import DiskDirError
from kvtag_store.backends.disk.layout import DiskDir, create_segment, tenant_dir_name
from kvtag_store.backends.disk.records import ShortBuffer, TornRecord, decode_meta, encode_meta, index_key
from kvtag_store.backends.disk.segments import Segment
from kvtag_store.backends.memory.entries import STORED, Entry, checksum
from kvtag_store.backends.memory.pools import Pool
from kvtag_store.backends.shm.arena import Slot

if TYPE_CHECKING:
    from kvtag_store.backends.memory.entries import Namespace

log = logging.getLogger("kvtag_store.backends.disk.tier")

SEGMENT_BYTES = 64 << 20
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
# Records of one Get read back side by side (the device sees a queue; hashing overlaps reading).
READ_THREADS = 4
# At start-up a header plus names is read with one pread of this much after a large value (more only
# for long names), and a chunk of many records after a small one.
_SCAN_READ = 512
_SCAN_CHUNK = 64 << 10
_SMALL_VALUE = 8 << 10


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


T = TypeVar("T")


@dataclass
class ReadBack(Generic[T]):
    """What read_back did for one Get: `trusted`, ids of the entries it inserted (verified just now, the
    Get need not hash them again); `held`, addresses it pinned for the reader (unpin them once the
    reader pinned its own); `around`, address -> (target handle, digest) of values read around a full
    memory; `failed`, around targets whose record failed (the caller frees them)."""

    trusted: set[int]
    held: list[BlockAddress]
    around: dict[BlockAddress, tuple[T, int]]
    failed: list[T] = field(default_factory=list)


class _ReadJob(NamedTuple):
    address: BlockAddress
    key: bytes
    packed: int
    where: records.Location
    segment: Segment
    view: memoryview  # where the value is read to
    slot: Slot | None  # a new entry's slot, None when read around memory
    handle: object  # the around target's handle (None for a slot)


class _Job(NamedTuple):
    ns: Namespace
    address: BlockAddress
    mode_id: str
    digest: int
    value: memoryview | bytes
    entry: Entry | None  # the memory entry written from (pinned meanwhile), None for a spilled copy


class DiskTier:
    """Segment files under a locked directory, an index per namespace (`Namespace.disk`), one writer."""

    def __init__(
        self,
        path: str,
        capacity: int,
        *,
        lock: threading.Lock,
        namespaces: dict[str, Namespace],
        mode_numbers: dict[str, int],
        memory_capacity: int,
        pools: Sequence[Pool],
        tenant_pools: Mapping[str, Pool],
        shared: Pool,
        groups: Mapping[str, int],
        namespace: Callable[[str, str | None], Namespace],
        segment_bytes: int = SEGMENT_BYTES,
    ) -> None:
        """`lock`, `namespaces`, `mode_numbers` and the pools are the backend's own. `namespace(id,
        tenant)` makes a namespace for a record found at start-up (caller holds the lock).
        Raises DiskDirError when the directory cannot be used."""
        if capacity <= 0:
            raise DiskDirError(
                path, "the disk capacity must be positive with a disk dir; set --disk-capacity"
            )
        self.dir = DiskDir(path)
        self.path = self.dir.path
        self.capacity = capacity
        self._lock = lock
        self._namespaces = namespaces
        self._mode_numbers = mode_numbers
        self._memory_capacity = memory_capacity
        self._pools = pools
        self._tenant_pools = tenant_pools
        self._shared = shared
        self._groups = dict(groups)
        self._segment_bytes = segment_bytes
        self._spill_limit = memory_capacity // 8
        self._batch_bytes = max(1, min(_BATCH_BYTES, memory_capacity // 16))
        self.queue = WriteQueue()
        self._lag_bytes = memory_capacity // 2
        self._last_put = 0.0
        self._flush = 0  # drain() callers waiting: no lag
        self._pending_copies = 0  # bytes of evicted values waiting in the queue
        self._segments: dict[int, Segment] = {}
        self._active: dict[str, Segment] = {}  # tenant dir name -> the segment appended to
        self._to_seal: list[Segment] = []
        self._clock = 0
        self.spills = 0
        self.spill_dropped = 0
        self.reads_back = 0
        self.corrupted = 0
        self.evictions = 0
        self.failures = 0
        self.degraded = False
        self.degraded_reason = ""
        self.restored: dict[str, tuple[str | None, frozenset[str]]] = {}
        self.rebuild_seconds = 0.0
        self.rebuilt_records = 0
        start = time.perf_counter()
        try:
            with lock:
                self._rebuild(namespace)
        except BaseException:
            self.dir.release()  # a store that failed to start must not keep the directory locked
            raise
        self.rebuild_seconds = time.perf_counter() - start
        self._next_seq = max(self._segments, default=0) + 1
        self._wakeup = threading.Event()
        self._stopping = False
        self._busy = False
        self._read_pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._writer = threading.Thread(target=self._run, name="kvtag-disk-writer", daemon=True)
        self._writer.start()

    # -- start-up -------------------------------------------------------------

    def _rebuild(self, namespace: Callable[[str, str | None], Namespace]) -> None:
        """Rebuild every namespace's index from the segments' headers; a torn tail is truncated off
        and counted. Values are not read or hashed: after a value over _SMALL_VALUE the next header
        is read alone; small values share the pages of the headers around them, so those are read
        in chunks. Caller holds the lock."""
        modes: dict[str, set[str]] = {}
        tenants: dict[str, str | None] = {}
        numbers = self._mode_numbers
        namespaces = self._namespaces
        for seq, path in self.dir.segments():
            try:
                fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
                size = os.fstat(fd).st_size
            except OSError as exc:
                log.warning("disk tier: cannot open segment %s (%s); it is skipped", path, exc.strerror)
                continue
            offset = 0
            pool: Pool | None = None
            held: dict[str, list[bytes]] = {}
            pread = os.pread
            unreadable: OSError | None = None
            # Headers are parsed out of chunks read ahead: one pread serves many small records, and
            # a large record's header costs a small pread of its own (its value is skipped).
            chunk, chunk_at, chunk_size = b"", 0, _SCAN_READ
            while offset < size:
                try:
                    try:
                        record = decode_meta(chunk, offset - chunk_at)
                    except ShortBuffer as short:
                        chunk = pread(fd, max(chunk_size, short.length), offset)
                        chunk_at = offset
                        try:
                            record = decode_meta(chunk)
                        except ShortBuffer as longer:  # names longer than the first read held
                            chunk = pread(fd, longer.length, offset)
                            record = decode_meta(chunk)  # short now: the file ends inside it (torn)
                except (TornRecord, ShortBuffer):
                    break
                except OSError as exc:  # not torn, unreadable: keep the file, serve what was found
                    unreadable = exc
                    break
                chunk_size = _SCAN_CHUNK if record.value_length <= _SMALL_VALUE else _SCAN_READ
                end = offset + record.meta_length + record.value_length
                if end > size:
                    break
                ns_id = record.namespace_id
                ns = namespaces.get(ns_id)
                if ns is None:
                    ns = namespace(ns_id, record.tenant)
                    tenants[ns_id] = record.tenant
                    modes[ns_id] = set()
                number = numbers.get(record.mode_id)
                if number is None:
                    number = numbers[record.mode_id] = len(numbers)
                if number > records.MAX_MODE_NUMBER:
                    offset = end
                    continue
                modes[ns_id].add(record.mode_id)
                key = index_key(record.group, record.key)
                ns.disk[key] = records.location(seq, offset, record.meta_length, record.value_length, number)
                keys = held.get(ns_id)
                if keys is None:
                    keys = held[ns_id] = []
                keys.append(key)
                if pool is None:
                    pool = ns.pool
                self.rebuilt_records += 1
                offset = end
            if unreadable is not None:
                log.warning(
                    "disk tier: cannot read segment %s past byte %d (%s); its later records are not served",
                    path,
                    offset,
                    unreadable.strerror,
                )
                self.failures += 1
                offset = size  # counted as used; the file is left as it is
            elif offset < size:
                self.corrupted += 1
                log.warning(
                    "disk tier: segment %s has a torn or damaged record at byte %d; truncated there",
                    path,
                    offset,
                )
                try:
                    os.ftruncate(fd, offset)
                except OSError as exc:
                    log.warning("disk tier: cannot truncate %s (%s)", path, exc.strerror)
            if offset == 0:
                os.close(fd)
                try:
                    os.unlink(path)
                except OSError as exc:
                    log.warning("disk tier: cannot remove empty segment %s (%s)", path, exc.strerror)
                continue
            pool = pool or self._shared
            self._clock += 1
            _read_ahead(fd)
            segment = Segment(seq, path, fd, offset, pool, self._clock)
            segment.keys = held
            segment.sealed = True
            pool.disk_used += offset
            self._segments[seq] = segment
        self.restored = {ns_id: (tenants[ns_id], frozenset(modes[ns_id])) for ns_id in modes}

    # -- the write path --------------------------------------------------------

    def wake(self) -> None:
        """A put inserted values: the writer takes them once puts pause (or the lag is used up)."""
        self._last_put = time.monotonic()
        self._wakeup.set()

    def spill_evicted(self, ns: Namespace, address: BlockAddress, entry: Entry) -> None:
        """An entry not yet on disk is being evicted: queue a copy of its bytes (bounded). Caller holds
        the lock."""
        if self.degraded:
            return
        length = entry.slot.length
        if self._pending_copies + length > self._spill_limit:
            self.spill_dropped += 1
            return
        self._pending_copies += length
        self.queue.append((ns.namespace_id, address, entry.mode_id, entry.checksum, bytes(entry.view())))

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

    def _lagging(self) -> bool:
        """Whether to leave the queue to the puts a little longer (write-behind, bounded)."""
        queue = self.queue
        if not queue or self._flush or self._stopping or self._pending_copies:
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
                self._degrade("writer", self.path, OSError(errno.EIO, "internal error in the writer"))
            finally:
                self._busy = False
            if self._stopping and (self.degraded or not self.queue):
                return

    def _take_jobs(self) -> list[_Job]:
        """The next batch from the queue, entries pinned. Caller holds the lock."""
        jobs: list[_Job] = []
        total = 0
        queue = self.queue
        namespaces = self._namespaces
        taken: set[tuple[str, BlockAddress]] = set()  # an address queued twice is written once
        while queue and len(jobs) < _BATCH_RECORDS and total < self._batch_bytes:
            item = queue.popleft()
            if len(item) == 5:
                self._pending_copies -= len(item[4])
            if (item[0], item[1]) in taken:
                continue
            if len(item) == 4:
                ns_id, address, generation, length = item
                queue.unwritten -= length
                ns = namespaces.get(ns_id)
                entry = ns.entries.get(address) if ns is not None else None
                if entry is None or entry.slot.generation != generation or entry.disk is not None:
                    continue
                ns.pins[address] += 1  # type: ignore[union-attr]
                jobs.append(_Job(ns, address, entry.mode_id, entry.checksum, entry.view(), entry))  # type: ignore[arg-type]
                total += entry.slot.length
            else:
                ns_id, address, mode_id, digest, value = item
                ns = namespaces.get(ns_id)
                if ns is None or address in ns.entries:
                    continue
                jobs.append(_Job(ns, address, mode_id, digest, value, None))
                total += len(value)
            taken.add((ns_id, address))  # only once a job is made: a skipped reference leaves it to its copy
        return jobs

    def _write_batch(self) -> bool:
        """Write one batch; False when the queue is empty (or the tier is off)."""
        with self._lock:
            if self.degraded:
                self.queue.clear()
                self._pending_copies = 0
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
        sealing, self._to_seal = self._to_seal, []
        for segment in sealing:
            if failure is None:
                try:
                    os.fsync(segment.fd)
                except OSError as exc:
                    failure = (segment.path, exc)
        with self._lock:
            for job in jobs:
                if job.entry is not None:
                    job.ns.unpin([job.address])
            for n, (segment, _, items) in enumerate(placed):
                segment.pending = False
                if n >= written or self.degraded:
                    continue
                held = segment.keys
                for job, _, _, packed in items:
                    key = index_key(job.address[0], job.address[1])
                    job.ns.disk[key] = packed
                    keys = held.get(job.ns.namespace_id)
                    if keys is None:
                        keys = held[job.ns.namespace_id] = []
                    keys.append(key)
                    entry = job.ns.entries.get(job.address)
                    if entry is not None and entry.disk is None and entry.mode_id == job.mode_id:
                        entry.disk = packed
                    self.spills += 1
        if failure is not None:
            self._degrade("write", *failure)
            return False
        return True

    def _place(self, jobs: list[_Job]) -> list[tuple[Segment, int, list[tuple[_Job, bytes, Any, int]]]]:
        """Where each record goes: its tenant's active segment, rolled when full, within its pool's
        disk budget (dropping least recently hit segments). Caller holds the lock."""
        runs: dict[int, tuple[Segment, int, list[tuple[_Job, bytes, Any, int]]]] = {}
        numbers = self._mode_numbers
        for job in jobs:
            ns = job.ns
            number = numbers.get(job.mode_id)
            if number is None:
                number = numbers[job.mode_id] = len(numbers)
            if number > records.MAX_MODE_NUMBER or len(job.value) > records.MAX_VALUE:
                self.spill_dropped += 1
                continue
            meta = encode_meta(
                ns.namespace_id,
                ns.tenant,
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
            pool = ns.pool
            if pool.disk_used + size > self._budget(pool) and not self._make_room(pool, size):
                self.spill_dropped += 1
                continue
            try:
                segment = self._segment_for(ns.tenant, pool, size)
            except OSError as exc:
                self._to_seal.clear()
                self.failures += 1
                self._turn_off(f"create segment in {self.path}: {exc.strerror}")
                log.warning(
                    "disk tier turned off, serving from memory only: cannot create a segment in %s (%s)",
                    self.path,
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
            pool.disk_used += size
            self._clock += 1
            segment.last_hit = self._clock
        return list(runs.values())

    def _segment_for(self, tenant: str | None, pool: Pool, size: int) -> Segment:
        """The tenant's segment with room for `size` more bytes. Caller holds the lock."""
        name = tenant_dir_name(tenant)
        segment = self._active.get(name)
        # At most 1/8 of the pool's budget per segment, so its LRU always has sealed ones to drop.
        limit = min(self._segment_bytes, self._budget(pool) // 8)
        if segment is not None and not segment.dropped and (segment.size + size <= limit or not segment.size):
            return segment
        if segment is not None and not segment.dropped:
            segment.sealed = True
            self._to_seal.append(segment)
        gid = self._groups.get(tenant) if tenant is not None else None
        directory = self.dir.tenant_dir(tenant, gid)
        seq = self._next_seq
        self._next_seq += 1
        path, fd = create_segment(directory, seq, gid)
        _read_ahead(fd)
        segment = Segment(seq, path, fd, 0, pool, self._clock)
        self._segments[seq] = segment
        self._active[name] = segment
        return segment

    def _budget(self, pool: Pool) -> int:
        """The pool's share of the disk capacity: as its share of the memory capacity."""
        return self.capacity * pool.capacity // self._memory_capacity

    def _make_room(self, pool: Pool, size: int) -> bool:
        """Drop the pool's least recently hit sealed segments until `size` more bytes fit in its budget.
        Caller holds the lock."""
        budget = self._budget(pool)
        candidates = sorted(
            (s for s in self._segments.values() if s.pool is pool and s.sealed and not s.pending),
            key=lambda s: s.last_hit,
        )
        for segment in candidates:
            if pool.disk_used + size <= budget:
                break
            self._drop_segment(segment)
        return pool.disk_used + size <= budget

    def _drop_segment(self, segment: Segment) -> bool:
        """Drop a segment whole unless a record of it is pinned. Caller holds the lock."""
        seq = segment.seq
        victims: list[tuple[Namespace, bytes, int]] = []
        for ns_id, keys in segment.keys.items():
            ns = self._namespaces.get(ns_id)
            if ns is None:
                continue
            disk = ns.disk
            for key in keys:
                packed = disk.get(key)
                if packed is not None and records.segment_of(packed) == seq:  # not rewritten since
                    group, raw = records.index_address(key)
                    if ns.pinned((group, BlockKey(raw))):
                        return False
                    victims.append((ns, key, packed))
        for ns, key, packed in victims:
            del ns.disk[key]
            group, raw = records.index_address(key)
            entry = ns.entries.get((group, BlockKey(raw)))
            if entry is not None and entry.disk == packed:
                entry.disk = None  # in memory only again: evicting it writes it anew
        self.evictions += len(victims)
        segment.pool.disk_used -= segment.size
        segment.dropped = True
        del self._segments[seq]
        try:
            os.unlink(segment.path)
        except OSError as exc:
            log.warning("disk tier: cannot remove segment %s (%s)", segment.path, exc.strerror)
        if segment.readers == 0:
            segment.release()
        return True

    # -- the read path ---------------------------------------------------------

    def read_back(
        self,
        namespace_id: str,
        mode_id: str,
        addresses: Sequence[BlockAddress],
        allocate: Callable[..., Any],
        around: Callable[[Namespace, int], tuple[T, memoryview] | None],
    ) -> ReadBack[T]:
        """Promote the addresses held on disk only (in this mode) into memory: a slot each
        (`allocate(ns, size)`, evicting as needed), the value preadv'd straight into it, checked
        against its header, inserted as an entry already on disk. When memory has no room (what is
        left is pinned by reads, or leased and not on disk), the value is read around it, into
        `around(ns, size)`'s target (a handle and its writable view; None: a MISS for this Get), so a
        block a Lookup leased loads whatever other leases hold. A failing record is dropped and
        counted; an I/O error turns the tier off.

        This Get's memory hits and the entries it inserts are returned pinned (`held`), so neither this
        Get's allocations nor another's evict them before the reader pins them: unpin `held` once it
        has."""
        back: ReadBack[T] = ReadBack(set(), [], {})
        with self._lock:
            ns = self._namespaces.get(namespace_id)
            if ns is None or not ns.disk or self.degraded:
                return back
            number = self._mode_numbers.get(mode_id)
            if number is None:
                return back
            jobs: list[_ReadJob] = []
            entries, disk, segments = ns.entries, ns.disk, self._segments
            lru, ns_id = ns.pool.lru, ns.namespace_id
            wanted: list[BlockAddress] = []
            for address in addresses:
                held = entries.get(address)
                if held is not None:  # this Get's memory hits: pinned, so its read-backs evict others
                    if held.mode_id == mode_id:
                        lru.move_to_end((ns_id, address))
                        back.held.append(address)
                    continue
                wanted.append(address)
            ns.pins.update(back.held)
            arena = ns.arena
            seen: set[BlockAddress] = set()
            for address in wanted:
                if address in seen:
                    continue
                seen.add(address)
                key = index_key(address[0], address[1])
                packed = disk.get(key)
                if packed is None or records.mode_number_of(packed) != number:
                    continue
                where = records.unpack_location(packed)
                segment = segments.get(where.segment)
                if segment is None:
                    continue
                slot = allocate(ns, where.value_length)
                if isinstance(slot, Slot):
                    view = arena.view[slot.offset : slot.offset + slot.length]
                    jobs.append(_ReadJob(address, key, packed, where, segment, view, slot, None))
                else:
                    target = around(ns, where.value_length)
                    if target is None:
                        continue  # no room at all: a MISS for this Get
                    jobs.append(_ReadJob(address, key, packed, where, segment, target[1], None, target[0]))
                segment.readers += 1
            if not jobs:
                return back
            ns.writers += 1
        failures: list[tuple[str, OSError]] = []

        def read(job: _ReadJob) -> int | None:
            """The value's digest once read into its target and verified, None when it failed. preadv
            and xxh3 release the GIL: a Get's records are read and checked side by side."""
            if failures:
                return None
            meta = bytearray(job.where.meta)
            try:
                got = os.preadv(job.segment.fd, [meta, job.view], job.where.offset)
            except OSError as exc:
                failures.append((job.segment.path, exc))
                return None
            return _verified(meta, job.view, got, namespace_id, mode_id, job.address, job.where)

        outcomes = list(self._readers().map(read, jobs)) if len(jobs) > 1 else [read(jobs[0])]
        failure = failures[0] if failures else None
        with self._lock:
            ns.writers -= 1
            for job, digest in zip(jobs, outcomes, strict=True):
                segment = job.segment
                segment.readers -= 1
                if segment.dropped and segment.readers == 0:
                    segment.release()
                if digest is not None:
                    self.reads_back += 1
                    self._clock += 1
                    segment.last_hit = self._clock
                    if job.slot is None:
                        back.around[job.address] = (cast(T, job.handle), digest)
                        continue
                    # A segment dropped while it was read: the value is in memory only again.
                    on_disk = None if segment.dropped else job.packed
                    result: PutResult = ns.insert(mode_id, job.address, job.slot, digest, on_disk)
                    if result is STORED:
                        back.trusted.add(id(ns.entries[job.address]))
                    if job.address in ns.entries:
                        ns.pins[job.address] += 1
                        back.held.append(job.address)
                    continue
                if job.slot is not None:
                    arena.free(job.slot)
                    ns.pool.reserved -= job.slot.length
                else:
                    back.failed.append(cast(T, job.handle))
                if failure is None and ns.disk.get(job.key) == job.packed:
                    del ns.disk[job.key]
                    self.corrupted += 1
                    log.warning(
                        "disk tier: a record in %s failed its checks; dropped (the engine recomputes it)",
                        segment.path,
                    )
        if failure is not None:
            self._degrade("read", *failure)
        return back

    def _readers(self) -> ThreadPoolExecutor:
        """The threads a Get's read-backs run on, started at the first Get that needs them."""
        with self._pool_lock:
            if self._read_pool is None:
                self._read_pool = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="kvtag-disk-read")
            return self._read_pool

    # -- faults, reports, close --------------------------------------------------

    def _degrade(self, operation: str, path: str, exc: OSError) -> None:
        with self._lock:
            if self.degraded:
                return
            self.failures += 1
            reason = f"{operation} {path}: {exc.strerror or exc}"
            self._turn_off(reason)
        log.warning(
            "disk tier turned off, serving from memory only: %s failed (%s); fix the disk and restart the "
            "store to use it again",
            operation + " " + path,
            exc.strerror or exc,
        )

    def _turn_off(self, reason: str) -> None:
        """Stop using the disk: memory only from now on (the files stay for the next start). Caller
        holds the lock."""
        self.degraded = True
        self.degraded_reason = reason
        self.queue.clear()
        self._pending_copies = 0
        for ns in self._namespaces.values():
            ns.disk = {}
            ns.spill = None
            for entry in ns.entries.values():
                entry.disk = None

    def usage(self) -> TierUsage:
        """The disk row of the backend's stats. Caller holds the lock."""
        namespaces = self._namespaces.values()
        return TierUsage(
            tier="disk",
            used_bytes=sum(pool.disk_used for pool in self._pools),
            capacity_bytes=self.capacity,
            keys=sum(len(ns.disk) for ns in namespaces),
            hits=sum(ns.disk_hit_count for ns in namespaces),
            spills=self.spills,
            reads_back=self.reads_back,
            corrupted_dropped=self.corrupted,
            evictions=self.evictions,
            failures=self.failures,
            degraded=self.degraded,
            degraded_reason=self.degraded_reason,
        )

    def close(self) -> None:
        """Drain the writer (the caller queued what is only in memory), fsync, release the directory."""
        self._stopping = True
        self._wakeup.set()
        self._writer.join()
        if self._read_pool is not None:
            self._read_pool.shutdown(wait=True)
        with self._lock:
            segments = list(self._segments.values())
            self._segments.clear()
            self._active.clear()
        for segment in segments:
            if not self.degraded and not segment.sealed:
                try:
                    os.fsync(segment.fd)
                except OSError as exc:
                    log.warning("disk tier: fsync of %s failed at close (%s)", segment.path, exc.strerror)
            segment.release()
        self.dir.release()


def _read_ahead(fd: int) -> None:
    """Ask for the kernel's wider read-ahead on a segment: a request's blocks were put, and so
    written, in order, and a Get of a prefix reads them back in that order (docs/benchmarks.md)."""
    with contextlib.suppress(OSError):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)


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
    return record.value_digest if checksum(value) == record.value_digest else None
