"""The cluster's health as the backend sees it: a breaker for the master, suspect storage processes.

Mooncake's calls return codes rather than raise, and a failed master costs each call seconds of
retries. `MasterBreaker.screen` is the one place a call's codes are read for a master failure
(answered UNAVAILABLE at once for a short while) and counted.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Container, Sequence

from kvtag_store.backends.base import BackendUnavailable
from kvtag_store.backends.mooncake.errors import ErrorCounters, MooncakeCode, describe

# How long after a master failure calls are answered UNAVAILABLE without trying.
BREAKER_S = 1.0
# How long a storage process that failed a transfer is skipped by reads (the master's default
# --client_ttl is 10 s); afterwards one read probes it again.
SUSPECT_S = 5.0
_RPC_FAIL = MooncakeCode.RPC_FAIL


class MasterBreaker:
    """Answers UNAVAILABLE at once for BREAKER_S after the master failed.

    With the master down, Mooncake's client spends seconds retrying each call; answering at once
    for a short window keeps more callers from queueing behind those retries.
    """

    def __init__(self, master: str, errors: ErrorCounters) -> None:
        self._master = master
        self._errors = errors
        self._failed_at = -BREAKER_S

    def check(self, what: str) -> None:
        """Raise UNAVAILABLE if the master failed moments ago (`what`: the call not made)."""
        if time.monotonic() - self._failed_at < BREAKER_S:
            raise BackendUnavailable(
                f"Mooncake master {self._master} failed moments ago; not {what} for up to "
                f"{BREAKER_S:.0f} s, retry with backoff"
            )

    def screen(
        self,
        codes: Sequence[int],
        what: str,
        *,
        counted_unless: Container[int] | None = None,
        master_down: Sequence[int] = (_RPC_FAIL,),
    ) -> None:
        """Read one call's return codes: any of `master_down` among them opens the breaker and raises
        UNAVAILABLE (counted once, as a master RPC failure); otherwise each code not in
        `counted_unless` is counted (none is when it is None)."""
        for down in master_down:
            if down in codes:
                self._errors.add(_RPC_FAIL)
                self._failed_at = time.monotonic()
                raise BackendUnavailable(
                    f"Mooncake master {self._master} unreachable while {what} ({describe(_RPC_FAIL)}); "
                    "retry with backoff, kvtag resumes when the master is back"
                )
        if counted_unless is not None:
            for code in codes:
                if code not in counted_unless:
                    self._errors.add(code)


class SuspectProcesses:
    """Storage processes (transport endpoints) whose transfers just failed, remembered for SUSPECT_S:
    until the master's client TTL drops a dead one it still lists its objects, and reading each of
    them would wait out the transfer timeout again."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._since: dict[str, float] = {}

    def mark(self, endpoints: frozenset[str]) -> None:
        now = time.monotonic()
        with self._lock:
            for endpoint in endpoints:
                self._since[endpoint] = now

    def current(self) -> frozenset[str]:
        now = time.monotonic()
        with self._lock:
            for endpoint, since in list(self._since.items()):
                if now - since > SUSPECT_S:
                    del self._since[endpoint]
            return frozenset(self._since)
