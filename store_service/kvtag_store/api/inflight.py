"""Server-wide admission: a bound on the request and reply bytes the handlers hold at once.

Why: gRPC hands each worker thread a whole message (up to --max-message-bytes)
and parsing or answering it costs a multiple of its size (Python objects per
item, a copy of every value). Without a bound, a few large requests arriving
together cost several times the store's capacity. Every handler charges its
estimated cost here before it builds anything; a charge that would pass the
limit is refused at once with RESOURCE_EXHAUSTED / SERVER_BUSY and a retry
hint, never queued (a queue would hold the bytes it means to bound).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from kvtag_store import errors

# Cost of one parsed batch item (a key bytes object, its address tuple and list slot, a result
# message): a bound above the measured cost, so a charge never falls short of what is held.
ITEM_COST = 256
# Every message is held twice while it is handled: the received bytes and what is cut out of them
# (values, keys), or the encoded reply and the values it was built from.
COPIES = 2
RETRY_DELAY_MS = 50


class InflightBudget:
    def __init__(self, limit_bytes: int) -> None:
        self.limit = limit_bytes
        self._held = 0
        self._lock = threading.Lock()

    @property
    def held(self) -> int:
        return self._held

    @contextmanager
    def hold(self, nbytes: int) -> Iterator[None]:
        """Hold `nbytes` for the duration of the block, or raise SERVER_BUSY without waiting.
        A charge above the limit is still admitted when nothing else is held, so one large
        (already size-checked) request can always make progress."""
        with self._lock:
            held = self._held
            if held and held + nbytes > self.limit:
                raise errors.server_busy(held, nbytes, self.limit, RETRY_DELAY_MS)
            self._held = held + nbytes
        try:
            yield
        finally:
            with self._lock:
                self._held -= nbytes


def request_cost(size: int, items: int) -> int:
    """Bytes a request of `size` wire bytes and `items` batch items holds while it is handled."""
    return COPIES * size + ITEM_COST * items
