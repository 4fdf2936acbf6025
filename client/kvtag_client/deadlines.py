"""One deadline per public call: its re-open and retries share the bound the caller was promised."""

from __future__ import annotations

import time

from kvtag_client.errors import CallFailed


class Deadline:
    """One bound for a whole public call, shared by its re-open and retry."""

    def __init__(self, seconds: float) -> None:
        self.at = time.monotonic() + seconds

    def remaining(self) -> float:
        left = self.at - time.monotonic()
        if left <= 0:
            raise CallFailed("deadline exhausted")
        return left
