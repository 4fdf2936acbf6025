"""A short in-memory hit-rate history per (namespace, mode), sampled from the census counters.

The status page draws it as a sparkline: how the hit rate and the cross-mode misses of each mode
moved over the last hour. Each point holds the counter deltas of one interval, so a quiet interval
shows as a gap rather than as a repeat of the lifetime average.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvtag.v1 import store_pb2 as pb

log = logging.getLogger("kvtag_store.observe.history")

DEFAULT_INTERVAL_S = 60.0
DEFAULT_POINTS = 60


@dataclass(frozen=True, slots=True)
class Point:
    """What one mode's sessions saw during one interval ending at `at_unix_ms`."""

    at_unix_ms: int
    hits: int
    misses: int
    mode_mismatches: int
    cross_mode_misses: int

    @property
    def keys(self) -> int:
        return self.hits + self.misses + self.mode_mismatches

    @property
    def hit_rate(self) -> float | None:
        return self.hits / self.keys if self.keys else None

    @property
    def cross_mode_share(self) -> float | None:
        """The fraction of this interval's keys that missed although another mode held the block."""
        return self.cross_mode_misses / self.keys if self.keys else None


_Totals = tuple[int, int, int, int]


class HitRateHistory:
    """Samples `read()` (the census report) every `interval_s`, keeping the last `points` per mode."""

    def __init__(
        self,
        read: Callable[[], pb.DiagnoseResponse],
        interval_s: float = DEFAULT_INTERVAL_S,
        points: int = DEFAULT_POINTS,
    ) -> None:
        self.interval_s = interval_s
        self.points = points
        self._read = read
        self._lock = threading.Lock()
        self._last: dict[tuple[str, str], _Totals] = {}
        self._series: dict[tuple[str, str], deque[Point]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> None:
        """Append one point per known mode that has looked up a key: the counter deltas since the
        previous sample. Series of modes the census no longer reports (forgotten namespaces, pruned
        modes) go."""
        report = self._read()
        at = int(time.time() * 1000)
        seen: set[tuple[str, str]] = set()
        with self._lock:
            for ns in report.namespaces:
                for mode in ns.modes:
                    c = mode.counters
                    key = (ns.namespace_id, mode.mode_id)
                    seen.add(key)
                    totals = (c.hits, c.misses, c.mode_mismatches, c.cross_mode_misses)
                    if key not in self._series and not any(totals):
                        continue  # no key looked up yet: no series (a burst of idle namespaces costs none)
                    last = self._last.get(key, (0, 0, 0, 0))
                    self._last[key] = totals
                    deltas = [max(0, now - before) for now, before in zip(totals, last, strict=True)]
                    series = self._series.setdefault(key, deque(maxlen=self.points))
                    series.append(Point(at, *deltas))
            self._drop_locked(self._series.keys() - seen)

    def forget(self, namespace_ids: list[str]) -> None:
        """Drop the series of namespaces the census forgot, now rather than at the next sample: a
        burst of short-lived namespaces would otherwise hold up to a minute of series (~4 KiB each)."""
        gone = set(namespace_ids)
        with self._lock:
            self._drop_locked([key for key in self._series if key[0] in gone])

    def _drop_locked(self, keys: Iterable[tuple[str, str]]) -> None:
        for key in keys:
            del self._series[key]
            self._last.pop(key, None)

    def series(self, namespace_id: str, mode_id: str) -> list[Point]:
        with self._lock:
            return list(self._series.get((namespace_id, mode_id), ()))

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvtag-history", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.sample()
            except Exception:  # a bad sample must not end the history
                log.exception("sampling the hit-rate history failed")
