"""Protobuf base-128 varint encoding, for the hand-joined messages of the hot paths on both sides.

The service encodes Get replies by hand and the client encodes Put requests by hand; both must
produce exactly the generated code's bytes, so they share this one encoder.
"""

from __future__ import annotations

_ONE_BYTE = [bytes((n,)) for n in range(0x80)]


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
