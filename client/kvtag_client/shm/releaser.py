"""The read-lease releaser: a GetReferences pins its hits under a lease that is released without
waiting, either carried by the next GetReferences or sent in batches by one long-lived thread."""

from __future__ import annotations

import threading

from kvtag_client.calls import Caller

# How long a read lease waits for the next GetReferences to carry its release before the
# releaser thread sends it alone: a get in a steady stream then costs one RPC, and a pin
# outlives its copy by at most this much.
_RELEASE_DELAY_S = 0.02


class LeaseReleaser:
    """Read leases waiting to be released, and the one thread that sends them (a grpc future per
    release would start a polling thread each time)."""

    def __init__(self, caller: Caller, closed: threading.Event) -> None:
        self.caller = caller
        self._closed = closed
        self._lock = threading.Lock()
        self._pending: list[str] = []
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def take_pending(self) -> str:
        """A pending lease for the next GetReferences to carry, or "" when none waits."""
        with self._lock:
            return self._pending.pop() if self._pending else ""

    def release_soon(self, lease_id: str) -> None:
        """Release a read lease without waiting: the next GetReferences carries it, or after
        _RELEASE_DELAY_S the releaser thread sends the pending ids in one ReleaseLeases."""
        with self._lock:
            self._pending.append(lease_id)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._release_forever, name="kvtag-release", daemon=True
                )
                self._thread.start()
        self._wake.set()

    def is_alive(self) -> bool:
        """True while the releaser thread runs."""
        with self._lock:
            thread = self._thread
        return thread is not None and thread.is_alive()

    def stop(self) -> None:
        """End the thread once the client is closing (`closed` is set): its call in flight ends before
        the channel closes. What is still pending dies with the session."""
        self._wake.set()
        with self._lock:
            thread = self._thread
        if thread is not None:
            thread.join(timeout=self.caller.session.rpc_timeout_s + 1.0)

    def _release_forever(self) -> None:
        while True:
            self._wake.wait(1.0)
            self._wake.clear()
            if self._closed.is_set() or self._closed.wait(_RELEASE_DELAY_S):
                return  # CloseSession releases what is still pending
            with self._lock:
                lease_ids, self._pending = tuple(self._pending), []
            if lease_ids:
                self.caller.release(lease_ids)  # best effort: leases also expire, and die with the session
