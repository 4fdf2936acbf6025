"""The hand-written wire paths (kvtag_store.api.codec) agree exactly with the generated protobuf code."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from kvtag.v1 import store_pb2 as pb
from kvtag_store.api import codec
from kvtag_store.backends.base import KeyStatus, ReadResult

u32 = st.integers(0, 2**32 - 1)
any_keys = st.binary(max_size=140)
refs = st.builds(pb.BlockRef, key=any_keys, group=u32, base_key=st.binary(max_size=40))


@st.composite
def uniform_plain_lookups(draw: st.DrawFn) -> pb.LookupRequest:
    """The common shape the fast path handles: keys of one length, group 0, no base keys."""
    length = draw(st.integers(1, 125))
    keys = draw(st.lists(st.binary(min_size=length, max_size=length), max_size=50))
    return pb.LookupRequest(
        session_id=draw(st.text(max_size=30)),
        blocks=[pb.BlockRef(key=k) for k in keys],
        lease_ms=draw(u32),
    )


any_lookups = st.builds(
    pb.LookupRequest, session_id=st.text(max_size=30), blocks=st.lists(refs, max_size=20), lease_ms=u32
)


def _expected(message: pb.LookupRequest) -> tuple[str, list[tuple[int, bytes]], int]:
    return message.session_id, [(b.group, b.key) for b in message.blocks], message.lease_ms


@settings(max_examples=150, deadline=None)
@given(message=uniform_plain_lookups())
def test_fast_lookup_parse_equals_the_generated_parser(message: pb.LookupRequest) -> None:
    batch = codec.parse_lookup(message.SerializeToString())
    assert (batch.session_id, batch.addresses, batch.lease_ms) == _expected(message)
    if message.blocks:
        assert batch.message is None, "the common shape must take the fast path"


@settings(max_examples=150, deadline=None)
@given(message=any_lookups)
def test_any_lookup_parses_like_the_generated_parser(message: pb.LookupRequest) -> None:
    batch = codec.parse_lookup(message.SerializeToString())
    assert (batch.session_id, batch.addresses, batch.lease_ms) == _expected(message)


def test_lookup_base_keys_are_read_only_when_sent() -> None:
    with_base = pb.LookupRequest(blocks=[pb.BlockRef(key=b"k1", base_key=b"b1"), pb.BlockRef(key=b"k2")])
    assert codec.parse_lookup(with_base.SerializeToString()).base_keys([0, 1]) == [(0, b"b1")]
    without = pb.LookupRequest(blocks=[pb.BlockRef(key=b"k1"), pb.BlockRef(key=b"k2")])
    assert codec.parse_lookup(without.SerializeToString()).base_keys([0, 1]) is None


put_items = st.one_of(
    st.builds(pb.PutItem, block=refs, value=st.binary(max_size=300)),
    st.builds(
        pb.PutItem, block=refs, shared_memory=st.builds(pb.SharedMemoryRef, segment=st.text(max_size=8))
    ),
    st.builds(pb.PutItem, block=refs),
)


@settings(max_examples=150, deadline=None)
@given(
    message=st.builds(pb.PutRequest, session_id=st.text(max_size=30), items=st.lists(put_items, max_size=8))
)
def test_put_parse_equals_the_generated_parser(message: pb.PutRequest) -> None:
    assert codec.parse_put(message.SerializeToString()) == codec.put_from_message(message)


results = st.lists(
    st.one_of(
        st.builds(ReadResult, st.just(KeyStatus.HIT), st.binary(max_size=300)),
        st.builds(ReadResult, st.sampled_from([KeyStatus.MISS, KeyStatus.MODE_MISMATCH])),
    ),
    max_size=10,
)


@settings(max_examples=150, deadline=None)
@given(read=results)
def test_get_response_bytes_equal_the_generated_serializer(read: list[ReadResult]) -> None:
    generated = pb.GetResponse(
        results=[pb.GetResult(status=int(r.status), value=r.value or b"") for r in read]  # type: ignore[arg-type]
    ).SerializeToString()
    assert codec.encode_get_results(read) == generated


def test_large_get_value_length_uses_a_multibyte_varint() -> None:
    value = bytes(range(256)) * 4096  # 1 MiB
    encoded = codec.encode_get_results([ReadResult(KeyStatus.HIT, value)])
    [result] = pb.GetResponse.FromString(encoded).results
    assert (result.status, result.value) == (pb.HIT, value)
