"""The census kept in process: first-writer-wins records for a single service replica."""

from __future__ import annotations

import threading

from kvtag_store.backends.base import ProbeRecord
from kvtag_store.backends.descriptions import DescribedCensus, Descriptions


class MemoryCensus(DescribedCensus):
    """CensusStore in process: first-writer-wins records for a single service replica. Forgets a
    namespace's records when the census forgets the namespace (policy.census.ForgettingCensusStore)."""

    descriptions: Descriptions

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._modes: dict[str, bytes] = {}
        self._probes: dict[str, dict[str, ProbeRecord]] = {}  # namespace -> mode -> reference
        self.descriptions = Descriptions()

    def establish_mode(self, namespace_id: str, mode_encoding: bytes) -> bytes:
        with self._lock:
            return self._modes.setdefault(namespace_id, mode_encoding)

    def reference_probe(self, namespace_id: str, mode_id: str, record: ProbeRecord) -> ProbeRecord:
        with self._lock:
            return self._probes.setdefault(namespace_id, {}).setdefault(mode_id, record)

    def forget_namespace(self, namespace_id: str) -> None:
        """Drop the namespace's first mode, probe references and descriptions: nothing of it is left
        for them to keep consistent or name, and a later session starts it afresh."""
        with self._lock:
            self._modes.pop(namespace_id, None)
            self._probes.pop(namespace_id, None)
        self.descriptions.forget(namespace_id)

    def namespaces_held(self) -> int:
        with self._lock:
            return len(self._modes.keys() | self._probes.keys())
