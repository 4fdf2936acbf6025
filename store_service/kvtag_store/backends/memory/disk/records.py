"""The on-disk record: a fixed header, the names that tag the value, then the value.

Self-describing, so a segment file alone rebuilds the index: magic, format version, flags, the
lengths of namespace, tenant, mode_id and key, the key's group, the value's length and XXH3-64,
then the XXH3-64 of the header and names themselves (a torn or flipped header is caught before
its lengths are trusted). The value digest is the one the memory tier committed: nothing is hashed
twice at write time.

An index entry is one packed int (`Location`), so a disk-resident key costs a dict slot, its key
bytes and this int.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

import xxhash

MAGIC = b"KVTR"
FORMAT_VERSION = 1
_FLAG_TENANT = 1  # the record names a tenant (else it belongs to the shared pool)
# magic, version, flags, ns len, tenant len, mode len, key len, group, value len, value xxh3
_FIXED = struct.Struct("<4sHHHHHHIQQ")
_DIGEST = struct.Struct("<Q")
HEADER_BYTES = _FIXED.size + _DIGEST.size
MAX_NAME = 0xFFFF
# A header plus names longer than this is not one we wrote (names are short): treated as torn.
MAX_META = HEADER_BYTES + 4 * 1024

_digest = xxhash.xxh3_64_intdigest
# The digest of a value: the memory tier's checksum (memory.entries.checksum is this function), stored
# in each record's header as the memory tier committed it, so nothing is hashed twice at write time.
# Changing it means a new FORMAT_VERSION.
value_digest = xxhash.xxh3_64_intdigest

# Location bit layout: mode number (16) | value length (32) | meta length (16) | offset (40) | segment.
_MODE_BITS, _VALUE_BITS, _META_BITS, _OFFSET_BITS = 16, 32, 16, 40
MAX_MODE_NUMBER = (1 << _MODE_BITS) - 1
MAX_VALUE = (1 << _VALUE_BITS) - 1


class Record(NamedTuple):
    """A parsed header and its names."""

    namespace_id: str
    tenant: str | None
    mode_id: str
    group: int
    key: bytes
    value_length: int
    value_digest: int
    meta_length: int  # header plus names: the value starts this far into the record


class TornRecord(Exception):
    """The bytes are not a whole, intact record header."""


class ShortBuffer(Exception):
    """The header is whole but its names run past the bytes read: `length` bytes are needed."""

    def __init__(self, length: int) -> None:
        super().__init__(length)
        self.length = length


def encode_meta(
    namespace_id: str,
    tenant: str | None,
    mode_id: str,
    group: int,
    key: bytes,
    value_length: int,
    digest: int,
) -> bytes:
    """The header and names that precede a value on disk."""
    ns, te, mo = namespace_id.encode(), (tenant or "").encode(), mode_id.encode()
    flags = _FLAG_TENANT if tenant is not None else 0
    fixed = _FIXED.pack(
        MAGIC, FORMAT_VERSION, flags, len(ns), len(te), len(mo), len(key), group, value_length, digest
    )
    names = ns + te + mo + key
    return fixed + _DIGEST.pack(_digest(fixed + names)) + names


def decode_meta(buffer: bytes | bytearray | memoryview, start: int = 0) -> Record:
    """The record whose header and names start at `start` in `buffer`; TornRecord when they fail
    their checks, ShortBuffer when `buffer` ends before them (read more, or at the end of a file:
    torn)."""
    if len(buffer) < start + HEADER_BYTES:
        raise ShortBuffer(HEADER_BYTES)
    magic, version, flags, n, t, m, k, group, value_length, value_digest = _FIXED.unpack_from(buffer, start)
    if magic != MAGIC or version != FORMAT_VERSION:
        raise TornRecord("bad magic or version")
    length = HEADER_BYTES + n + t + m + k
    if length > MAX_META:
        raise TornRecord("names longer than any record written")
    if len(buffer) < start + length:
        raise ShortBuffer(length)
    fixed = bytes(buffer[start : start + _FIXED.size])
    names = bytes(buffer[start + HEADER_BYTES : start + length])
    (stored,) = _DIGEST.unpack_from(buffer, start + _FIXED.size)
    if _digest(fixed + names) != stored:
        raise TornRecord("header checksum")
    try:
        namespace_id = names[:n].decode()
        tenant = names[n : n + t].decode() if flags & _FLAG_TENANT else None
        mode_id = names[n + t : n + t + m].decode()
    except UnicodeDecodeError as exc:
        raise TornRecord("names") from exc
    return Record(
        namespace_id, tenant, mode_id, group, names[n + t + m :], value_length, value_digest, length
    )


def index_key(group: int, key: bytes) -> bytes:
    """A block's key in a namespace's disk index: group and key in one bytes object (no tuple)."""
    return group.to_bytes(4, "little") + key


def index_address(packed: bytes) -> tuple[int, bytes]:
    return int.from_bytes(packed[:4], "little"), packed[4:]


def location(segment: int, offset: int, meta: int, value_length: int, mode_number: int) -> int:
    return (
        ((((segment << _OFFSET_BITS | offset) << _META_BITS | meta) << _VALUE_BITS) | value_length)
        << _MODE_BITS
    ) | mode_number


class Location(NamedTuple):
    segment: int
    offset: int
    meta: int
    value_length: int
    mode_number: int


def unpack_location(packed: int) -> Location:
    mode = packed & MAX_MODE_NUMBER
    packed >>= _MODE_BITS
    value_length = packed & MAX_VALUE
    packed >>= _VALUE_BITS
    meta = packed & ((1 << _META_BITS) - 1)
    packed >>= _META_BITS
    offset = packed & ((1 << _OFFSET_BITS) - 1)
    return Location(packed >> _OFFSET_BITS, offset, meta, value_length, mode)


def mode_number_of(packed: int) -> int:
    return packed & MAX_MODE_NUMBER


def segment_of(packed: int) -> int:
    return packed >> (_MODE_BITS + _VALUE_BITS + _META_BITS + _OFFSET_BITS)
