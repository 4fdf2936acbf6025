"""The shared-memory arena's layout: one definition for the service that writes it and the client
that maps it (the memory backend's arenas and the Mooncake backend's staging arenas alike).

    [0, 4096)            arena header: magic, format version, the attach nonce, the faulted word
    [s, s+64)            slot header; the slot's generation word in its last 8 bytes
    [s+64, s+64+length)  the value: what SharedMemoryRef.offset names

A reference names a value's offset; the generation word sits in the 8 bytes right before it and
changes whenever the service hands the slot out again, so a reader tells a reused slot by it. Two
processes read this layout, so it lives here and nowhere else.
"""

from __future__ import annotations

import struct

from kvtag_proto.pages import FAULTED_OFFSET

MAGIC = b"KVTAGARN"
FORMAT_VERSION = 1
_VERSION_OFFSET = 8
# The attach nonce: random bytes the service writes and a client proves it mapped by sending back.
NONCE_OFFSET = 16
NONCE_LENGTH = 16
ARENA_HEADER = 4096
SLOT_HEADER = 64
# Values are aligned to this (a slot's span is its header plus the value rounded up to it).
ALIGN = 64
# Pages are reserved and touched (service) and mapped (client) in extents of this size.
EXTENT = 2 << 20
# Nothing a reference names lies below the first slot's value.
FIRST_VALUE = ARENA_HEADER + SLOT_HEADER
_GENERATION = struct.Struct("<Q")


def span_for(length: int) -> int:
    """Bytes of the slot holding a value of `length` bytes, its header included."""
    return SLOT_HEADER + (max(length, 1) + ALIGN - 1) // ALIGN * ALIGN


def write_header(buffer: memoryview, nonce: bytes) -> None:
    """The arena header's magic, format version and attach nonce."""
    buffer[0:_VERSION_OFFSET] = MAGIC
    buffer[_VERSION_OFFSET : _VERSION_OFFSET + 4] = FORMAT_VERSION.to_bytes(4, "little")
    buffer[NONCE_OFFSET : NONCE_OFFSET + NONCE_LENGTH] = nonce


def write_generation(buffer: memoryview | bytearray | object, value_offset: int, generation: int) -> None:
    """Stamp the generation word of the value at `value_offset` (the 8 bytes before it)."""
    _GENERATION.pack_into(buffer, value_offset - 8, generation)  # type: ignore[arg-type]


def read_generation(buffer: memoryview | bytearray | object, value_offset: int) -> int:
    """The generation word of the value at `value_offset`."""
    value: int = _GENERATION.unpack_from(buffer, value_offset - 8)[0]  # type: ignore[arg-type]
    return value


__all__ = [
    "ALIGN",
    "ARENA_HEADER",
    "EXTENT",
    "FAULTED_OFFSET",
    "FIRST_VALUE",
    "FORMAT_VERSION",
    "MAGIC",
    "NONCE_LENGTH",
    "NONCE_OFFSET",
    "SLOT_HEADER",
    "read_generation",
    "span_for",
    "write_generation",
    "write_header",
]
