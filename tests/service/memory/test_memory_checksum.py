"""The memory backend's checksum covers every byte of a value: a flip anywhere turns a Get hit into a miss."""

from __future__ import annotations

import os

import pytest
from kvtag_store.backends.base import BlockAddress, BlockKey, KeyStatus
from kvtag_store.backends.memory import MemoryBackend
from kvtag_store.backends.memory.entries import checksum

from ..faults import corrupt_memory_value, flip_memory_bit


def a(name: str) -> BlockAddress:
    return (0, BlockKey(name.encode()))


def _flip(backend: MemoryBackend, address: BlockAddress, position: int) -> None:
    flip_memory_bit(backend, "ns", address, position)


@pytest.mark.parametrize("position", [0, 1, (1 << 20) - 1, 1 << 19])
def test_a_bit_flip_anywhere_in_a_value_is_caught_on_get(position: int) -> None:
    backend = MemoryBackend(8 << 20)
    value = os.urandom(1 << 20)
    backend.put_many("ns", "m", [(a("damaged"), value), (a("intact"), value)])
    _flip(backend, a("damaged"), position)
    results = backend.get("ns", "m", [a("damaged"), a("intact")])
    assert [r.status for r in results] == [KeyStatus.MISS, KeyStatus.HIT]
    assert results[1].value == value
    stats = backend.stats()
    assert (stats.corrupted_dropped, stats.keys, stats.used_bytes) == (1, 1, 1 << 20)


def test_an_empty_value_is_stored_and_served_with_its_checksum() -> None:
    backend = MemoryBackend(100)
    backend.put("ns", "m", a("empty"), b"")
    assert [(r.status, r.value) for r in backend.get("ns", "m", [a("empty")])] == [(KeyStatus.HIT, b"")]


def test_the_injected_fault_is_caught_among_many_hits() -> None:
    backend = MemoryBackend(1 << 20)
    values = [os.urandom(4096) for _ in range(64)]
    backend.put_many("ns", "m", [(a(str(i)), v) for i, v in enumerate(values)])
    corrupt_memory_value(backend, "ns", a("37"))
    results = backend.get("ns", "m", [a(str(i)) for i in range(64)])
    assert [i for i, r in enumerate(results) if r.status is not KeyStatus.HIT] == [37]
    assert [r.value for i, r in enumerate(results) if i != 37] == values[:37] + values[38:]


def test_checksum_is_64_bits_and_depends_on_every_byte() -> None:
    value = bytes(range(256)) * 64
    digest = checksum(value)
    assert 0 <= digest < 1 << 64
    assert digest != checksum(b"\x01" + value[1:])
    assert digest != checksum(value[:-1] + b"\x00")
    assert digest == checksum(memoryview(value))
