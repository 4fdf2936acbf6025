"""A vectorised presence index for packed Lookups: 64-bit key fingerprints in an open-addressing table.

A dict probe per key is a cache miss per key once the store is large, paid while vLLM's scheduler
waits for the Lookup. Here the probe is a few NumPy passes over the packed key bytes, with no object
per key.

A fingerprint stands for its key, so two keys can share one: then a key can read as present (in
the other's mode), or as absent once the other is removed. The odds are about n / 2^63 per probed
key for n stored keys, and the cost is one Lookup answer wrong about presence: a hit whose Get then
misses, which the connector treats as a load error (recompute), or a miss that is recomputed. Reads
and writes never use this index: they go by the exact key.
"""

from __future__ import annotations

import os

import numpy as np
import numpy.typing as npt

_EMPTY = np.uint64(0)
_DELETED = np.uint64(1)
_TOP = np.uint64(1 << 63)  # set in every fingerprint, so none is _EMPTY or _DELETED
_MULTIPLIER = np.uint64(0x9E3779B97F4A7C15)
_MIX = np.uint64(0xBF58476D1CE4E5B9)
# Per process, like Python's own hash: keys that collide here do not collide in another store.
_SEED = np.uint64(int.from_bytes(os.urandom(8), "little"))
_SHIFT = np.uint64(29)
_MIN_SLOTS = 1024
_WINDOW = 8
_STEPS = np.arange(1, _WINDOW + 1, dtype=np.uint64)
NOT_FOUND = -1

Fingerprints = npt.NDArray[np.uint64]
Modes = npt.NDArray[np.int32]


def fingerprints(packed: bytes, key_length: int) -> Fingerprints:
    """The fingerprint of each of the concatenated `key_length`-byte keys, from 64-bit words."""
    count = len(packed) // key_length
    width = -(-key_length // 8)
    if key_length % 8:
        padded = np.zeros((count, width * 8), np.uint8)
        padded[:, :key_length] = np.frombuffer(packed, np.uint8).reshape(count, key_length)
        words = padded.view("<u8").T.copy()
    else:
        words = np.frombuffer(packed, "<u8").reshape(count, width).T.copy()
    with np.errstate(over="ignore"):
        h: Fingerprints = words[0] ^ (_SEED ^ np.uint64(key_length))
        h *= _MULTIPLIER
        for column in words[1:]:
            h ^= h >> _SHIFT
            h ^= column
            h *= _MULTIPLIER
        h ^= h >> np.uint64(32)
        h *= _MIX
        h ^= h >> _SHIFT
    h |= _TOP
    return h


def fingerprints_of(keys: list[bytes]) -> Fingerprints:
    """Fingerprints of keys of any lengths (same function as `fingerprints`), in the keys' order."""
    lengths = set(map(len, keys))
    if len(lengths) == 1:  # the usual case: one key scheme, one length
        return fingerprints(b"".join(keys), lengths.pop())
    out = np.empty(len(keys), np.uint64)
    by_length: dict[int, list[int]] = {}
    for i, key in enumerate(keys):
        by_length.setdefault(len(key), []).append(i)
    for length, indexes in by_length.items():
        out[indexes] = fingerprints(b"".join(keys[i] for i in indexes), length)
    return out


class KeyIndex:
    """Fingerprint -> mode number, by linear probing in power-of-two arrays.

    At most half the slots are in use (live or deleted), so every probe sequence ends at an empty
    slot, and most end at their first: a probe of n keys is one vectorised pass over all of them and
    short passes over the few that collided. Deleted slots are reclaimed by a rebuild, which also
    shrinks the table once fewer than 1/16 of its slots are live (4x headroom after either, so
    neither growth nor shrinking repeats before the live count has changed several-fold).
    """

    __slots__ = ("_deleted", "_fps", "_live", "_mask", "_modes")

    def __init__(self, slots: int = _MIN_SLOTS) -> None:
        self._fps: Fingerprints = np.zeros(slots, np.uint64)
        self._modes: Modes = np.zeros(slots, np.int32)
        self._mask = np.uint64(slots - 1)
        self._live = 0
        self._deleted = 0

    def __len__(self) -> int:
        return self._live

    def find(self, fps: Fingerprints) -> Modes:
        """The mode number stored for each fingerprint, NOT_FOUND where there is none."""
        slots = self._slots_of(fps)
        found = slots >= 0
        return np.where(found, np.take(self._modes, np.where(found, slots, 0)), NOT_FOUND).astype(np.int32)

    def set(self, fps: Fingerprints, modes: Modes) -> None:
        """Store (or overwrite) a mode per fingerprint; `fps` must hold no duplicates."""
        if not len(fps):
            return
        slots = self._slots_of(fps)
        present = slots >= 0
        self._modes[slots[present]] = modes[present]
        new = ~present
        added = int(new.sum())
        if not added:
            return
        if 2 * (self._live + self._deleted + added) > len(self._fps):
            self._rebuild(self._live + added)
        self._place(fps[new], modes[new])

    def remove(self, fps: Fingerprints) -> None:
        """Drop the fingerprints that are present; absent ones are ignored."""
        if not len(fps):
            return
        slots = self._slots_of(fps)
        slots = np.unique(slots[slots >= 0])
        self._fps[slots] = _DELETED
        self._live -= len(slots)
        self._deleted += len(slots)
        if len(self._fps) > _MIN_SLOTS and 16 * self._live < len(self._fps):
            self._rebuild(self._live)  # after mass evictions: give the memory back

    def _slots_of(self, fps: Fingerprints) -> npt.NDArray[np.int64]:
        """The slot holding each fingerprint, or -1."""
        table, mask = self._fps, self._mask
        position = fps & mask
        seen = np.take(table, position)
        hit = seen == fps
        result = np.where(hit, position.astype(np.int64), -1)
        going = np.flatnonzero(~hit & (seen != _EMPTY))
        position = position[going]
        # The few that collided read the next _WINDOW slots at once, stopping at their fingerprint or
        # an empty slot: one pass per window instead of one per slot.
        while len(going):
            window = (position[:, None] + _STEPS) & mask
            seen = np.take(table, window)
            match = seen == fps[going][:, None]
            stop = match | (seen == _EMPTY)
            first = stop.argmax(axis=1)
            rows = np.arange(len(going))
            found = match[rows, first]
            result[going[found]] = window[found, first[found]].astype(np.int64)
            going_on = ~stop[rows, first]
            going, position = going[going_on], window[going_on, -1]
        return result

    def _place(self, fps: Fingerprints, modes: Modes) -> None:
        """Insert absent, distinct fingerprints, each at the first free slot of its probe sequence."""
        table, mask = self._fps, self._mask
        position = fps & mask
        while len(fps):
            seen = np.take(table, position)
            free = (seen == _EMPTY) | (seen == _DELETED)
            # Of several fingerprints arriving at one free slot, the first takes it; the rest retry.
            candidates = np.flatnonzero(free)
            _, first = np.unique(position[candidates], return_index=True)
            winners = candidates[first]
            self._deleted -= int((seen[winners] == _DELETED).sum())
            table[position[winners]] = fps[winners]
            self._modes[position[winners]] = modes[winners]
            self._live += len(winners)
            waiting = np.ones(len(fps), bool)
            waiting[winners] = False
            fps, modes = fps[waiting], modes[waiting]
            position = np.where(free[waiting], position[waiting], (position[waiting] + np.uint64(1)) & mask)

    def _rebuild(self, live: int) -> None:
        """Re-place the live fingerprints in a table of at least 4x their count, dropping deletions."""
        keep = self._fps > _DELETED
        fps, modes = self._fps[keep], self._modes[keep]
        slots = _MIN_SLOTS
        while slots < 4 * live:
            slots *= 2
        self._fps = np.zeros(slots, np.uint64)
        self._modes = np.zeros(slots, np.int32)
        self._mask = np.uint64(slots - 1)
        self._live = 0
        self._deleted = 0
        self._place(fps, modes)
