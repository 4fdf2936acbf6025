"""The hand-joined PutRequest is byte for byte what the generated code sends, and the server reads it back."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvtag.v1 import store_pb2 as pb
from kvtag_client.inline.put_encoding import PutItemFields, encode_put_request
from kvtag_proto.varint import encode_varint
from kvtag_store.api import codec

_items = st.lists(
    st.tuples(
        st.one_of(st.just(0), st.integers(0, 2**32 - 1), st.sampled_from([1, 127, 128, 16383, 16384])),
        st.binary(max_size=300),
        st.one_of(st.binary(max_size=200), st.binary(min_size=126, max_size=20000)),
        st.one_of(st.just(b""), st.binary(max_size=300)),
    ),
    max_size=12,
)


def _generated(session_id: str, items: list[PutItemFields]) -> bytes:
    message = pb.PutRequest(
        session_id=session_id,
        items=[
            pb.PutItem(block=pb.BlockRef(key=key, group=group, base_key=base_key), value=value)
            for group, key, value, base_key in items
        ],
    )
    encoded: bytes = message.SerializeToString(deterministic=True)
    return encoded


@settings(max_examples=400, deadline=None)
@given(session_id=st.one_of(st.just(""), st.text(max_size=40)), items=_items)
def test_encoding_equals_generated_serialization(session_id: str, items: list[PutItemFields]) -> None:
    assert encode_put_request(session_id, items) == _generated(session_id, items)


@settings(max_examples=200, deadline=None)
@given(session_id=st.text(min_size=1, max_size=40), items=_items)
def test_server_parser_reads_back_every_field(session_id: str, items: list[PutItemFields]) -> None:
    batch = codec.parse_put(encode_put_request(session_id, items))
    assert batch.session_id == session_id
    assert [(i.group, i.key, i.value, i.base_key, i.payload) for i in batch.items] == [
        (group, key, value, base_key, "value") for group, key, value, base_key in items
    ]


@pytest.mark.parametrize("size", [0, 1, 127, 128, 16383, 16384, 2**21 - 1, 2**21, 1 << 20, 64 << 20])
def test_value_lengths_at_varint_boundaries_match_generated(size: int) -> None:
    items: list[PutItemFields] = [(7, b"k" * 32, b"\x00" * size, b"b" * 32)]
    assert encode_put_request("s", items) == _generated("s", items)


def test_varint_matches_protobuf_for_boundary_values() -> None:
    for value in (1, 127, 128, 255, 300, 16383, 16384, 2**31, 2**32 - 1):
        assert pb.BlockRef(group=value).SerializeToString() == b"\x10" + encode_varint(value)
    assert encode_varint(0) == b"\x00"
    assert encode_varint(2**63 - 1) == b"\xff" * 8 + b"\x7f"


def test_group_outside_uint32_is_refused() -> None:
    with pytest.raises(ValueError, match="uint32"):
        encode_put_request("s", [(2**32, b"k", b"v", b"")])
    with pytest.raises(ValueError, match="uint32"):
        encode_put_request("s", [(-1, b"k", b"v", b"")])
