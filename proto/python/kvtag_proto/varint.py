"""Protobuf base-128 varints, for the hand-joined and hand-read messages of the hot paths on both sides.

The service encodes Get replies and reads Put and Lookup requests by hand; the client encodes Put
requests and reads Get replies by hand. Both must agree with the generated code's bytes exactly, so
they share this one encoder and this one decoder.
"""

from __future__ import annotations

_ONE_BYTE = [bytes((n,)) for n in range(0x80)]


class Irregular(Exception):
    """The bytes are not in the shape a hand-written reader handles: leave them to the generated parser."""


def encode_varint(value: int) -> bytes:
    """Varint of a non-negative integer."""
    if value < 0x80:
        return _ONE_BYTE[value]
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def decode_varint(data: bytes | memoryview, pos: int, end: int | None = None) -> tuple[int, int]:
    """The varint at `pos` and the position after it; Irregular when it runs past `end` (default: the
    end of `data`) or past 64 bits."""
    if end is None:
        end = len(data)
    result = 0
    shift = 0
    while True:
        if pos >= end or shift > 63:
            raise Irregular
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7
