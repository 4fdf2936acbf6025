"""Connector counters, exported through vLLM's KVConnectorStats hooks."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

COUNTERS = (
    "lookups",
    "lookups_waited",
    "hit_blocks",
    "miss_blocks",
    "hit_tokens",
    "saved_blocks",
    "saved_bytes",
    "loaded_blocks",
    "loaded_bytes",
    "load_errors",
    "dropped_saves",
    "degraded_calls",
    "audit_checked_blocks",
    "audit_mismatches",
    "unencodable_requests",
    "finish_jobs",
    "cancelled_jobs",
)


@dataclass
class KvtagStats(KVConnectorStats):  # type: ignore[misc, unused-ignore]  # Any without vLLM installed
    """Integer counters summed across workers and intervals."""

    data: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in COUNTERS:
            self.data.setdefault(name, 0)

    def reset(self) -> None:
        self.data = dict.fromkeys(COUNTERS, 0)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, value in other.data.items():
            if isinstance(value, int | float):
                self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return {name: self.data.get(name, 0) for name in COUNTERS}

    def is_empty(self) -> bool:
        return not any(self.data.get(name, 0) for name in COUNTERS)


class StatsRecorder:
    """Thread-safe counters; `take()` hands vLLM the interval's stats and starts a new interval.

    `totals` keeps the running sums for tests and logs.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._interval: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self.totals: dict[str, int] = dict.fromkeys(COUNTERS, 0)

    def add(self, name: str, amount: int = 1) -> None:
        """Count `amount` events of `name`; a name outside COUNTERS is a bug, not a new counter."""
        if name not in self.totals:
            raise KeyError(f"unknown kvtag connector counter {name!r}; known: {', '.join(COUNTERS)}")
        if amount == 0:
            return
        with self._lock:
            self._interval[name] += amount
            self.totals[name] += amount

    def take(self) -> KvtagStats | None:
        with self._lock:
            if not any(self._interval.values()):
                return None
            snapshot, self._interval = self._interval, dict.fromkeys(COUNTERS, 0)
        return KvtagStats(data=dict(snapshot))
