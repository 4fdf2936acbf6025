"""GetResponse wire bytes read by hand: each value is copied once, out of the received message.

Why: the generated parser copies every value into a upb arena and then, when the
field is read, out into a new Python bytes: two fresh buffers per byte received.
This walker slices each value straight out of the message. It follows protobuf's
parsing rules for the fields it knows (the last occurrence of a scalar wins,
unknown fields are skipped, a negative enum is a 10-byte varint) and hands
anything else (a truncated message, a group wire type) to the generated parser,
so its result always equals the generated code's (tests/client/test_get_decoding.py).
"""

from __future__ import annotations

from kvtag.v1 import store_pb2 as pb

# (status, value) per result, in order; value is b"" when the result carries none.
GetResultFields = tuple[int, bytes]


class _Irregular(Exception):
    """Not a shape this walker handles; the generated parser decides."""


def _varint(data: memoryview, pos: int, end: int) -> tuple[int, int]:
    result = 0
    shift = 0
    while True:
        if pos >= end or shift > 63:
            raise _Irregular
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7


def _skip(data: memoryview, pos: int, end: int, wire_type: int) -> int:
    if wire_type == 0:
        return _varint(data, pos, end)[1]
    if wire_type == 1:
        pos += 8
    elif wire_type == 2:
        length, pos = _varint(data, pos, end)
        pos += length
    elif wire_type == 5:
        pos += 4
    else:
        raise _Irregular
    if pos > end:
        raise _Irregular
    return pos


def _int32(value: int) -> int:
    """An enum varint as protobuf reads it: the low 32 bits, signed."""
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value & 0x80000000 else value


def _result(view: memoryview, pos: int, end: int) -> GetResultFields:
    status = 0
    start = stop = 0
    while pos < end:
        tag, pos = _varint(view, pos, end)
        field, wire_type = tag >> 3, tag & 7
        if field == 0 or tag >> 32:  # field numbers are 1..2**29-1
            raise _Irregular
        if field == 1 and wire_type == 0:
            raw, pos = _varint(view, pos, end)
            status = _int32(raw)
        elif field == 2 and wire_type == 2:
            length, pos = _varint(view, pos, end)
            if pos + length > end:
                raise _Irregular
            start, stop = pos, pos + length
            pos = stop
        elif field in (1, 2):
            raise _Irregular  # a known field with another wire type (e.g. a packed status)
        else:
            pos = _skip(view, pos, end, wire_type)
    if pos != end:
        raise _Irregular
    return status, bytes(view[start:stop]) if stop > start else b""


def _decode_fast(data: bytes) -> list[GetResultFields]:
    view = memoryview(data)
    pos, end = 0, len(data)
    results: list[GetResultFields] = []
    while pos < end:
        tag, pos = _varint(view, pos, end)
        field, wire_type = tag >> 3, tag & 7
        if field == 0 or tag >> 32:  # field numbers are 1..2**29-1
            raise _Irregular
        if field == 1:
            if wire_type != 2:
                raise _Irregular
            length, pos = _varint(view, pos, end)
            if pos + length > end:
                raise _Irregular
            results.append(_result(view, pos, pos + length))
            pos += length
        else:
            pos = _skip(view, pos, end, wire_type)
    return results


def decode_get_response(data: bytes) -> list[GetResultFields]:
    """(status, value) of every GetResult in a GetResponse, as the generated parser would read them.

    Raises google.protobuf.message.DecodeError for bytes the generated parser rejects.
    """
    try:
        return _decode_fast(data)
    except _Irregular:
        return [(r.status, r.value) for r in pb.GetResponse.FromString(data).results]


__all__ = ["GetResultFields", "decode_get_response"]
