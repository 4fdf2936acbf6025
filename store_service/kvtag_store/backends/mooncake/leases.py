"""Mooncake read leases held on pinned objects for as long as kvtag's own leases pin them."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence

from kvtag_store.backends.mooncake.client import MooncakeClient

# Keys per existence check of one renewal round.
_BATCH = 4096


class LeaseKeeper:
    """Holds Mooncake read leases on pinned objects by re-reading their existence every ttl/3.

    Mooncake grants a lease (default 10 s, the master's --default_kv_lease_ttl)
    on every read or existence check and refuses to evict or remove a leased
    object; kvtag's leases are longer, so pinned keys are renewed until unpinned.
    """

    def __init__(self, client: MooncakeClient, lease_ttl_ms: int) -> None:
        self._client = client
        self._lock = threading.Lock()
        self._pins: Counter[str] = Counter()
        self._stop = threading.Event()
        self._period_s = max(lease_ttl_ms / 3000, 0.05)
        self._thread = threading.Thread(target=self._run, name="kvtag-mooncake-leases", daemon=True)
        self._thread.start()

    def pin(self, keys: Sequence[str]) -> None:
        with self._lock:
            self._pins.update(keys)

    def unpin(self, keys: Sequence[str]) -> None:
        with self._lock:
            for key in keys:
                if self._pins[key] <= 1:
                    self._pins.pop(key, None)
                else:
                    self._pins[key] -= 1

    def count(self) -> int:
        with self._lock:
            return len(self._pins)

    def _run(self) -> None:
        while not self._stop.wait(self._period_s):
            with self._lock:
                keys = list(self._pins)
            for start in range(0, len(keys), _BATCH):
                # A failure (master down) is retried next period; the lease may lapse meanwhile,
                # which costs a miss, never wrong bytes.
                self._client.batch_is_exist(keys[start : start + _BATCH])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
