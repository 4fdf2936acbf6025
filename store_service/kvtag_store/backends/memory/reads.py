"""Verified reads: the hits are pinned under the lock so their slots stay put while they are read
outside it, and each value's checksum is checked before it leaves; a failing value is dropped from
the store, counted, and answered as a MISS.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Sequence

from kvtag_store.backends.base import BlockAddress, KeyStatus, ReadResult, SlotReference
from kvtag_store.backends.memory.entries import Entry, Namespace, checksum

_MISS = KeyStatus.MISS


class Reader:
    """The memory backend's Get paths: copies, views and shared-memory references of verified values."""

    def __init__(self, lock: threading.Lock, namespaces: dict[str, Namespace]) -> None:
        """`lock` and `namespaces` are the backend's own, shared."""
        self._lock = lock
        self._namespaces = namespaces
        self.corrupted = 0  # values dropped because their checksum failed

    def get(self, namespace_id: str, mode_id: str, addresses: Sequence[BlockAddress]) -> list[ReadResult]:
        """Every hit is copied out of its (pinned) slot and the copy's checksum checked before it leaves;
        a failing value is dropped, counted in corrupted and answered as a MISS."""
        statuses, found, pinned = self._read_pinned(namespace_id, mode_id, addresses)
        try:
            values = [bytes(e.view()) if e is not None else None for e in found]
        finally:
            self._unpin(namespace_id, pinned)
        bad = [
            i
            for i, (e, v) in enumerate(zip(found, values, strict=True))
            if e is not None and v is not None and checksum(v) != e.checksum
        ]
        if bad:
            self._drop_corrupted(namespace_id, addresses, statuses, found, bad)
            for i in bad:
                values[i] = None
        return [ReadResult(status, value) for status, value in zip(statuses, values, strict=True)]

    def get_views(
        self,
        namespace_id: str,
        mode_id: str,
        addresses: Sequence[BlockAddress],
        trusted: Collection[int] = (),
    ) -> tuple[list[ReadResult], list[BlockAddress]]:
        """get() without the copy: each verified hit's value is a view of its slot, pinned (returned)
        until the caller unpins it, so an inline Get reply is built straight from the arena.
        `trusted`: ids of entries whose values were verified just now (read back from disk)."""
        statuses, found, pinned = self._verified_pinned(namespace_id, mode_id, addresses, trusted)
        results = [
            ReadResult(status, e.view() if e is not None else None)
            for status, e in zip(statuses, found, strict=True)
        ]
        return results, pinned

    def get_references(
        self,
        namespace_id: str,
        mode_id: str,
        addresses: Sequence[BlockAddress],
        verify: bool = True,
        trusted: Collection[int] = (),
    ) -> tuple[list[KeyStatus], list[SlotReference | None], list[BlockAddress]]:
        """Shared-memory Get: statuses, a reference per hit and the pinned addresses, which the caller
        holds under a lease until the reader released them (unpin). With `verify`, checksums are
        checked in place and a failing value is dropped and answered as a MISS, like get. Without
        it each reference carries the committed digest for the reader to check its copy against:
        the value is read once, by the reader, instead of once here and again there."""
        if verify:
            statuses, found, pinned = self._verified_pinned(namespace_id, mode_id, addresses, trusted)
        else:
            statuses, found, pinned = self._read_pinned(namespace_id, mode_id, addresses)
        references = [
            SlotReference(
                e.arena.segment,
                e.slot.offset,
                e.slot.length,
                e.slot.generation,
                None if verify else e.checksum,
            )
            if e is not None
            else None
            for e in found
        ]
        return statuses, references, pinned

    def _verified_pinned(
        self,
        namespace_id: str,
        mode_id: str,
        addresses: Sequence[BlockAddress],
        trusted: Collection[int] = (),
    ) -> tuple[list[KeyStatus], list[Entry | None], list[BlockAddress]]:
        """_read_pinned with every hit's checksum checked in place (but the `trusted` entries', by id):
        a failing value is dropped, unpinned and answered as a MISS."""
        statuses, found, pinned = self._read_pinned(namespace_id, mode_id, addresses)
        bad = [
            i
            for i, e in enumerate(found)
            if e is not None and (not trusted or id(e) not in trusted) and checksum(e.view()) != e.checksum
        ]
        if bad:
            self._drop_corrupted(namespace_id, addresses, statuses, found, bad)
            dropped = {addresses[i] for i in bad}
            self._unpin(namespace_id, [a for a in pinned if a in dropped])
            pinned = [a for a in pinned if a not in dropped]
        return statuses, found, pinned

    def _read_pinned(
        self, namespace_id: str, mode_id: str, addresses: Sequence[BlockAddress]
    ) -> tuple[list[KeyStatus], list[Entry | None], list[BlockAddress]]:
        """Statuses and entries of the addresses, the hits pinned (returned) so their slots stay put
        while they are read outside the lock; reading marks them recently used."""
        with self._lock:
            ns = self._namespaces.get(namespace_id)
            if ns is None:
                return [_MISS] * len(addresses), [None] * len(addresses), []
            statuses, found = ns.find(mode_id, addresses, touch=True)
            pinned = [a for a, e in zip(addresses, found, strict=True) if e is not None]
            ns.pins.update(pinned)
        return statuses, found, pinned

    def _unpin(self, namespace_id: str, addresses: Sequence[BlockAddress]) -> None:
        with self._lock:
            ns = self._namespaces.get(namespace_id)
            if ns is not None:
                ns.unpin(addresses)

    def _drop_corrupted(
        self,
        namespace_id: str,
        addresses: Sequence[BlockAddress],
        statuses: list[KeyStatus],
        found: list[Entry | None],
        bad: list[int],
    ) -> None:
        """Answer the values at `bad` positions as MISS and drop them from the store (counted)."""
        with self._lock:
            ns = self._namespaces.get(namespace_id)
            for i in bad:
                entry = found[i]
                statuses[i] = _MISS
                found[i] = None
                if ns is not None and entry is not None and ns.entries.get(addresses[i]) is entry:
                    ns.remove(addresses[i], entry)
                    self.corrupted += 1
