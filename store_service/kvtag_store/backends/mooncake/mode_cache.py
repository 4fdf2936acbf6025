"""The mode tag last seen on each Mooncake object, so a Lookup reads no header for blocks seen before.

Mooncake's transport pays a fixed cost per object read however small the read, so reading the
header of every looked-up block would make a Lookup (while vLLM's scheduler waits) grow with
its block count; one existence check (`batch_is_exist`, a single master call) answers all the
keys at once. So a Lookup asks the master which blocks exist and takes their tags from here,
reading headers only for the blocks this service has not seen (put, looked up or read) since
it started (docs/mooncake.md has the measurements).

A tag here can be stale: the object was removed and another replica put the same key in
another mode, all while this service never saw it absent. Then a Lookup answers HIT for a
block of another mode, or MODE_MISMATCH for one of its own. The Get reads the header and goes
by the stored tag, so no bytes are ever served in the wrong mode: a stale HIT is a load that
misses (the connector recomputes), and a stale MODE_MISMATCH a block recomputed and then found
ALREADY_PRESENT, which corrects the tag. A damaged header of a block seen before is likewise
found by the Get, not the Lookup. A fingerprint shared by two object keys (odds ~n / 2^63)
has the same effects as a stale tag.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np

from kvtag_store.backends import key_index

# Entries held (each a slot of the fingerprint table); past the limit the cache starts over.
LIMIT = 1 << 20


class ModeCache:
    """Object key -> mode id, by 64-bit fingerprints of the key (kvtag_store.backends.key_index)."""

    def __init__(self, limit: int = LIMIT) -> None:
        self._limit = limit
        self._lock = threading.Lock()
        self._index = key_index.KeyIndex()
        self._numbers: dict[str, int] = {}
        self._modes: list[str] = []

    def __len__(self) -> int:
        return len(self._index)

    def modes(self, mkeys: Sequence[str]) -> list[str | None]:
        """The mode last seen on each object key, None where none was."""
        if not mkeys:
            return []
        fps = _fingerprints(mkeys)
        with self._lock:
            found = self._index.find(fps).tolist()
            names = self._modes
        return [names[n] if n >= 0 else None for n in found]

    def learn(self, mkeys: Sequence[str], modes: Sequence[str]) -> None:
        """Record the tag each object was seen with (a later call wins for a repeated key)."""
        if not mkeys:
            return
        fps = _fingerprints(mkeys)
        with self._lock:
            numbers = [self._number(mode) for mode in modes]
            unique, last = np.unique(fps[::-1], return_index=True)
            chosen = np.array(numbers[::-1], np.int32)[last]
            if len(self._index) + len(unique) > self._limit:
                self._index = key_index.KeyIndex()  # a cache: starting over costs header reads
            self._index.set(unique, chosen)

    def forget(self, mkeys: Sequence[str]) -> None:
        """The objects are gone (absent, removed or dropped as corrupt)."""
        if not mkeys:
            return
        fps = _fingerprints(mkeys)
        with self._lock:
            self._index.remove(np.unique(fps))

    def _number(self, mode: str) -> int:
        number = self._numbers.get(mode)
        if number is None:
            number = self._numbers[mode] = len(self._modes)
            self._modes.append(mode)
        return number


def _fingerprints(mkeys: Sequence[str]) -> key_index.Fingerprints:
    return key_index.fingerprints_of([k.encode() for k in mkeys])
