"""The disk tier's boundary with the memory tier, both ways.

What the disk tier needs of the memory tier is MemorySide, and nothing else: it holds no table of
the memory tier's (namespaces, entries, pools, pins) and touches no entry. What the memory tier calls
is DiskTier's public surface (tier.py): `index`, `spill`/`spill_evicted`/`wake` on writes, the record
reads of reads.py on a Get, `usage`, `restored`, `close`.

One critical section covers both tiers' tables: a Lookup must see a record and the leases on it as
one state (a record is never dropped under a lease), so the disk tier changes its index and segments
inside MemorySide.critical(), and the memory tier calls into the disk tier from inside it.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import NamedTuple, Protocol

from kvtag_store.backends.base import BlockAddress


class Unwritten(NamedTuple):
    """A memory entry the writer copies to disk, pinned until `MemorySide.written` or `unpin`."""

    tenant: str | None
    mode_id: str
    digest: int
    value: memoryview  # the entry's slot: valid while pinned


class MemorySide(Protocol):
    """What the disk tier needs of the memory tier. Every method but `critical` is called inside it."""

    def critical(self) -> AbstractContextManager[object]:
        """The memory tier's critical section (its lock)."""
        ...

    def pin_unwritten(self, namespace_id: str, address: BlockAddress, generation: int) -> Unwritten | None:
        """The entry stored at `address` with this slot generation and not yet on disk, pinned; None
        when it has gone, been replaced, or is on disk already."""
        ...

    def tenant_if_absent(self, namespace_id: str, address: BlockAddress) -> tuple[bool, str | None]:
        """(True, tenant) when the namespace exists and holds nothing in memory at `address` (an evicted
        copy is worth writing), else (False, None)."""
        ...

    def unpin(self, namespace_id: str, address: BlockAddress) -> None:
        """Release a pin_unwritten pin."""
        ...

    def written(self, namespace_id: str, address: BlockAddress, mode_id: str, location: int) -> None:
        """The value at `address` in `mode_id` is on disk at `location` now: evicting it is free."""
        ...

    def held(self, namespace_id: str, address: BlockAddress) -> bool:
        """Pinned or leased: its record must stay."""
        ...

    def dropped(self, namespace_id: str, address: BlockAddress, location: int) -> None:
        """The record at `location` is gone: an entry it backed is in memory only again."""
        ...

    def disk_off(self) -> None:
        """The tier turned off: no entry is on disk, nothing is queued for it any more."""
        ...
