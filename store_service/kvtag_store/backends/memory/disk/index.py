"""A namespace's records on disk: its disk index, owned by the disk tier, read by the memory tier.

An index entry is one packed int (records.Location) under index_key(group, key), so a disk-resident
key costs a dict slot, its key bytes and this int. The memory tier reads an index under its lock (its
Lookups answer memory misses from it); the disk tier changes it only inside the memory tier's
critical section (ports.MemorySide.critical), so a reader under that lock sees it whole.
"""

from __future__ import annotations

from collections.abc import Iterator, MutableSequence, Sequence
from typing import Any

from kvtag_store.backends.base import BlockAddress, BlockKey, KeyStatus
from kvtag_store.backends.memory.disk.records import MAX_MODE_NUMBER, index_address, index_key

_HIT = KeyStatus.HIT
_MISS = KeyStatus.MISS
_MISMATCH = KeyStatus.MODE_MISMATCH
_UNKNOWN_MODE = -2  # a mode that stored nothing on disk: matches no record


class DiskIndex(dict[bytes, int]):
    """index_key(group, key) -> packed location, with the disk tier's mode numbers to read them by and
    the count of Lookup keys found only here (`hits`)."""

    __slots__ = ("hits", "modes")

    def __init__(self, modes: dict[str, int]) -> None:
        """`modes`: mode_id -> its number in the packed locations, one table for the whole tier."""
        super().__init__()
        self.modes = modes
        self.hits = 0

    def statuses(self, mode_id: str, addresses: Sequence[BlockAddress], statuses: list[KeyStatus]) -> None:
        """Answer the memory MISSes held here: HIT in their own mode, MODE_MISMATCH in another (no
        bytes either way here)."""
        misses = (
            (i, index_key(addresses[i][0], addresses[i][1])) for i, s in enumerate(statuses) if s is _MISS
        )
        self._answer(mode_id, misses, statuses)

    def packed_statuses(self, mode_id: str, group: int, packed: bytes, length: int, part: bytes) -> bytes:
        """A packed run's status bytes with its MISSes answered from here."""
        prefix = group.to_bytes(4, "little")
        statuses = bytearray(part)
        misses = (
            (i, prefix + packed[i * length : (i + 1) * length])
            for i in range(len(statuses))
            if statuses[i] == _MISS
        )
        self._answer(mode_id, misses, statuses)
        return bytes(statuses)

    def _answer(
        self, mode_id: str, misses: Iterator[tuple[int, bytes]], statuses: MutableSequence[Any]
    ) -> None:
        """Set statuses[i] for each (i, index key) held here, counting the hits."""
        mine = self.modes.get(mode_id, _UNKNOWN_MODE)
        hits = 0
        for i, key in misses:
            packed = self.get(key)
            if packed is not None:
                if packed & MAX_MODE_NUMBER == mine:
                    statuses[i] = _HIT
                    hits += 1
                else:
                    statuses[i] = _MISMATCH
        self.hits += hits

    def mode_holding(self, mode_id: str, address: BlockAddress) -> str | None:
        """The mode whose record holds `address`, or None (`mode_id` when its number is unknown)."""
        packed = self.get(index_key(address[0], address[1])) if self else None
        if packed is None:
            return None
        number = packed & MAX_MODE_NUMBER
        return next((m for m, n in self.modes.items() if n == number), mode_id)

    def holds(self, address: BlockAddress) -> bool:
        return bool(self) and index_key(address[0], address[1]) in self

    def mode_of(self, packed: int) -> str:
        """The mode whose record is at the packed location `packed` (one of this index's)."""
        number = packed & MAX_MODE_NUMBER
        return next(m for m, n in self.modes.items() if n == number)

    def records(self) -> Iterator[tuple[str, BlockAddress]]:
        """(mode_id, address) of every record held here."""
        modes = {n: m for m, n in self.modes.items()}
        for key, packed in self.items():
            group, raw = index_address(key)
            yield modes[packed & MAX_MODE_NUMBER], (group, BlockKey(raw))
