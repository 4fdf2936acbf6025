"""The hand-written codecs' view of the schema, pinned against the generated descriptors.

kvtag_store.api.codec (Lookup and Put parsing, Get encoding) and kvtag_client.inline.put_encoding (Put
encoding)
write field numbers and wire types by hand, and the Put parser skips fields it does not know. A field
added to one of these messages would pass their hypothesis tests, which only build known fields,
and be dropped silently. So every message they touch is pinned here in full: a change to the proto
fails this test until the codecs (and then this table) are updated with it.
"""

from __future__ import annotations

import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from kvtag.v1 import store_pb2 as pb
from kvtag_store.backends.base import KeyStatus

VARINT, LENGTH_DELIMITED = 0, 2
_WIRE_TYPE = {
    FieldDescriptor.TYPE_UINT32: VARINT,
    FieldDescriptor.TYPE_ENUM: VARINT,
    FieldDescriptor.TYPE_STRING: LENGTH_DELIMITED,
    FieldDescriptor.TYPE_BYTES: LENGTH_DELIMITED,
    FieldDescriptor.TYPE_MESSAGE: LENGTH_DELIMITED,
}

# message -> {field name: (number, wire type, repeated, message or enum type name or "")}
PINNED: dict[str, dict[str, tuple[int, int, bool, str]]] = {
    # wire.parse_lookup (fast path: fields 1-3 in order; anything else goes to the generated parser)
    "LookupRequest": {
        "session_id": (1, LENGTH_DELIMITED, False, ""),
        "blocks": (2, LENGTH_DELIMITED, True, "kvtag.v1.BlockRef"),
        "lease_ms": (3, VARINT, False, ""),
        "packed_blocks": (4, LENGTH_DELIMITED, True, "kvtag.v1.PackedBlocks"),
    },
    # Lookup's packed form: StoreClient builds it, wire.split_keys cuts `keys`.
    "PackedBlocks": {
        "key_length": (1, VARINT, False, ""),
        "keys": (2, LENGTH_DELIMITED, False, ""),
        "group": (3, VARINT, False, ""),
        "base_keys": (4, LENGTH_DELIMITED, False, ""),
        "token_ids": (5, LENGTH_DELIMITED, False, ""),
    },
    "LookupResponse": {
        "prefix_length": (1, VARINT, False, ""),
        "statuses": (2, LENGTH_DELIMITED, True, "kvtag.v1.KeyStatus"),  # packed repeated enum
        "lease": (3, LENGTH_DELIMITED, False, "kvtag.v1.Lease"),
        "packed_statuses": (4, LENGTH_DELIMITED, False, ""),
    },
    # wire.parse_lookup's strided check (0x12 len 0x0a len key) and wire._parse_block;
    # put_encoding writes 0x0a key, 0x10 group, 0x1a base_key, 0x22 token_ids.
    "BlockRef": {
        "key": (1, LENGTH_DELIMITED, False, ""),
        "group": (2, VARINT, False, ""),
        "base_key": (3, LENGTH_DELIMITED, False, ""),
        "token_ids": (4, LENGTH_DELIMITED, False, ""),
    },
    # codec.parse_put / put_encoding: 0x0a session_id, 0x12 items.
    "PutRequest": {
        "session_id": (1, LENGTH_DELIMITED, False, ""),
        "items": (2, LENGTH_DELIMITED, True, "kvtag.v1.PutItem"),
    },
    # wire._parse_put_item / put_encoding: 0x0a block, 0x12 value, 0x1a shared_memory.
    "PutItem": {
        "block": (1, LENGTH_DELIMITED, False, "kvtag.v1.BlockRef"),
        "value": (2, LENGTH_DELIMITED, False, ""),
        "shared_memory": (3, LENGTH_DELIMITED, False, "kvtag.v1.SharedMemoryRef"),
    },
    # wire.encode_get_results: 0x0a result{0x08 status, 0x12 value}.
    "GetResponse": {"results": (1, LENGTH_DELIMITED, True, "kvtag.v1.GetResult")},
    "GetResult": {
        "status": (1, VARINT, False, "kvtag.v1.KeyStatus"),
        "value": (2, LENGTH_DELIMITED, False, ""),
    },
}


def _shape(message: Descriptor) -> dict[str, tuple[int, int, bool, str]]:
    shape: dict[str, tuple[int, int, bool, str]] = {}
    for f in message.fields:
        type_name = (
            f.message_type.full_name if f.message_type else f.enum_type.full_name if f.enum_type else ""
        )
        wire_type = LENGTH_DELIMITED if f.is_packed else _WIRE_TYPE[f.type]
        shape[f.name] = (f.number, wire_type, f.is_repeated, type_name)
    return shape


@pytest.mark.parametrize("name", sorted(PINNED))
def test_hand_written_codecs_match_the_schema(name: str) -> None:
    assert _shape(pb.DESCRIPTOR.message_types_by_name[name]) == PINNED[name], (
        f"kvtag.v1.{name} changed under the hand-written codecs (kvtag_store/wire.py, "
        "kvtag_client/put_encoding.py, Lookup's packed form): update them for the new shape, then this table"
    )


def test_put_item_payload_is_one_oneof() -> None:
    payload = pb.PutItem.DESCRIPTOR.oneofs_by_name["payload"]
    assert [f.name for f in payload.fields] == ["value", "shared_memory"]


def test_key_status_values_are_the_bytes_the_codecs_write() -> None:
    # wire._BARE, packed_statuses (one byte per block) and backends.base.KeyStatus share these numbers.
    assert {v.name: v.number for v in pb.KeyStatus.DESCRIPTOR.values} == {
        "KEY_STATUS_UNSPECIFIED": 0,
        "HIT": 1,
        "MISS": 2,
        "MODE_MISMATCH": 3,
    }
    assert {s.name: int(s) for s in KeyStatus} == {"HIT": 1, "MISS": 2, "MODE_MISMATCH": 3}
