"""Mooncake return codes and what kvtag makes of them.

Mooncake's Python calls return negative integers rather than raising. Each
code kvtag meets is named here once, with the kvtag outcome it maps to, so the
mapping in docs/mooncake.md and the counters in stats stay one table.
"""

from __future__ import annotations

import enum
import threading
from collections import Counter


class MooncakeCode(enum.IntEnum):
    OK = 0
    # No segment has room (eviction has not caught up, or every object is leased/pinned).
    NO_AVAILABLE_HANDLE = -200
    # The client's local transfer buffer cannot hold the value right now, or a range is out of bounds.
    BUFFER_OVERFLOW = -600
    # A put met a key that exists or whose first put is still in flight: judged by read-back.
    OBJECT_ALREADY_EXISTS = -703
    OBJECT_NOT_FOUND = -704
    OBJECT_HAS_LEASE = -706
    # The storage process holding a replica cannot be reached.
    TRANSFER_FAIL = -800
    # The master cannot be reached (refused, reset) / did not answer in time.
    RPC_FAIL = -900
    RPC_TIMEOUT = -901


# Counter names, exported as kvtag_backend_errors_total{kind=...}.
COUNTER_NAMES: dict[int, str] = {
    MooncakeCode.NO_AVAILABLE_HANDLE: "full",
    MooncakeCode.BUFFER_OVERFLOW: "buffer",
    MooncakeCode.OBJECT_ALREADY_EXISTS: "exists",
    MooncakeCode.OBJECT_NOT_FOUND: "missing",
    MooncakeCode.OBJECT_HAS_LEASE: "leased",
    MooncakeCode.TRANSFER_FAIL: "transfer",
    MooncakeCode.RPC_FAIL: "master_rpc",
}


def describe(code: int) -> str:
    try:
        return f"{MooncakeCode(code).name} ({code})"
    except ValueError:
        return f"Mooncake error {code}"


class ErrorCounters:
    """Thread-safe counts of the Mooncake codes this replica met, by counter name."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    def add(self, code: int, n: int = 1) -> None:
        name = COUNTER_NAMES.get(code, "other")
        with self._lock:
            self._counts[name] += n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)
