"""The thread that ends sessions whose heartbeat stopped and leases that ran out."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger("kvtag_store.api.reaper")


class Reaper:
    """Calls `reap` every `interval_s` until stopped; a failing call is logged and the next one runs."""

    def __init__(self, reap: Callable[[], None], interval_s: float) -> None:
        self._reap = reap
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def for_ttl(cls, reap: Callable[[], None], session_ttl_ms: int) -> Reaper:
        """Every quarter of the session TTL, at most every 0.25 s: a session ends soon after it expires."""
        return cls(reap, min(0.25, session_ttl_ms / 4000.0))

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvtag-reaper", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1)

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self._reap()
            except Exception:  # the reaper must outlive a bad backend call
                log.exception("reaping expired sessions failed")
