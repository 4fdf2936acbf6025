"""How StoreClient cuts a large put into messages: every item once, in order, within Limits."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from kvtag.v1 import store_pb2 as pb
from kvtag_client import keys
from kvtag_client.inline.transfer import ITEM_OVERHEAD
from kvtag_client.store import StoreClient

from tests.descriptors import namespace
from tests.net import free_port


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 5000), max_size=60),
    max_batch_items=st.integers(1, 9),
    target=st.integers(100, 8000),
)
def test_put_messages_cover_every_item_once_within_limits(
    sizes: list[int], max_batch_items: int, target: int
) -> None:
    client = StoreClient(
        f"127.0.0.1:{free_port()}",  # never contacted: batching is local
        engine_id="batching",
        namespace=namespace(),
        mode=keys.mode(16, 0),
        probe_keys=keys.probe_keys(16, 0),
    )
    try:
        client.limits = pb.Limits(
            max_key_bytes=64, max_batch_items=max_batch_items, max_message_bytes=1 << 20
        )
        items = [(0, n.to_bytes(4, "big"), b"v" * size, b"") for n, size in enumerate(sizes)]
        messages = list(client.inline.put_messages(items, list(range(len(items))), target))
        assert [n for message in messages for n in message] == list(range(len(items)))
        for message in messages:
            assert 0 < len(message) <= max_batch_items
            size = sum(len(items[n][1]) + len(items[n][2]) + ITEM_OVERHEAD for n in message)
            assert size <= target or len(message) == 1
    finally:
        client.close()
