"""The block items StoreClient stores, named.

They are tuples, so every call also takes a plain (group, key, value, base_key) tuple: the `*Fields`
aliases are what the calls accept, the NamedTuples what code that reads the fields builds.
"""

from __future__ import annotations

from typing import NamedTuple

PutItemFields = tuple[int, bytes, bytes, bytes]
SizedItemFields = tuple[int, bytes, int, bytes]


class PutItem(NamedTuple):
    """A value to store under (group, key); base_key (the block's lookahead-0 key, or empty) only feeds
    the store's cross-mode diagnostics."""

    group: int
    key: bytes
    value: bytes
    base_key: bytes


class SizedItem(NamedTuple):
    """A put whose `length` bytes the caller writes itself (StoreClient.reserve / put_from)."""

    group: int
    key: bytes
    length: int
    base_key: bytes
