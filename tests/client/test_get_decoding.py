"""The hand-read GetResponse (kvtag_client.inline.get_decoding) is exactly what the generated parser reads."""

from __future__ import annotations

import pytest
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st
from kvtag.v1 import store_pb2 as pb
from kvtag_client.inline.get_decoding import decode_get_response
from kvtag_store.api import codec
from kvtag_store.backends.base import KeyStatus, ReadResult


def _generated(data: bytes) -> list[tuple[int, bytes]]:
    return [(r.status, r.value) for r in pb.GetResponse.FromString(data).results]


served = st.lists(
    st.one_of(
        st.builds(ReadResult, st.just(KeyStatus.HIT), st.binary(max_size=3000)),
        st.builds(ReadResult, st.sampled_from([KeyStatus.MISS, KeyStatus.MODE_MISMATCH])),
    ),
    max_size=12,
)


@settings(max_examples=200, deadline=None)
@given(results=served)
def test_server_replies_decode_like_the_generated_parser(results: list[ReadResult]) -> None:
    data = codec.encode_get_results(results)
    assert decode_get_response(data) == _generated(data)
    assert [v for _, v in decode_get_response(data)] == [r.value or b"" for r in results]


any_results = st.lists(
    st.builds(pb.GetResult, status=st.integers(0, 2**31 - 1), value=st.binary(max_size=300)), max_size=8
)


@settings(max_examples=200, deadline=None)
@given(results=any_results)
def test_any_get_response_decodes_like_the_generated_parser(results: list[pb.GetResult]) -> None:
    data = pb.GetResponse(results=results).SerializeToString()
    assert decode_get_response(data) == _generated(data)


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=60))
def test_arbitrary_bytes_decode_like_the_generated_parser_or_fail_like_it(data: bytes) -> None:
    try:
        expected = _generated(data)
    except DecodeError:
        with pytest.raises(DecodeError):
            decode_get_response(data)
        return
    assert decode_get_response(data) == expected
