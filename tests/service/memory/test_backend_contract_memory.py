"""The backend contract, run against the embedded memory backend (its arenas in shared memory, so
the shared-memory capability is tested too)."""

from __future__ import annotations

from pathlib import Path

import pytest
from kvtag_store.backends.base import BlockAddress, BlockBackend, Capabilities
from kvtag_store.backends.memory import MemoryBackend, MemoryCensus

from tests.contract.backend_contract import BackendContract, Pair

from ..faults import corrupt_memory_value


class TestMemoryBackendContract(BackendContract):
    @pytest.fixture
    def backend(self, tmp_path: Path) -> Pair:
        return MemoryBackend(4 << 20, shm_dir=str(tmp_path)), MemoryCensus()

    def corrupt_stored_value(self, backend: BlockBackend, namespace_id: str, address: BlockAddress) -> None:
        assert isinstance(backend, MemoryBackend)
        corrupt_memory_value(backend, namespace_id, address)

    def test_memory_backend_offers_every_capability(self) -> None:
        store = MemoryBackend(1 << 20)
        # Built from the concrete class, so mypy also checks it against every Protocol's signatures.
        expected = Capabilities(store, store, store, store, store, store, store, store, store)
        assert Capabilities.of(store) == expected
