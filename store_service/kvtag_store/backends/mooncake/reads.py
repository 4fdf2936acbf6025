"""The Mooncake backend's reads: lookups from the master and the mode cache, and whole-value reads.

A storage process that died makes a read fail at once (connection refused) or wait out
Mooncake's transfer timeout (about 1 s) whatever the number of keys, while the master still
lists its objects until its client TTL drops it. So a read that failed slowly is never retried,
whatever still fails marks its storage process suspect, and objects held only by suspects are
misses without the wait.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from kvtag_store.backends.base import BlockAddress, KeyStatus, ReadResult
from kvtag_store.backends.mooncake.cluster import Cluster
from kvtag_store.backends.mooncake.errors import MooncakeCode
from kvtag_store.backends.mooncake.format import (
    HEADER_BYTES,
    FormatError,
    decode_header,
    object_keys,
    verify_payload,
)
from kvtag_store.backends.mooncake.staging import Staged

# A Get that met a dead storage process starts no new read past this; a read that failed after
# at least _SLOW_FAILURE_S waited for Mooncake's transfer timeout and is not retried.
_GET_DEADLINE_S = 1.0
_SLOW_FAILURE_S = 0.5
_MISSING = MooncakeCode.OBJECT_NOT_FOUND

# (index into the call's keys, value size in bytes, storage endpoints holding it)
Located = tuple[int, int, frozenset[str]]


class Reads:
    """Lookups and Gets over the cluster; a value that fails verification is dropped and a miss."""

    def __init__(self, cluster: Cluster) -> None:
        self._cluster = cluster
        self._client = cluster.client

    def lookup(self, namespace_id: str, mode_id: str, addresses: Sequence[BlockAddress]) -> list[KeyStatus]:
        """The master says which blocks exist (one call, which also takes Mooncake's read lease); their
        tags come from the mode cache, and only blocks this service has not seen have their headers
        read. See mode_cache for what a stale tag can and cannot do."""
        if not addresses:
            return []
        self._cluster.breaker.check("looking up")
        mkeys = object_keys(namespace_id, addresses)
        exists = self._cluster.exists(mkeys, "looking blocks up")
        statuses = [KeyStatus.MISS] * len(mkeys)
        present = [i for i, code in enumerate(exists) if code == 1]
        tags = self._cluster.tags
        if len(present) < len(mkeys):
            tags.forget([mkeys[i] for i, code in enumerate(exists) if code != 1])
        unseen: list[int] = []
        for i, tag in zip(present, tags.modes([mkeys[i] for i in present]), strict=True):
            if tag is None:
                unseen.append(i)
            else:
                statuses[i] = KeyStatus.HIT if tag == mode_id else KeyStatus.MODE_MISMATCH
        if unseen:
            read = self._read_tags(
                namespace_id, mode_id, [addresses[i] for i in unseen], [mkeys[i] for i in unseen]
            )
            for i, status in zip(unseen, read, strict=True):
                statuses[i] = status
        return statuses

    def _read_tags(
        self, namespace_id: str, mode_id: str, addresses: Sequence[BlockAddress], mkeys: list[str]
    ) -> list[KeyStatus]:
        """Statuses from the stored headers, their tags learnt; damaged ones dropped (MISS)."""
        found = self._cluster.headers.read(mkeys)
        statuses: list[KeyStatus] = []
        corrupt: list[str] = []
        seen: dict[str, str] = {}
        for (group, key), mkey, raw in zip(addresses, mkeys, found, strict=True):
            if isinstance(raw, int):
                self._cluster.breaker.screen([raw], "looking blocks up", counted_unless=(_MISSING,))
                if raw == MooncakeCode.BUFFER_OVERFLOW:
                    corrupt.append(mkey)  # shorter than a header: not a kvtag value
                statuses.append(KeyStatus.MISS)
                continue
            try:
                header = decode_header(raw, namespace_id, group, key)
            except FormatError:
                corrupt.append(mkey)
                statuses.append(KeyStatus.MISS)
                continue
            seen[mkey] = header.mode_id
            statuses.append(KeyStatus.HIT if header.mode_id == mode_id else KeyStatus.MODE_MISMATCH)
        self._cluster.tags.learn(list(seen), list(seen.values()))
        if corrupt:
            self._cluster.drop_corrupt(corrupt)
        return statuses

    def get(self, namespace_id: str, mode_id: str, addresses: Sequence[BlockAddress]) -> list[ReadResult]:
        if not addresses:
            return []
        self._cluster.breaker.check("reading")
        mkeys = object_keys(namespace_id, addresses)
        values = self._fetch(mkeys)
        results: list[ReadResult] = []
        corrupt: list[str] = []
        seen: dict[str, str] = {}
        for (group, key), mkey, value in zip(addresses, mkeys, values, strict=True):
            if not value:
                results.append(ReadResult(KeyStatus.MISS))
                continue
            try:
                header = decode_header(value, namespace_id, group, key)
                seen[mkey] = header.mode_id
                if header.mode_id != mode_id:
                    results.append(ReadResult(KeyStatus.MODE_MISMATCH))
                    continue
                payload = verify_payload(header, value)
            except FormatError:
                corrupt.append(mkey)
                results.append(ReadResult(KeyStatus.MISS))
                continue
            results.append(ReadResult(KeyStatus.HIT, bytes(payload)))
        self._cluster.tags.learn(list(seen), list(seen.values()))
        if corrupt:
            self._cluster.drop_corrupt(corrupt)
        return results

    def locate(self, mkeys: list[str]) -> tuple[list[Located], int]:
        """Where the existing objects of mkeys are, by the master's replica list, and how many are
        held only by suspect storage processes (left out: a miss without the wait).

        get_batch returns b"" alike for a missing key, an unreachable storage process and a failed
        master (after seconds of retries), so an existence check comes first: it fails fast when
        the master is down and spares the transfer for misses.
        """
        exists = self._cluster.exists(mkeys, "reading blocks")
        present = [i for i, code in enumerate(exists) if code == 1]
        if not present:
            return [], 0
        placements = self._client.batch_get_replica_desc([mkeys[i] for i in present])
        suspects = self._cluster.suspects.current()
        located: list[Located] = []
        on_suspects = 0
        for i in present:
            size, where = _placement(placements.get(mkeys[i], ()))
            if where and where <= suspects:
                on_suspects += 1
            elif size:
                located.append((i, size, where))
        return located, on_suspects

    def _fetch(self, mkeys: list[str]) -> list[bytes]:
        """Whole values of the keys that exist (b"" for the rest), within one deadline per Get.

        Reads go in chunks that fit the local buffer. A key that exists but reads empty is a
        transfer failure: a fast one (perhaps the buffer busy with concurrent calls) is retried
        once, a slow one never, and once one happened no new chunk starts past _GET_DEADLINE_S,
        so one Get costs at most about one transfer timeout.
        """
        values = [b""] * len(mkeys)
        readable, failed = self.locate(mkeys)
        started = time.monotonic()
        for chunk in _chunks(readable, self._cluster.settings.local_buffer_bytes // 4):
            if failed and time.monotonic() - started > _GET_DEADLINE_S:
                failed += len(chunk)
                continue
            missing, slow = self._read_chunk(mkeys, chunk, values)
            if missing and not slow:
                missing, _ = self._read_chunk(mkeys, missing, values)
            if missing:
                self._cluster.suspects.mark(frozenset().union(*(where for _, _, where in missing)))
            failed += len(missing)
        if failed:
            # Listed by the master, unreadable from its storage process (killed or cut off).
            self._cluster.errors.add(MooncakeCode.TRANSFER_FAIL, failed)
        return values

    def _read_chunk(
        self, mkeys: list[str], chunk: list[Located], values: list[bytes]
    ) -> tuple[list[Located], bool]:
        """Read one chunk into values: the entries that came back empty, and whether that took a
        transfer timeout (a dead process) rather than failing at once (a busy buffer)."""
        started = time.monotonic()
        got = self._client.get_batch([mkeys[entry[0]] for entry in chunk])
        missing = []
        for entry, value in zip(chunk, got, strict=True):
            if value:
                values[entry[0]] = value
            else:
                missing.append(entry)
        return missing, time.monotonic() - started >= _SLOW_FAILURE_S

    def into_slots(
        self, mkeys: list[str], entries: list[tuple[int, frozenset[str], Staged]]
    ) -> list[tuple[int, Staged]]:
        """Read whole values into their staging slots: (index, slot) of those that arrived. As for
        a Get, a read that failed slowly is not retried and marks its process suspect; one that
        failed at once is retried once."""
        arrived: list[tuple[int, Staged]] = []
        todo = entries
        for attempt in range(2):
            if not todo:
                break
            started = time.monotonic()
            buffers = [staged.buffers() for _, _, staged in todo]
            codes = self._client.batch_get_into_multi_buffers(
                [mkeys[i] for i, _, _ in todo], [b[0] for b in buffers], [b[1] for b in buffers]
            )
            slow = time.monotonic() - started >= _SLOW_FAILURE_S
            self._cluster.breaker.screen(codes, "reading blocks")
            failed = []
            for entry, code in zip(todo, codes, strict=True):
                if code == HEADER_BYTES + entry[2].length:
                    arrived.append((entry[0], entry[2]))
                elif code != _MISSING:  # evicted since the existence check: a plain miss
                    failed.append(entry)
            todo = failed
            if slow or attempt == 1:
                break
        if todo:
            self._cluster.suspects.mark(frozenset().union(*(where for _, where, _ in todo)))
            self._cluster.errors.add(MooncakeCode.TRANSFER_FAIL, len(todo))
        return arrived


def _placement(replicas: Any) -> tuple[int, frozenset[str]]:
    """(value size, storage endpoints) from Mooncake's replica descriptors; (0, {}) if none."""
    size = 0
    endpoints = set()
    for replica in replicas:
        if replica.is_memory_replica():
            buffer = replica.get_memory_descriptor().buffer_descriptor
            size = max(size, int(buffer.size))
            endpoints.add(str(buffer.transport_endpoint))
        else:
            size = max(size, int(replica.get_disk_descriptor().object_size))
    return size, frozenset(endpoints)


def _chunks(entries: list[Located], budget: int) -> list[list[Located]]:
    """Consecutive runs of entries whose sizes fit the budget together (a larger value goes alone:
    Mooncake's put refused it already unless the buffer grew since)."""
    chunks: list[list[Located]] = []
    used = budget
    for entry in entries:
        if used + entry[1] > budget:
            chunks.append([])
            used = 0
        chunks[-1].append(entry)
        used += entry[1]
    return chunks
