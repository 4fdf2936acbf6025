"""The base-key index: which modes stored a block, by its legacy (L=0) canonical key.

It lets Lookup say "mode M missed, but mode M' holds this block". It is
bounded (oldest entries leave first) and records what was stored, not what
is still resident, so a count can include a block evicted since; it is a
diagnostic, never consulted for data.

An entry is keyed by the 64-bit hash of (namespace, group, base key) and holds the storing mode's
id (the session's own string) or, rarely, a tuple of them: ~80 bytes where the address and a tuple
per entry cost ~240, so the default 200,000 entries hold ~16 MiB. Two addresses sharing a hash
(about one chance in 10^9 at 200,000 entries) would at worst miscount a cross-mode miss.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable

# One mode's id, or the ids of every mode that stored the block.
_Holders = str | tuple[str, ...]


class BaseKeyIndex:
    def __init__(self, max_entries: int) -> None:
        self._max = max_entries
        self._lock = threading.Lock()
        # Insertion-ordered dict as a FIFO.
        self._holders: dict[int, _Holders] = {}

    def record(self, namespace_id: str, mode_id: str, items: Iterable[tuple[int, bytes]]) -> None:
        with self._lock:
            holders = self._holders
            for group, base_key in items:
                address = hash((namespace_id, group, base_key))
                modes = holders.get(address)
                if modes is None:
                    holders[address] = mode_id
                    if len(holders) > self._max:
                        del holders[next(iter(holders))]
                elif isinstance(modes, str):
                    if modes != mode_id:
                        holders[address] = (modes, mode_id)
                elif mode_id not in modes:
                    holders[address] = (*modes, mode_id)

    def other_holders(
        self, namespace_id: str, mode_id: str, items: Iterable[tuple[int, bytes]]
    ) -> Counter[str]:
        """For each missed block, the first other mode that stored it: counts per holding mode."""
        counts: Counter[str] = Counter()
        with self._lock:
            for group, base_key in items:
                modes = self._holders.get(hash((namespace_id, group, base_key)))
                if modes is None:
                    continue
                for other in (modes,) if isinstance(modes, str) else modes:
                    if other != mode_id:
                        counts[other] += 1
                        break
        return counts

    def __len__(self) -> int:
        return len(self._holders)
