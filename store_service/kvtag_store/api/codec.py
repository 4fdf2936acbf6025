"""The request codec: wire bytes and generated messages to the one internal form of each batch.

Two wire forms carry a batch of keys: the v1 per-block lists (`blocks`,
`items`) and the packed runs (`packed_blocks`, `packed_items`). Both become the
same KeyBatch (Lookup, Get, GetReferences) or slot items (ReserveSlots,
CommitSlots) here, so the servicer has one path per RPC and asks the wire form
only to shape its reply the way the request came (`packed`).

The hot RPCs are parsed and encoded by hand, each exactly equivalent to the
generated code, because the upb runtime builds a Python wrapper for every
element of a repeated message it touches and copies every bytes field twice:

- Lookup requests in the v1 form and its common shape (plain keys of one
  length, group 0, no base keys, fields in number order) are checked with
  strided byte compares and cut by slicing; any other shape falls back to the
  generated parser. The packed form needs no per-key message, so the
  generated parser reads it and split_keys cuts the keys in one C call.
- Put requests are walked by hand so each value is copied once; anything
  unexpected (groups, a repeated sub-message, bad UTF-8) falls back.
- Get responses are encoded by hand around the stored value objects, so the
  values are copied once, into the reply.

tests/service/api/test_wire.py checks all three against the generated code with
hypothesis; benchmarks/bench_codecs.py measures what each saves.
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
from kvtag_proto.varint import Irregular, encode_varint
from kvtag_proto.varint import decode_varint as varint

from kvtag_store import errors
from kvtag_store.api import validation
from kvtag_store.api.framing import TooManyItems, count_items, skip
from kvtag_store.backends.base import BlockAddress, KeyStatus, ReadResult
from kvtag_store.config import ServiceLimits

_GROUP_KEY = attrgetter("group", "key")

# -- Keys: Lookup, Get, GetReferences -------------------------------------------


class KeyBatch:
    """The keys of a Lookup, Get or GetReferences, whichever wire form carried them. The addresses
    are cut from packed runs only when asked for; packed runs are kept for a backend that answers on
    the key bytes (`runs`)."""

    __slots__ = ("_addresses", "key_length", "lease_ms", "message", "packed", "session_id")

    def __init__(
        self,
        session_id: str,
        addresses: list[BlockAddress] | None,
        lease_ms: int,
        key_length: int,
        message: pb.LookupRequest | pb.GetRequest | None,
        packed: bool = False,
    ) -> None:
        self.session_id = session_id
        self._addresses = addresses
        self.lease_ms = lease_ms
        # When every key has this length (proved while parsing); 0 when unknown.
        self.key_length = key_length
        # The generated message, when one was parsed (base keys are read from it lazily).
        self.message = message
        # The request used the packed form (it is in `message`): the reply answers packed.
        self.packed = packed

    @property
    def addresses(self) -> list[BlockAddress]:
        """(group, key) of every key, in request order."""
        if self._addresses is None:
            self._addresses = packed_addresses(self._runs())
        return self._addresses

    @property
    def runs(self) -> list[tuple[int, bytes, int]] | None:
        """(group, concatenated keys, key length) per packed run; None for the v1 form, whose keys
        arrive already cut and go to the backend as addresses."""
        if not self.packed:
            return None
        return [(run.group, run.keys, run.key_length) for run in self._runs()]

    def check(self, limits: ServiceLimits, rpc: str) -> None:
        """Raise the ApiError of the first key, run or batch size out of `limits`."""
        if self.packed:
            assert self.message is not None
            validation.packed_blocks(self.message, limits, rpc)
        else:
            validation.addresses(self.addresses, "blocks", limits, self.key_length)

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

    def _runs(self) -> Sequence[pb.PackedBlocks]:
        return self.message.packed_blocks if self.message is not None else ()


def parse_lookup(data: bytes, max_items: int = 0) -> KeyBatch:
    """With max_items, TooManyItems is raised before any key is cut or any message is built. The v1
    form in its common shape is cut by hand; the packed form needs no per-key message, so the
    generated parser reads it at C speed (one copy of each run's keys)."""
    try:
        return _parse_lookup_fast(data, max_items)
    except Irregular:
        if max_items:
            count_items(data, max_items)
        return lookup_from_message(pb.LookupRequest.FromString(data))


def lookup_from_message(message: pb.LookupRequest) -> KeyBatch:
    return _keys(message, message.lease_ms)


def get_keys(message: pb.GetRequest) -> KeyBatch:
    """The keys of a Get, GetStream or GetReferences request."""
    return _keys(message, 0)


def _keys(message: pb.LookupRequest | pb.GetRequest, lease_ms: int) -> KeyBatch:
    if message.packed_blocks:
        return KeyBatch(message.session_id, None, lease_ms, 0, message, packed=True)
    addresses: list[BlockAddress] = list(map(_GROUP_KEY, message.blocks))
    return KeyBatch(message.session_id, addresses, lease_ms, 0, message)


@functools.lru_cache(maxsize=64)
def _key_splitter(key_length: int, count: int) -> struct.Struct:
    return struct.Struct(f"{key_length}s" * count)


def split_keys(keys: bytes, key_length: int) -> tuple[bytes, ...]:
    """Cut concatenated fixed-length keys in one C call (struct) rather than a Python slicing loop."""
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


def _parse_lookup_fast(data: bytes, max_items: int) -> KeyBatch:
    pos = 0
    session_id = ""
    if data[:1] == b"\x0a":
        length, pos = varint(data, 1)
        if pos + length > len(data):
            raise Irregular
        try:
            session_id = data[pos : pos + length].decode("utf-8")
        except UnicodeDecodeError:
            raise Irregular from None
        pos += length
    keys: list[bytes] = []
    key_length = 0
    if data[pos : pos + 1] == b"\x12":
        # A run of BlockRef{key} of one length K, each encoded 0x12 (K+2) 0x0a K key (one-byte
        # lengths); checked with strided slices (C-level compares), keys cut by plain slicing.
        if pos + 4 > len(data):
            raise Irregular
        key_length = data[pos + 3]
        if not 0 < key_length < 126:
            raise Irregular
        stride = key_length + 4
        count = (len(data) - pos) // stride
        if count and data[pos + (count - 1) * stride] != 0x12:
            count -= 1  # the last stride-sized piece is the lease_ms field, not a block
        end = pos + count * stride
        header = (0x12, key_length + 2, 0x0A, key_length)
        for offset, byte in enumerate(header):
            if data[pos + offset : end : stride] != bytes((byte,)) * count:
                raise Irregular
        if max_items and count > max_items:
            raise TooManyItems(count)
        keys = [data[i : i + key_length] for i in range(pos + 4, end, stride)]
        pos = end
    lease_ms = 0
    if data[pos : pos + 1] == b"\x18":
        lease_ms, pos = varint(data, pos + 1)
        lease_ms &= 0xFFFFFFFF
    if pos != len(data):
        raise Irregular
    addresses: list[BlockAddress] = list(zip(repeat(0), keys))  # type: ignore[arg-type]
    return KeyBatch(session_id, addresses, lease_ms, key_length, None)


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
    # BlockRef.token_ids (KV events), or empty.
    token_ids: bytes = b""


@dataclass(slots=True)
class PutBatch:
    session_id: str
    items: list[PutItemView]


def parse_put(data: bytes, max_items: int = 0) -> PutBatch:
    """With max_items, TooManyItems is raised before more than max_items items are built."""
    try:
        return _parse_put_fast(data, max_items)
    except Irregular:
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
            token_ids=item.block.token_ids,
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
        tag, pos = varint(view, pos)
        field, wire_type = tag >> 3, tag & 7
        if field in (1, 2):
            if wire_type != 2:
                raise Irregular
            length, pos = varint(view, pos)
            if pos + length > end:
                raise Irregular
            if field == 1:
                try:
                    session_id = str(view[pos : pos + length], "utf-8")
                except UnicodeDecodeError:
                    raise Irregular from None
            else:
                if max_items and len(items) == max_items:
                    raise TooManyItems(None)
                items.append(_parse_put_item(view, pos, pos + length))
            pos += length
        else:
            pos = skip(view, pos, wire_type)
    return PutBatch(session_id, items)


def _parse_put_item(view: memoryview, pos: int, end: int) -> PutItemView:
    item = PutItemView(group=0, key=b"", base_key=b"", payload=None, value=b"")
    seen_block = False
    while pos < end:
        tag, pos = varint(view, pos)
        field, wire_type = tag >> 3, tag & 7
        if field in (1, 2, 3):
            if wire_type != 2:
                raise Irregular
            length, pos = varint(view, pos)
            if pos + length > end:
                raise Irregular
            if field == 1:
                if seen_block:  # a repeated sub-message merges; leave that to the generated parser
                    raise Irregular
                seen_block = True
                _parse_block(view, pos, pos + length, item)
            elif field == 2:
                item.payload, item.value = "value", view[pos : pos + length]
            else:
                pb.SharedMemoryRef.FromString(bytes(view[pos : pos + length]))  # validates like upb
                item.payload, item.value = "shared_memory", b""
            pos += length
        else:
            pos = skip(view, pos, wire_type)
    if pos != end:
        raise Irregular
    return item


def _parse_block(view: memoryview, pos: int, end: int, item: PutItemView) -> None:
    while pos < end:
        tag, pos = varint(view, pos)
        field, wire_type = tag >> 3, tag & 7
        if field in (1, 3, 4) and wire_type == 2:
            length, pos = varint(view, pos)
            if pos + length > end:
                raise Irregular
            if field == 1:
                item.key = bytes(view[pos : pos + length])
            elif field == 3:
                item.base_key = bytes(view[pos : pos + length])
            else:
                item.token_ids = bytes(view[pos : pos + length])
            pos += length
        elif field == 2 and wire_type == 0:
            group, pos = varint(view, pos)
            item.group = group & 0xFFFFFFFF
        elif field in (1, 2, 3, 4):
            raise Irregular
        else:
            pos = skip(view, pos, wire_type)
    if pos != end:
        raise Irregular


# -- Slots: ReserveSlots, CommitSlots ---------------------------------------------

# (group, key, base key, length) of one slot to reserve.
SlotItem = tuple[int, bytes, bytes, int]
# (group, key, base key) of one spare slot to commit.
SlotKey = tuple[int, bytes, bytes]


@dataclass(slots=True)
class SlotBatch:
    """The items of a ReserveSlots, whichever wire form carried them."""

    items: list[SlotItem]
    # The request used packed_items: the reply answers packed.
    packed: bool


def reserve_items(request: pb.ReserveSlotsRequest, limits: ServiceLimits) -> SlotBatch:
    """The checked items of a ReserveSlots; raises the ApiError of the first one out of `limits`."""
    if request.packed_items:
        return SlotBatch(_packed_slot_items(request, limits), packed=True)
    validation.batch_size("items", len(request.items), limits)
    # Each item's fields read once (every access to a upb sub-message builds a wrapper).
    items = [(item.block.group, item.block.key, item.block.base_key, item.length) for item in request.items]
    for index, (_, key, _, _) in enumerate(items):
        validation.key(key, f"items[{index}].block.key", limits)
    for index, item in enumerate(request.items):
        if item.block.token_ids:
            validation.token_ids(item.block.token_ids, f"items[{index}].block.token_ids")
    return SlotBatch(items, packed=False)


def _packed_slot_items(request: pb.ReserveSlotsRequest, limits: ServiceLimits) -> list[SlotItem]:
    if request.items:
        raise errors.invalid_request(
            "a ReserveSlots carries either items or packed_items, not both; send all items in one form",
            "packed_items",
        )
    total = validation.packed_runs(request.packed_items, "packed_items", limits)
    lengths = request.packed_lengths
    if len(lengths) != total:
        raise errors.invalid_request(
            f"packed_lengths has {len(lengths)} lengths for {total} keys: send one per key, in order",
            "packed_lengths",
        )
    items = split_runs(request.packed_items)
    return [(group, key, base, length) for (group, key, base), length in zip(items, lengths, strict=True)]


def commit_keys(request: pb.CommitSlotsRequest, limits: ServiceLimits) -> list[SlotKey] | None:
    """The keys of the spare slots a CommitSlots names, one per generation; None when it names none
    (only slots reserved for their keys: the reply answers in the v1 form)."""
    if not request.packed_items:
        return None
    total = validation.packed_runs(request.packed_items, "packed_items", limits)
    if total != len(request.generations):
        raise errors.invalid_request(
            f"packed_items has {total} keys for {len(request.generations)} generations: send one key "
            "per generation, in the same order, or none",
            "packed_items",
        )
    return split_runs(request.packed_items)


def split_runs(runs: Sequence[pb.PackedBlocks]) -> list[SlotKey]:
    """(group, key, base key) of checked packed runs (validation.packed_runs), in order."""
    items: list[SlotKey] = []
    for run in runs:
        keys = split_keys(run.keys, run.key_length)
        bases = (
            split_keys(run.base_keys, len(run.base_keys) // len(keys))
            if run.base_keys
            else repeat(b"", len(keys))
        )
        items.extend(zip(repeat(run.group), keys, bases))
    return items


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
    "KeyBatch",
    "PutBatch",
    "PutItemView",
    "SlotBatch",
    "commit_keys",
    "encode_get_results",
    "get_keys",
    "lookup_from_message",
    "packed_addresses",
    "parse_lookup",
    "parse_put",
    "put_from_message",
    "reserve_items",
    "serialize_response",
    "split_keys",
]
