"""The base-key index: which modes stored a block, by its legacy (L=0) canonical key.

It lets Lookup say "mode M missed, but mode M' holds this block". It is
bounded (oldest entries leave first) and records what was stored, not what
is still resident, so a count can include a block evicted since; it is a
diagnostic, never consulted for data.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable

# (namespace_id, group, base_key)
_BaseAddress = tuple[str, int, bytes]


class BaseKeyIndex:
    def __init__(self, max_entries: int) -> None:
        self._max = max_entries
        self._lock = threading.Lock()
        # Insertion-ordered dict as a FIFO; value: the mode_ids that stored the block.
        self._holders: dict[_BaseAddress, tuple[str, ...]] = {}

    def record(self, namespace_id: str, mode_id: str, items: Iterable[tuple[int, bytes]]) -> None:
        with self._lock:
            holders = self._holders
            for group, base_key in items:
                address = (namespace_id, group, base_key)
                modes = holders.get(address)
                if modes is None:
                    holders[address] = (mode_id,)
                    if len(holders) > self._max:
                        del holders[next(iter(holders))]
                elif mode_id not in modes:
                    holders[address] = (*modes, mode_id)

    def other_holders(
        self, namespace_id: str, mode_id: str, items: Iterable[tuple[int, bytes]]
    ) -> Counter[str]:
        """For each missed block, the first other mode that stored it: counts per holding mode."""
        counts: Counter[str] = Counter()
        with self._lock:
            for group, base_key in items:
                modes = self._holders.get((namespace_id, group, base_key))
                if modes:
                    for other in modes:
                        if other != mode_id:
                            counts[other] += 1
                            break
        return counts

    def __len__(self) -> int:
        return len(self._holders)
