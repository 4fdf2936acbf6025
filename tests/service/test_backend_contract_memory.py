"""The backend contract, run against the embedded memory backend."""

from __future__ import annotations

import pytest
from kvtag_store.backends.base import BlockAddress, BlockBackend
from kvtag_store.backends.memory.backend import MemoryBackend, MemoryCensus

from tests.contract.backend_contract import BackendContract, Pair

from .faults import corrupt_memory_value


class TestMemoryBackendContract(BackendContract):
    @pytest.fixture
    def backend(self) -> Pair:
        return MemoryBackend(4 << 20), MemoryCensus()

    def corrupt_stored_value(self, backend: BlockBackend, namespace_id: str, address: BlockAddress) -> None:
        assert isinstance(backend, MemoryBackend)
        corrupt_memory_value(backend, namespace_id, address)
