"""Hand-written wire paths for the three hot RPCs, each exactly equivalent to the generated code.

Why: with the upb protobuf runtime, every element of a repeated message field
becomes a Python wrapper object when touched (~100-200 ns each) and every
bytes field is copied twice (into the arena, then out to a Python bytes).
That dominates a 4,096-key Lookup and 1 MiB Put/Get. So:

- Lookup requests in the v1 `blocks` form and its common shape (plain keys of
  one length, group 0, no base keys, fields in number order) are checked with
  strided byte compares and cut by slicing; any other shape falls back to the
  generated parser. The packed form (`packed_blocks`) needs no per-key message,
  so the generated parser reads it and split_keys cuts the keys in one C call.
- Put requests are walked by hand so each value is copied once; anything
  unexpected (groups, a repeated sub-message, bad UTF-8) falls back.
- Get responses are encoded by hand around the stored value objects, so the
  values are copied once, into the reply.

tests/service/test_wire.py checks all three against the generated code with
hypothesis.
"""

from __future__ import annotations

import bisect
import functools
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import repeat
from operator import attrgetter
from typing import Any

from kvtag.v1 import store_pb2 as pb
from kvtag_proto.varint import encode_varint

from kvtag_store.backends.base import BlockAddress, KeyStatus, ReadResult

_GROUP_KEY = attrgetter("group", "key")


class _Irregular(Exception):
    """The bytes are not in the shape the fast path handles; use the generated parser."""


class TooManyItems(Exception):
    """The request repeats its batch field more often than allowed; raised before any item is built."""

    def __init__(self, count: int | None) -> None:
        super().__init__(count)
        self.count = count  # exact when known, None for "more than the limit"


class Malformed(Exception):
    """The bytes do not frame as protobuf fields (the counting walk found no valid field boundary)."""


def _varint(data: bytes | memoryview, pos: int) -> tuple[int, int]:
    result = 0
    shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise _Irregular
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7


def _skip(data: bytes | memoryview, pos: int, wire_type: int) -> int:
    if wire_type == 0:
        return _varint(data, pos)[1]
    if wire_type == 1:
        pos += 8
    elif wire_type == 2:
        length, pos = _varint(data, pos)
        pos += length
    elif wire_type == 5:
        pos += 4
    else:
        raise _Irregular
    if pos > len(data):
        raise _Irregular
    return pos


# -- Lookup -----------------------------------------------------------------


@dataclass(slots=True)
class LookupBatch:
    session_id: str
    # The v1 `blocks` form's addresses; empty for the packed form (see packed_addresses).
    addresses: list[BlockAddress]
    lease_ms: int
    # When every key has this length (checked while parsing); 0 when unknown.
    key_length: int
    # The generated message, when the fallback parsed it (base keys are read from it lazily).
    message: pb.LookupRequest | None
    # The request used packed_blocks (it is in `message`): the reply carries packed_statuses.
    packed: bool = False

    def base_keys(self, indexes: list[int]) -> list[tuple[int, bytes]] | None:
        """(group, base_key) of the given items; None when the request carries no base keys."""
        if self.message is None:  # the fast path only accepts requests without base keys
            return None
        if self.packed:
            return _packed_base_keys(self.message.packed_blocks, indexes)
        blocks = self.message.blocks
        if not indexes or not blocks[indexes[0]].base_key:
            return None
        return [(blocks[i].group, blocks[i].base_key) for i in indexes if blocks[i].base_key]


def parse_lookup(data: bytes, max_items: int = 0) -> LookupBatch:
    """With max_items, TooManyItems is raised before any key is cut or any message is built. The v1
    form in its common shape is cut by hand; the packed form needs no per-key message, so the
    generated parser reads it at C speed (one copy of each run's keys)."""
    try:
        return _parse_lookup_fast(data, max_items)
    except _Irregular:
        if max_items:
            count_items(data, max_items)
        return lookup_from_message(pb.LookupRequest.FromString(data))


def lookup_from_message(message: pb.LookupRequest) -> LookupBatch:
    if message.packed_blocks:
        return LookupBatch(message.session_id, [], message.lease_ms, 0, message, packed=True)
    addresses: list[BlockAddress] = list(map(_GROUP_KEY, message.blocks))
    return LookupBatch(message.session_id, addresses, message.lease_ms, 0, message)


@functools.lru_cache(maxsize=64)
def _key_splitter(key_length: int, count: int) -> struct.Struct:
    return struct.Struct(f"{key_length}s" * count)


def split_keys(keys: bytes, key_length: int) -> tuple[bytes, ...]:
    """Cut concatenated fixed-length keys: one C call (struct), ~10x a Python slicing loop."""
    count = len(keys) // key_length
    if count <= 8192:  # cached Struct: the common Lookup sizes recur
        return _key_splitter(key_length, count).unpack(keys)
    return struct.unpack(f"{key_length}s" * count, keys)


def packed_addresses(runs: Iterable[pb.PackedBlocks]) -> list[BlockAddress]:
    """The (group, key) addresses of validated packed runs, in order (validation.packed_blocks)."""
    addresses: list[BlockAddress] = []
    for run in runs:
        keys = split_keys(run.keys, run.key_length)
        addresses.extend(zip(repeat(run.group), keys))  # type: ignore[arg-type]
    return addresses


def _packed_base_keys(runs: Sequence[pb.PackedBlocks], indexes: list[int]) -> list[tuple[int, bytes]] | None:
    """(group, base_key) of the given items of validated packed runs; None when no run has base keys."""
    starts: list[int] = []
    cut: list[tuple[int, bytes, int]] = []  # (group, base_keys, base key length) per run
    total = 0
    for run in runs:
        count = len(run.keys) // run.key_length
        base = run.base_keys
        starts.append(total)
        cut.append((run.group, base, len(base) // count if base else 0))
        total += count
    if not any(length for _, _, length in cut):
        return None
    found: list[tuple[int, bytes]] = []
    for index in indexes:
        r = bisect.bisect_right(starts, index) - 1
        group, base, length = cut[r]
        if length:
            offset = (index - starts[r]) * length
            found.append((group, base[offset : offset + length]))
    return found or None


def _parse_lookup_fast(data: bytes, max_items: int) -> LookupBatch:
    pos = 0
    session_id = ""
    if data[:1] == b"\x0a":
        length, pos = _varint(data, 1)
        if pos + length > len(data):
            raise _Irregular
        try:
            session_id = data[pos : pos + length].decode("utf-8")
        except UnicodeDecodeError:
            raise _Irregular from None
        pos += length
    keys: list[bytes] = []
    key_length = 0
    if data[pos : pos + 1] == b"\x12":
        # A run of BlockRef{key} of one length K, each encoded 0x12 (K+2) 0x0a K key (one-byte
        # lengths); checked with strided slices (C-level compares), keys cut by plain slicing.
        if pos + 4 > len(data):
            raise _Irregular
        key_length = data[pos + 3]
        if not 0 < key_length < 126:
            raise _Irregular
        stride = key_length + 4
        count = (len(data) - pos) // stride
        if count and data[pos + (count - 1) * stride] != 0x12:
            count -= 1  # the last stride-sized piece is the lease_ms field, not a block
        end = pos + count * stride
        header = (0x12, key_length + 2, 0x0A, key_length)
        for offset, byte in enumerate(header):
            if data[pos + offset : end : stride] != bytes((byte,)) * count:
                raise _Irregular
        if max_items and count > max_items:
            raise TooManyItems(count)
        keys = [data[i : i + key_length] for i in range(pos + 4, end, stride)]
        pos = end
    lease_ms = 0
    if data[pos : pos + 1] == b"\x18":
        lease_ms, pos = _varint(data, pos + 1)
        lease_ms &= 0xFFFFFFFF
    if pos != len(data):
        raise _Irregular
    addresses: list[BlockAddress] = list(zip(repeat(0), keys))  # type: ignore[arg-type]
    return LookupBatch(session_id, addresses, lease_ms, key_length, None)


# -- Put --------------------------------------------------------------------


@dataclass(slots=True)
class PutItemView:
    group: int
    key: bytes
    base_key: bytes
    # "value", "shared_memory" or None, like PutItem.WhichOneof("payload").
    payload: str | None
    # A view into the request's bytes (no copy; the backend copies it into the store), or bytes.
    value: bytes | memoryview


@dataclass(slots=True)
class PutBatch:
    session_id: str
    items: list[PutItemView]


def parse_put(data: bytes, max_items: int = 0) -> PutBatch:
    """With max_items, TooManyItems is raised before more than max_items items are built."""
    try:
        return _parse_put_fast(data, max_items)
    except _Irregular:
        if max_items:
            count_items(data, max_items)
        return put_from_message(pb.PutRequest.FromString(data))


def put_from_message(message: pb.PutRequest) -> PutBatch:
    items = [
        PutItemView(
            group=item.block.group,
            key=item.block.key,
            base_key=item.block.base_key,
            payload=item.WhichOneof("payload"),
            value=item.value,
        )
        for item in message.items
    ]
    return PutBatch(message.session_id, items)


def _parse_put_fast(data: bytes, max_items: int) -> PutBatch:
    view = memoryview(data)
    pos, end = 0, len(data)
    session_id = ""
    items: list[PutItemView] = []
    while pos < end:
        tag, pos = _varint(view, pos)
        field, wire_type = tag >> 3, tag & 7
        if field in (1, 2):
            if wire_type != 2:
                raise _Irregular
            length, pos = _varint(view, pos)
            if pos + length > end:
                raise _Irregular
            if field == 1:
                try:
                    session_id = str(view[pos : pos + length], "utf-8")
                except UnicodeDecodeError:
                    raise _Irregular from None
            else:
                if max_items and len(items) == max_items:
                    raise TooManyItems(None)
                items.append(_parse_put_item(view, pos, pos + length))
            pos += length
        else:
            pos = _skip(view, pos, wire_type)
    return PutBatch(session_id, items)


def _parse_put_item(view: memoryview, pos: int, end: int) -> PutItemView:
    item = PutItemView(group=0, key=b"", base_key=b"", payload=None, value=b"")
    seen_block = False
    while pos < end:
        tag, pos = _varint(view, pos)
        field, wire_type = tag >> 3, tag & 7
        if field in (1, 2, 3):
            if wire_type != 2:
                raise _Irregular
            length, pos = _varint(view, pos)
            if pos + length > end:
                raise _Irregular
            if field == 1:
                if seen_block:  # a repeated sub-message merges; leave that to the generated parser
                    raise _Irregular
                seen_block = True
                _parse_block(view, pos, pos + length, item)
            elif field == 2:
                item.payload, item.value = "value", view[pos : pos + length]
            else:
                pb.SharedMemoryRef.FromString(bytes(view[pos : pos + length]))  # validates like upb
                item.payload, item.value = "shared_memory", b""
            pos += length
        else:
            pos = _skip(view, pos, wire_type)
    if pos != end:
        raise _Irregular
    return item


def _parse_block(view: memoryview, pos: int, end: int, item: PutItemView) -> None:
    while pos < end:
        tag, pos = _varint(view, pos)
        field, wire_type = tag >> 3, tag & 7
        if field in (1, 3) and wire_type == 2:
            length, pos = _varint(view, pos)
            if pos + length > end:
                raise _Irregular
            if field == 1:
                item.key = bytes(view[pos : pos + length])
            else:
                item.base_key = bytes(view[pos : pos + length])
            pos += length
        elif field == 2 and wire_type == 0:
            group, pos = _varint(view, pos)
            item.group = group & 0xFFFFFFFF
        elif field in (1, 2, 3):
            raise _Irregular
        else:
            pos = _skip(view, pos, wire_type)
    if pos != end:
        raise _Irregular


# -- Counting ---------------------------------------------------------------


def count_items(data: bytes, max_items: int, field: int = 2) -> int:
    """An upper bound of how often the top-level `field` (the batch of every KvStore request) occurs,
    without building anything: exact from a walk of the field framing, or len(data) // 2 when that
    cannot pass max_items (every field takes two bytes or more) and the walk (~2.5 us per field) is
    skipped. Raises TooManyItems past max_items, and Malformed when the bytes do not frame or repeat
    other fields past max_items (a pathological message no client sends)."""
    if len(data) < 2 * max_items:
        return len(data) // 2
    pos, end, count, others = 0, len(data), 0, 0
    try:
        while pos < end:
            tag, pos = _varint(data, pos)
            if tag >> 3 == field:
                count += 1
                if count > max_items:
                    raise TooManyItems(None)
            else:
                others += 1
                if others > max_items:
                    raise Malformed(f"top-level fields repeat more than {max_items} times")
            pos = _skip(data, pos, tag & 7)
    except _Irregular:
        raise Malformed(f"no valid protobuf field at byte {pos}") from None
    return count


# -- Get --------------------------------------------------------------------

# Encoded GetResult{status} for results without a value.
_BARE = {int(s): bytes([0x0A, 2, 0x08, int(s)]) for s in KeyStatus}


def encode_get_results(results: list[ReadResult]) -> bytes:
    """The wire bytes of GetResponse{results}: the same bytes the generated code produces."""
    parts: list[bytes | memoryview] = []
    append = parts.append
    for result in results:
        value = result.value
        if value is None:
            append(_BARE[result.status])
            continue
        inner_head = bytes([0x08, int(result.status)]) + (
            b"\x12" + encode_varint(len(value)) if value else b""
        )
        append(b"\x0a" + encode_varint(len(inner_head) + len(value)) + inner_head)
        append(value)
    return b"".join(parts)


def serialize_response(response: Any) -> bytes:
    """Response serializer for the hand-encoded RPCs: bytes pass through, messages serialize."""
    if isinstance(response, bytes):
        return response
    serialized: bytes = response.SerializeToString()
    return serialized


__all__ = [
    "LookupBatch",
    "Malformed",
    "PutBatch",
    "PutItemView",
    "TooManyItems",
    "count_items",
    "encode_get_results",
    "packed_addresses",
    "parse_lookup",
    "parse_put",
    "serialize_response",
    "split_keys",
]
