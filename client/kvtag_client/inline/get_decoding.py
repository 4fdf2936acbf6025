"""GetResponse wire bytes read by hand: values are views into the received message, not copies.

Why: the generated parser copies every value into a upb arena, then again into a
Python bytes when `result.value` is read, so a 1 MiB Get paid two copies (and two
fresh 1 MiB buffers, whose first-touch page faults cost as much as the copies) on
the client beside gRPC's own. Here a value is a memoryview slice of the bytes gRPC
received: no copy at all. A view keeps its whole message alive, so a caller that
keeps a value for long should take bytes(value). Any
shape this walker does not expect (an unknown field, a truncated message) goes
to the generated parser, so the answer is always what the generated code reads;
tests/client/test_get_decoding.py checks that with hypothesis, and
tests/service/api/test_codec_schema.py pins the fields it relies on.
"""

from __future__ import annotations

from kvtag.v1 import store_pb2 as pb
from kvtag_proto.varint import Irregular
from kvtag_proto.varint import decode_varint as _varint

# A value: a read-only view into the received message (bytes from the fallback parser).
Value = bytes | memoryview
# (KeyStatus, value) per result, in order; value is empty unless the status is HIT.
GetResults = list[tuple[int, Value]]


def decode_get_response(data: bytes) -> GetResults:
    """GetResponse{results: [GetResult{status, value}]} as (status, value) pairs."""
    try:
        return _decode_fast(data)
    except Irregular:
        message = pb.GetResponse.FromString(data)
        return [(r.status, r.value) for r in message.results]


def _decode_fast(data: bytes) -> GetResults:
    results: GetResults = []
    append = results.append
    view = memoryview(data)
    pos, end = 0, len(data)
    while pos < end:
        if data[pos] != 0x0A:  # only field 1 (results), length-delimited
            raise Irregular
        length, pos = _varint(data, pos + 1, end)
        stop = pos + length
        if stop > end:
            raise Irregular
        status, value = 0, view[0:0]
        while pos < stop:
            tag = data[pos]
            if tag == 0x08:
                status, pos = _varint(data, pos + 1, stop)
                if status > 0x7FFFFFFF:  # an enum is an int32: leave the odd cases to the generated parser
                    raise Irregular
            elif tag == 0x12:
                size, pos = _varint(data, pos + 1, stop)
                if pos + size > stop:
                    raise Irregular
                value = view[pos : pos + size]
                pos += size
            else:
                raise Irregular
        if pos != stop:
            raise Irregular
        append((status, value))
    return results


__all__ = ["GetResults", "Value", "decode_get_response"]
