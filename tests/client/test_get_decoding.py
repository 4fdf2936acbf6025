"""The hand-read GetResponse gives exactly what the generated parser gives, for any bytes."""

from __future__ import annotations

import pytest
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st
from kvtag.v1 import store_pb2 as pb
from kvtag_client.get_decoding import GetResultFields, decode_get_response
from kvtag_store import wire
from kvtag_store.backends.base import KeyStatus, ReadResult


def _generated(data: bytes) -> list[GetResultFields]:
    return [(r.status, r.value) for r in pb.GetResponse.FromString(data).results]


_results = st.lists(
    st.tuples(
        st.one_of(st.sampled_from([0, 1, 2, 3]), st.integers(-(2**31), 2**31 - 1)),
        st.one_of(st.binary(max_size=200), st.binary(min_size=126, max_size=20000)),
    ),
    max_size=10,
)


@settings(max_examples=300, deadline=None)
@given(results=_results)
def test_generated_responses_decode_to_the_same_fields(results: list[GetResultFields]) -> None:
    data = pb.GetResponse(
        results=[pb.GetResult(status=s, value=v) for s, v in results]  # type: ignore[arg-type]
    ).SerializeToString()
    assert decode_get_response(data) == results


@settings(max_examples=200, deadline=None)
@given(hits=st.lists(st.one_of(st.none(), st.binary(max_size=3000)), max_size=12))
def test_the_servers_hand_encoded_replies_decode_to_their_values(hits: list[bytes | None]) -> None:
    reads = [ReadResult(KeyStatus.MISS) if v is None else ReadResult(KeyStatus.HIT, v) for v in hits]
    decoded = decode_get_response(wire.encode_get_results(reads))
    assert decoded == [(int(pb.MISS), b"") if v is None else (int(pb.HIT), v) for v in hits]


@settings(max_examples=1000, deadline=None)
@given(data=st.binary(max_size=60))
def test_arbitrary_bytes_decode_or_fail_exactly_like_the_generated_parser(data: bytes) -> None:
    try:
        expected = _generated(data)
    except DecodeError:
        with pytest.raises(DecodeError):
            decode_get_response(data)
        return
    assert decode_get_response(data) == expected


@pytest.mark.parametrize(
    "data",
    [
        # status and value repeated inside one result: the last occurrence wins
        b"\x0a\x0b\x08\x01\x12\x02ab\x08\x02\x12\x01c",
        # unknown fields at both levels, and fields out of number order
        b"\x0a\x0c\x12\x01x\x18\x05\x08\x01\x25\x00\x00\x00\x00" + b"\x10\x07",
        # a negative status (10-byte varint)
        b"\x0a\x0b\x08" + b"\xff" * 9 + b"\x01",
        # a result with no fields at all
        b"\x0a\x00",
    ],
)
def test_protobuf_merge_rules_match_the_generated_parser(data: bytes) -> None:
    assert decode_get_response(data) == _generated(data)


@settings(max_examples=1000, deadline=None)
@given(results=_results, data=st.data())
def test_damaged_responses_decode_or_fail_exactly_like_the_generated_parser(
    results: list[GetResultFields], data: st.DataObject
) -> None:
    encoded = bytearray(
        pb.GetResponse(
            results=[pb.GetResult(status=s, value=v[:40]) for s, v in results]  # type: ignore[arg-type]
        ).SerializeToString()
    )
    if encoded:
        at = data.draw(st.integers(0, len(encoded) - 1))
        encoded[at] = data.draw(st.integers(0, 255))
        encoded = encoded[: data.draw(st.integers(0, len(encoded)))]
    damaged = bytes(encoded)
    try:
        expected = _generated(damaged)
    except DecodeError:
        with pytest.raises(DecodeError):
            decode_get_response(damaged)
        return
    assert decode_get_response(damaged) == expected
