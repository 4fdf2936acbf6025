"""Bounded logs of what the census remembers about the past: gone engines, refused sessions, probe
disagreements.

Each log keeps its own last `limit` records, and all logs together keep at most `max_records` and
`max_bytes` of them as encoded (the oldest anywhere leave first), so the census's memory for
history is bounded however many namespaces and modes come and go, and however long their labels.
What leaves is counted, never silently lost.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Generic, TypeVar

T = TypeVar("T")

# Records the census keeps store-wide, across every log: at most this many, and this many bytes as
# encoded. A record in memory costs a few times its encoding (docs/benchmarks.md), and a gone engine
# keeps up to 16 labels of 256 characters, so the count alone would not bound the memory; most
# records are a few hundred bytes, so the byte bound only bites for long labels.
MAX_RECORDS = 8192
MAX_RECORD_BYTES = 4 << 20


class RecordLog(Generic[T]):
    """One namespace's (or mode's) records, newest last.

    The records sit in a plain list, and only while there are any: most logs never get one (a
    namespace has three per mode: engines, refusals, disagreements), and a deque costs hundreds of
    bytes from its first record (docs/benchmarks.md). A log holds at most `limit` (16 or 32)
    records, so dropping the oldest from a list's front is cheap.
    """

    __slots__ = ("_items", "_skipped", "dead", "forgotten", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._items: list[T] | None = None
        # Shelf entries of records this log already dropped by its own limit.
        self._skipped = 0
        self.forgotten = 0
        self.dead = False

    def __iter__(self) -> Iterator[T]:
        return iter(self._items or ())

    def __reversed__(self) -> Iterator[T]:
        return reversed(self._items or ())

    def __len__(self) -> int:
        return len(self._items or ())

    def __bool__(self) -> bool:
        return bool(self._items)

    def close(self) -> None:
        """The log's owner is forgotten: free its records now (its shelf entries become no-ops)."""
        self._items = None
        self.dead = True


class RecordShelf:
    """The store-wide bound over every RecordLog; not thread-safe (the census's lock guards it).

    Each entry is the log a record went to and the record's encoded size, oldest first. A record its
    own log dropped (past `limit`) keeps its entry, and its bytes counted, until the entry leaves:
    the count errs high, never low."""

    def __init__(self, max_records: int = MAX_RECORDS, max_bytes: int = MAX_RECORD_BYTES) -> None:
        self._max = max_records
        self._max_bytes = max_bytes
        self._order: deque[tuple[RecordLog[object], int]] = deque()
        self._bytes = 0

    def add(self, log: RecordLog[T], item: T, size: int) -> None:
        """Keep `item` (`size`: its encoded bytes) in `log`, dropping the oldest records anywhere past
        the bounds."""
        if log.dead:
            return
        if log._items is None:
            log._items = []
        log._items.append(item)
        self._order.append((log, size))  # type: ignore[arg-type]
        self._bytes += size
        if len(log._items) > log.limit:
            del log._items[0]
            log._skipped += 1
            log.forgotten += 1
        while len(self._order) > self._max or (self._bytes > self._max_bytes and len(self._order) > 1):
            oldest, oldest_size = self._order.popleft()
            self._bytes -= oldest_size
            if oldest.dead:
                continue
            if oldest._skipped:
                oldest._skipped -= 1
            elif oldest._items:
                del oldest._items[0]
                oldest.forgotten += 1
                if not oldest._items:
                    oldest._items = None  # so lists never outnumber the records kept

    def drop_closed(self) -> None:
        """Let go of the entries of closed logs now, rather than when newer records push them out:
        after a sweep forgets many namespaces, those entries are all that keeps their logs alive."""
        self._order = deque(entry for entry in self._order if not entry[0].dead)
        self._bytes = sum(size for _, size in self._order)

    def __len__(self) -> int:
        return len(self._order)

    @property
    def encoded_bytes(self) -> int:
        return self._bytes
