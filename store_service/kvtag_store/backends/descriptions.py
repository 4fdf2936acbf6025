"""One replica's record of what its namespaces and modes are (CensusStore.describe, in process): kept
by the in-process census stores (memory, and the snapshot on a disk dir), which forget a namespace's
descriptions with its records."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any, Protocol


class _Record(Protocol):
    def describe(
        self, namespace_id: str, model_key: str, namespace: bytes, mode_id: str, mode: bytes
    ) -> Any: ...
    def described_modes(self, namespace_id: str, mode_ids: Iterable[str]) -> dict[str, bytes]: ...
    def namespaces_of(self, model_key: str) -> dict[str, bytes]: ...


class DescribedCensus:
    """CensusStore's three describe verbs, answered by the record a census store keeps in
    `descriptions` (in process for memory, in the cluster for Mooncake)."""

    descriptions: _Record

    def describe(
        self, namespace_id: str, model_key: str, namespace: bytes, mode_id: str, mode: bytes
    ) -> None:
        self.descriptions.describe(namespace_id, model_key, namespace, mode_id, mode)

    def described_modes(self, namespace_id: str, mode_ids: Iterable[str]) -> dict[str, bytes]:
        return self.descriptions.described_modes(namespace_id, mode_ids)

    def namespaces_of(self, model_key: str) -> dict[str, bytes]:
        return self.descriptions.namespaces_of(model_key)


class Descriptions:
    """One replica's record of what its namespaces and modes are (CensusStore.describe): the
    descriptor of each namespace by model, and each mode's encoding by namespace."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.namespaces: dict[str, tuple[str, bytes]] = {}  # namespace_id -> (model_key, descriptor)
        self.models: dict[str, set[str]] = {}  # model_key -> namespace ids
        self.modes: dict[str, dict[str, bytes]] = {}  # namespace_id -> mode_id -> encoding

    def describe(
        self, namespace_id: str, model_key: str, namespace: bytes, mode_id: str, mode: bytes
    ) -> bool:
        """Record them; True if anything was new."""
        with self._lock:
            new = namespace_id not in self.namespaces
            if new:
                self.namespaces[namespace_id] = (model_key, namespace)
                self.models.setdefault(model_key, set()).add(namespace_id)
            modes = self.modes.setdefault(namespace_id, {})
            if mode_id not in modes:
                modes[mode_id] = mode
                new = True
            return new

    def described_modes(self, namespace_id: str, mode_ids: Iterable[str]) -> dict[str, bytes]:
        with self._lock:
            modes = self.modes.get(namespace_id, {})
            return {m: modes[m] for m in mode_ids if m in modes}

    def namespaces_of(self, model_key: str) -> dict[str, bytes]:
        with self._lock:
            return {ns_id: self.namespaces[ns_id][1] for ns_id in self.models.get(model_key, ())}

    def forget(self, namespace_id: str) -> bool:
        """Drop the namespace's descriptions; True if there were any."""
        with self._lock:
            self.modes.pop(namespace_id, None)
            described = self.namespaces.pop(namespace_id, None)
            if described is None:
                return False
            members = self.models.get(described[0])
            if members is not None:
                members.discard(namespace_id)
                if not members:
                    del self.models[described[0]]
            return True
