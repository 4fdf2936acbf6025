"""The Mooncake backend's reads: lookups from existence checks alone, and whole-value reads.

A storage process that died makes a read fail at once (connection refused) or wait out
Mooncake's transfer timeout (about 1 s) whatever the number of keys, while the master still
lists its objects until its client TTL drops it. So a read that failed slowly is never retried,
whatever still fails marks its storage process suspect, and objects held only by suspects are
misses without the wait.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, NamedTuple

from kvtag_store.backends.base import BlockAddress, KeyStatus, ReadResult
from kvtag_store.backends.mooncake.cluster import Cluster
from kvtag_store.backends.mooncake.errors import MooncakeCode
from kvtag_store.backends.mooncake.format import HEADER_BYTES, FormatError, decode_header, verify_payload
from kvtag_store.backends.mooncake.staging import Staged

# A Get that met a dead storage process starts no new read past this; a read that failed after
# at least _SLOW_FAILURE_S waited for Mooncake's transfer timeout and is not retried.
_GET_DEADLINE_S = 1.0
_SLOW_FAILURE_S = 0.5
_MISSING = MooncakeCode.OBJECT_NOT_FOUND

# (index into the call's keys, value size in bytes, storage endpoints holding it)
Located = tuple[int, int, frozenset[str]]


class Found(NamedTuple):
    """Blocks of one Get located: object keys, the readable ones, how many sit only on suspect
    processes, and per block the other mode holding it (None: none)."""

    mkeys: list[str]
    located: list[Located]
    on_suspects: int
    holders: list[str | None]


class ClusterReader:
    """Lookups and Gets over the cluster; a value that fails verification is dropped and a miss."""

    def __init__(self, cluster: Cluster) -> None:
        self._cluster = cluster
        self._client = cluster.client

    def lookup(self, namespace_id: str, mode_id: str, addresses: Sequence[BlockAddress]) -> list[KeyStatus]:
        """Existence checks alone: a block is a HIT if its key in this mode exists, MODE_MISMATCH if
        its key in another mode of the namespace's directory does (Cluster.presence). The checks
        also take Mooncake's read lease. No header is read: a Get checks the one it serves."""
        if not addresses:
            return []
        self._cluster.breaker.check("looking up")
        found = self._cluster.presence(namespace_id, mode_id, addresses, "looking blocks up", writing=False)
        return [
            KeyStatus.HIT if here else KeyStatus.MODE_MISMATCH if holder else KeyStatus.MISS
            for here, holder in zip(found.present, found.holders, strict=True)
        ]

    def get(self, namespace_id: str, mode_id: str, addresses: Sequence[BlockAddress]) -> list[ReadResult]:
        if not addresses:
            return []
        self._cluster.breaker.check("reading")
        found = self.locate(namespace_id, mode_id, addresses)
        values = self._fetch(found)
        results: list[ReadResult] = []
        corrupt: list[str] = []
        rows = zip(addresses, found.mkeys, values, found.holders, strict=True)
        for (group, key), mkey, value, holder in rows:
            if not value:
                results.append(ReadResult(KeyStatus.MODE_MISMATCH if holder else KeyStatus.MISS))
                continue
            try:
                header = decode_header(value, namespace_id, group, key, mode_id)
                payload = verify_payload(header, value)
            except FormatError:
                corrupt.append(mkey)
                results.append(ReadResult(KeyStatus.MISS))
                continue
            results.append(ReadResult(KeyStatus.HIT, bytes(payload)))
        if corrupt:
            self._cluster.drop_corrupt(corrupt)
        return results

    def locate(self, namespace_id: str, mode_id: str, addresses: Sequence[BlockAddress]) -> Found:
        """Where the blocks stored in this mode are, by the master's replica list; which other mode
        holds each of the rest; and how many are held only by suspect storage processes (left
        out: a miss without the wait).

        get_batch returns b"" alike for a missing key, an unreachable storage process and a failed
        master (after seconds of retries), so an existence check comes first: it fails fast when
        the master is down and spares the transfer for misses.
        """
        presence = self._cluster.presence(namespace_id, mode_id, addresses, "reading blocks", writing=False)
        mkeys = presence.mkeys
        present = [i for i, here in enumerate(presence.present) if here]
        if not present:
            return Found(mkeys, [], 0, presence.holders)
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
        return Found(mkeys, located, on_suspects, presence.holders)

    def _fetch(self, found: Found) -> list[bytes]:
        """Whole values of the keys that exist (b"" for the rest), within one deadline per Get.

        Reads go in chunks that fit the local buffer. A key that exists but reads empty is a
        transfer failure: a fast one (perhaps the buffer busy with concurrent calls) is retried
        once, a slow one never, and once one happened no new chunk starts past _GET_DEADLINE_S,
        so one Get costs at most about one transfer timeout.
        """
        mkeys = found.mkeys
        values = [b""] * len(mkeys)
        readable, failed = found.located, found.on_suspects
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
