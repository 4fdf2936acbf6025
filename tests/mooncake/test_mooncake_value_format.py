"""The value header: everything a replica needs to verify a block without the writer's memory."""

from __future__ import annotations

import pytest
from kvtag_store.backends.mooncake.format import (
    HEADER_BYTES,
    FormatError,
    census_key,
    decode_header,
    decode_record,
    directory_key,
    encode_header,
    encode_record,
    object_key,
    object_keys,
    verify_payload,
)

from tests.mooncake.legacy_keys import legacy_object_key

NS, MODE, KEY, PAYLOAD, NONCE = "ns-0123456789abcdef", "m-fedcba9876543210", b"\x01key", b"kv bytes", b"n" * 8


def stored() -> bytes:
    value: bytes = encode_header(NS, MODE, 3, KEY, PAYLOAD, NONCE) + PAYLOAD
    return value


def test_header_round_trips_mode_group_nonce_and_payload() -> None:
    header = decode_header(stored(), NS, 3, KEY)
    assert (header.mode_id, header.group, header.nonce) == (MODE, 3, NONCE)
    assert bytes(verify_payload(header, stored())) == PAYLOAD
    assert len(stored()) == HEADER_BYTES + len(PAYLOAD)


@pytest.mark.parametrize("offset", range(0, HEADER_BYTES, 7))
def test_any_flipped_header_byte_is_refused(offset: int) -> None:
    damaged = bytearray(stored())
    damaged[offset] ^= 0x40
    with pytest.raises(FormatError):
        decode_header(bytes(damaged), NS, 3, KEY)


def test_flipped_payload_byte_is_refused() -> None:
    damaged = bytearray(stored())
    damaged[-1] ^= 0x01
    header = decode_header(bytes(damaged), NS, 3, KEY)
    with pytest.raises(FormatError, match="checksum"):
        verify_payload(header, bytes(damaged))


def test_truncated_value_is_refused() -> None:
    header = decode_header(stored(), NS, 3, KEY)
    with pytest.raises(FormatError):
        verify_payload(header, stored()[:-1])
    with pytest.raises(FormatError):
        decode_header(stored()[: HEADER_BYTES - 1], NS, 3, KEY)


@pytest.mark.parametrize(("ns", "group", "key"), [("ns-other", 3, KEY), (NS, 4, KEY), (NS, 3, b"\x01kex")])
def test_value_read_at_another_address_is_refused(ns: str, group: int, key: bytes) -> None:
    with pytest.raises(FormatError, match="another block address"):
        decode_header(stored(), ns, group, key)


def test_object_key_names_namespace_mode_and_group() -> None:
    assert object_key(NS, MODE, 3, KEY) == f"kvtag/v2/{NS}/{MODE}/g3/016b6579"
    # A mode with a "/" cannot make two addresses share a key (read from the right).
    assert object_key(NS, "a/g3", 3, KEY) == f"kvtag/v2/{NS}/a%2Fg3/g3/016b6579"
    assert object_key(NS, MODE, 3, KEY) != object_key(NS, "m-other", 3, KEY)
    assert directory_key(NS, 2) == f"kvtag/v2/{NS}/modes/2"
    # Blocks an older version wrote lived under v1 without the mode; census records still do.
    assert legacy_object_key(NS, 3, KEY) == f"kvtag/v1/{NS}/g3/016b6579"
    assert census_key(NS, "mode") == f"kvtag/v1/census/{NS}/mode"


def test_a_value_read_under_another_modes_key_is_refused() -> None:
    assert decode_header(stored(), NS, 3, KEY, MODE).mode_id == MODE
    with pytest.raises(FormatError, match="under mode m-other's key"):
        decode_header(stored(), NS, 3, KEY, "m-other")


def test_object_keys_of_a_batch_are_each_object_key() -> None:
    addresses = [(0, b"a"), (3, KEY), (0, b""), (12, b"\xff" * 32), (3, b"a")]
    assert object_keys(NS, MODE, addresses) == [object_key(NS, MODE, g, k) for g, k in addresses]
    assert object_keys(NS, MODE, []) == []


def test_census_record_checksum_guards_its_body() -> None:
    record = encode_record(b"established mode")
    assert decode_record(record) == b"established mode"
    with pytest.raises(FormatError):
        decode_record(record[:-1] + b"X")
