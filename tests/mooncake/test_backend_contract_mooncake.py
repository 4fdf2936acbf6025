"""The backend contract, unchanged, against a real Mooncake cluster."""

from __future__ import annotations

import pytest
from kvtag_store.backends.base import BlockAddress, BlockBackend
from kvtag_store.backends.mooncake.backend import MooncakeBackend
from kvtag_store.backends.mooncake.census import MooncakeCensus
from kvtag_store.backends.mooncake.client import MooncakeClient
from kvtag_store.backends.mooncake.format import HEADER_BYTES, object_key

from tests.contract.backend_contract import MODE_A, BackendContract, Pair


def corrupt_object(raw_client: MooncakeClient, namespace_id: str, address: BlockAddress) -> None:
    """Flip one payload byte of a stored block behind kvtag's back (an injected fault)."""
    mkey = object_key(namespace_id, MODE_A, *address)
    value = bytearray(raw_client.get(mkey))
    assert value, "the block to corrupt is not stored"
    value[HEADER_BYTES] ^= 0xFF
    assert raw_client.batch_remove([mkey], True) == [0]
    assert raw_client.put(mkey, bytes(value)) == 0


class TestMooncakeBackendContract(BackendContract):
    @pytest.fixture
    def backend(self, mooncake_backend: MooncakeBackend, mooncake_census: MooncakeCensus) -> Pair:
        return mooncake_backend, mooncake_census

    @pytest.fixture(autouse=True)
    def _raw(self, raw_client: MooncakeClient) -> None:
        self.raw_client = raw_client

    def corrupt_stored_value(self, backend: BlockBackend, namespace_id: str, address: BlockAddress) -> None:
        corrupt_object(self.raw_client, namespace_id, address)
