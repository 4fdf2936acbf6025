"""Protobuf field framing read without a parser: varints, skipping a field, counting a batch.

The hand-written request paths (codec) and the intake's batch count walk the
bytes with these before anything is built.
"""

from __future__ import annotations

from kvtag_proto.varint import Irregular
from kvtag_proto.varint import decode_varint as varint


class TooManyItems(Exception):
    """The request repeats its batch field more often than allowed; raised before any item is built."""

    def __init__(self, count: int | None) -> None:
        super().__init__(count)
        self.count = count  # exact when known, None for "more than the limit"


class Malformed(Exception):
    """The bytes do not frame as protobuf fields (the counting walk found no valid field boundary)."""


def skip(data: bytes | memoryview, pos: int, wire_type: int) -> int:
    """The position after a field's value of `wire_type` starting at `pos`."""
    if wire_type == 0:
        return varint(data, pos)[1]
    if wire_type == 1:
        pos += 8
    elif wire_type == 2:
        length, pos = varint(data, pos)
        pos += length
    elif wire_type == 5:
        pos += 4
    else:
        raise Irregular
    if pos > len(data):
        raise Irregular
    return pos


def count_items(data: bytes, max_items: int, field: int = 2) -> int:
    """An upper bound of how often the top-level `field` (the batch of every KvStore request) occurs,
    without building anything: exact from a walk of the field framing, or len(data) // 2 when that
    cannot pass max_items (every field takes two bytes or more) and the walk is skipped. Raises
    TooManyItems past max_items, and Malformed when the bytes do not frame or repeat other fields
    past max_items (a pathological message no client sends)."""
    if len(data) < 2 * max_items:
        return len(data) // 2
    pos, end, count, others = 0, len(data), 0, 0
    try:
        while pos < end:
            tag, pos = varint(data, pos)
            if tag >> 3 == field:
                count += 1
                if count > max_items:
                    raise TooManyItems(None)
            else:
                others += 1
                if others > max_items:
                    raise Malformed(f"top-level fields repeat more than {max_items} times")
            pos = skip(data, pos, tag & 7)
    except Irregular:
        raise Malformed(f"no valid protobuf field at byte {pos}") from None
    return count
