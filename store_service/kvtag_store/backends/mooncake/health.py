"""The cluster's health as the backend sees it: a breaker for the master, suspect storage processes.

Mooncake's calls return codes rather than raise, and a failed master costs each call seconds of
retries. `MasterBreaker.screen` is the one place a call's codes are read for a master failure
(answered UNAVAILABLE at once until a background probe finds the master again) and counted.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Container, Sequence

from kvtag_store.backends.base import BackendUnavailable
from kvtag_store.backends.mooncake.errors import ErrorCounters, MooncakeCode, describe

log = logging.getLogger(__name__)

# The prober's pause between two probes: a short floor only, since a probe of a master that does
# not answer already waits seconds inside Mooncake's retries.
PROBE_PAUSE_S = 0.05
# The breaker answers UNAVAILABLE on evidence at most this old (a call's or a probe's failure). A
# probe fails within ~5 s, so older evidence means the prober hangs in one Mooncake call: calls
# then go to Mooncake again and find the master for themselves, rather than never.
EVIDENCE_S = 15.0
# How long a storage process that failed a transfer is skipped by reads (the master's default
# --client_ttl is 10 s); afterwards one read probes it again.
SUSPECT_S = 5.0
# Codes of a call the master did not answer: refused or reset (RPC_FAIL) or not in time (RPC_TIMEOUT).
MASTER_DOWN: tuple[int, ...] = (MooncakeCode.RPC_FAIL, MooncakeCode.RPC_TIMEOUT)
_RPC_FAIL = MooncakeCode.RPC_FAIL


class MasterBreaker:
    """Open from the first call that found the master down until one background probe finds it
    answering again.

    With the master down, Mooncake's client spends seconds retrying each call (~4.4 s of refused
    connections). While open, calls are answered UNAVAILABLE at once instead of queueing behind
    those retries, and a single prober thread waits them out in their place: the breaker closes as
    soon as the client reaches the master again (after a failover, within about a second of the
    new leader serving: Mooncake's client retries its switch once a second), not after a fixed
    window plus whatever a caller let through was still blocked for.

    `probe` makes one cheap call to the master through the same client and says whether it
    answered; it is the existence check every read and write path starts with, so while it does
    not answer neither would they.
    """

    def __init__(self, master: str, errors: ErrorCounters, probe: Callable[[], bool]) -> None:
        self._master = master
        self._errors = errors
        self._probe = probe
        self._lock = threading.Lock()
        # When a call or probe last found the master down; None while the breaker is closed.
        self._down_at: float | None = None
        self._prober: threading.Thread | None = None
        self._stop = threading.Event()

    @property
    def is_open(self) -> bool:
        """Whether the master is taken for down (until a probe finds it answering)."""
        return self._down_at is not None

    def check(self, what: str) -> None:
        """Raise UNAVAILABLE while the master is known down (`what`: the call not made)."""
        down_at = self._down_at
        if down_at is not None and time.monotonic() - down_at < EVIDENCE_S:
            raise BackendUnavailable(
                f"Mooncake master {self._master} is not answering; not {what} until it does "
                "(kvtag probes it in the background), retry with backoff"
            )

    def screen(
        self,
        codes: Sequence[int],
        what: str,
        *,
        counted_unless: Container[int] | None = None,
        master_down: Sequence[int] = MASTER_DOWN,
    ) -> None:
        """Read one call's return codes: any of `master_down` among them opens the breaker and raises
        UNAVAILABLE (counted once, as a master RPC failure); otherwise each code not in
        `counted_unless` is counted (none is when it is None)."""
        for down in master_down:
            if down in codes:
                self._errors.add(_RPC_FAIL)
                self._trip()
                named = down if down in MASTER_DOWN else _RPC_FAIL  # batch_is_exist's -1: a failed RPC
                raise BackendUnavailable(
                    f"Mooncake master {self._master} unreachable while {what} ({describe(named)}); "
                    "retry with backoff, kvtag resumes when the master is back"
                )
        if counted_unless is not None:
            for code in codes:
                if code not in counted_unless:
                    self._errors.add(code)

    def close(self) -> None:
        """Stop the prober (before the client closes: it may be inside a call, up to one probe)."""
        self._stop.set()
        with self._lock:
            prober = self._prober
        if prober is not None:
            prober.join(timeout=10)

    def _trip(self) -> None:
        """Open (or keep open) the breaker and make sure one prober runs."""
        with self._lock:
            self._down_at = time.monotonic()
            if self._prober is not None or self._stop.is_set():
                return
            self._prober = threading.Thread(
                target=self._probe_until_up, name="kvtag-master-probe", daemon=True
            )
            self._prober.start()
        log.warning(
            "Mooncake master %s not answering; calls answered UNAVAILABLE until it does", self._master
        )

    def _probe_until_up(self) -> None:
        opened = time.monotonic()
        logged = False
        while not self._stop.wait(PROBE_PAUSE_S):
            started = time.monotonic()
            try:
                up = self._probe()
            except Exception:  # the prober must outlive one bad probe, or the breaker never closes
                if not logged:
                    log.exception("probing the Mooncake master failed (logged once per outage)")
                    logged = True
                up = False
            with self._lock:
                if not up:
                    self._down_at = time.monotonic()
                    continue
                if self._down_at is not None and self._down_at > started:
                    continue  # a call found it down while this probe ran: probe again
                self._down_at = None
                self._prober = None
            log.info("Mooncake master %s answers again after %.1f s", self._master, time.monotonic() - opened)
            return
        with self._lock:
            self._prober = None


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
