"""Bounded logs of what the census remembers about the past: gone engines, refused sessions, probe
disagreements.

Each log keeps its own last `limit` records, and all logs together keep at most `max_records` (the
oldest anywhere leave first), so the census's memory for history is bounded however many
namespaces and modes come and go. What leaves is counted, never silently lost.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any, Generic, TypeVar

T = TypeVar("T")

# What a log holds before its first record and after it is closed: one shared deque that cannot hold
# anything (maxlen 0). An empty deque costs ~600 bytes (its first block), and most logs stay empty: a
# namespace has three per mode (engines, refusals, disagreements), so 5,000 namespaces opened once
# held 10.9 MiB of empty deques, half their census; closed logs the shelf still names cost only their
# slots until its entries age out.
_NONE: deque[Any] = deque(maxlen=0)

# Records the census keeps store-wide, across every log.
MAX_RECORDS = 8192


class RecordLog(Generic[T]):
    """One namespace's (or mode's) records, newest last."""

    __slots__ = ("_items", "_skipped", "dead", "forgotten", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._items: deque[T] = _NONE
        # Shelf entries of records this log already dropped by its own limit.
        self._skipped = 0
        self.forgotten = 0
        self.dead = False

    def __iter__(self) -> Iterator[T]:
        return iter(self._items)

    def __reversed__(self) -> Iterator[T]:
        return reversed(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)

    def close(self) -> None:
        """The log's owner is forgotten: free its records and their deque now (its shelf entries become
        no-ops)."""
        self._items = _NONE
        self.dead = True


class RecordShelf:
    """The store-wide bound over every RecordLog; not thread-safe (the census's lock guards it)."""

    def __init__(self, max_records: int = MAX_RECORDS) -> None:
        self._max = max_records
        self._order: deque[RecordLog[object]] = deque()

    def add(self, log: RecordLog[T], item: T) -> None:
        if log.dead:
            return
        if log._items is _NONE:
            log._items = deque()
        log._items.append(item)
        self._order.append(log)  # type: ignore[arg-type]
        if len(log._items) > log.limit:
            log._items.popleft()
            log._skipped += 1
            log.forgotten += 1
        if len(self._order) > self._max:
            oldest = self._order.popleft()
            if oldest.dead:
                return
            if oldest._skipped:
                oldest._skipped -= 1
            elif oldest._items:
                oldest._items.popleft()
                oldest.forgotten += 1
                if not oldest._items:
                    oldest._items = _NONE  # so deques never outnumber the records kept

    def drop_closed(self) -> None:
        """Let go of the entries of closed logs now, rather than when newer records push them out:
        after a sweep forgets many namespaces, those entries are all that keeps their logs alive."""
        self._order = deque(log for log in self._order if not log.dead)

    def __len__(self) -> int:
        return len(self._order)
