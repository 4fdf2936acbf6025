"""The disk index rebuilt from the segment files at start-up: record headers only, values unread.

After a value over _SMALL_VALUE the next header is read alone; small values share the pages of the
headers around them, so those are read in chunks. A torn tail is truncated off and counted; a file
that cannot be read past some byte keeps what was found before it.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

from kvtag_store.backends.memory.disk import records
from kvtag_store.backends.memory.disk.index import DiskIndex
from kvtag_store.backends.memory.disk.records import ShortBuffer, TornRecord, decode_meta, index_key
from kvtag_store.backends.memory.disk.segments import Segment, Segments, Share, read_ahead

log = logging.getLogger("kvtag_store.backends.memory.disk")

# A header plus names is read with one pread of this much after a large value (more only for long
# names), and a chunk of many records after a small one.
_SCAN_READ = 512
_SCAN_CHUNK = 64 << 10
_SMALL_VALUE = 8 << 10


@dataclass
class Rebuilt:
    """What the rebuild found: namespace_id -> (tenant, mode_ids) and the counts it reports."""

    restored: dict[str, tuple[str | None, frozenset[str]]] = field(default_factory=dict)
    records: int = 0
    corrupted: int = 0
    failures: int = 0


def rebuild(segments: Segments, indexes: dict[str, DiskIndex], modes: dict[str, int]) -> Rebuilt:
    """Fill `indexes` (namespace_id -> its index, created as found), `modes` and `segments` from
    the files of the tier's directory."""
    found = Rebuilt()
    namespace_modes: dict[str, set[str]] = {}
    tenants: dict[str, str | None] = {}
    for seq, path in segments.dir.segments():
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
            size = os.fstat(fd).st_size
        except OSError as exc:
            log.warning("disk tier: cannot open segment %s (%s); it is skipped", path, exc.strerror)
            continue
        offset = 0
        share: Share | None = None
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
            index = indexes.get(ns_id)
            if index is None:
                index = indexes[ns_id] = DiskIndex(modes)
            if ns_id not in tenants:
                tenants[ns_id] = record.tenant
                namespace_modes[ns_id] = set()
            number = modes.get(record.mode_id)
            if number is None:
                number = modes[record.mode_id] = len(modes)
            if number > records.MAX_MODE_NUMBER:
                offset = end
                continue
            namespace_modes[ns_id].add(record.mode_id)
            key = index_key(record.group, record.key)
            index[key] = records.location(seq, offset, record.meta_length, record.value_length, number)
            keys = held.get(ns_id)
            if keys is None:
                keys = held[ns_id] = []
            keys.append(key)
            if share is None:
                share = segments.share_of(tenants[ns_id])
            found.records += 1
            offset = end
        if unreadable is not None:
            log.warning(
                "disk tier: cannot read segment %s past byte %d (%s); its later records are not served",
                path,
                offset,
                unreadable.strerror,
            )
            found.failures += 1
            offset = size  # counted as used; the file is left as it is
        elif offset < size:
            found.corrupted += 1
            log.warning(
                "disk tier: segment %s has a torn or damaged record at byte %d; truncated there", path, offset
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
        share = share or segments.share_of(None)
        read_ahead(fd)
        segment = Segment(seq, path, fd, offset, share, segments.tick())
        segment.keys = held
        segment.sealed = True
        share.used += offset
        segments.by_seq[seq] = segment
    segments.next_seq = max(segments.by_seq, default=0) + 1
    found.restored = {ns_id: (tenants[ns_id], frozenset(namespace_modes[ns_id])) for ns_id in namespace_modes}
    return found
