"""The CUDA worker path's device-agnostic parts on CPU: block staging, and finding and registering
arena mappings once (cudaHostRegister replaced by a recorder; the mappings are real)."""

from __future__ import annotations

import mmap
import os
import tempfile
from collections.abc import Iterator

import pytest
import torch
from kvtag_client.connector.blocks import LayerView, gather, stage_block, unstage_block
from kvtag_client.connector.pinning import ArenaPins, mapping_of

SHM = "/dev/shm" if os.path.isdir("/dev/shm") else None


def views(num_blocks: int = 6) -> list[LayerView]:
    return [LayerView(f"l{i}", torch.randn(2, num_blocks, 4, 2, 8), 1) for i in range(3)]


def test_staged_block_bytes_are_the_gathered_bytes_and_unstage_restores_them() -> None:
    group = views()
    mixed = [LayerView("conv", torch.randn(6, 3, 5), 0), LayerView("ssm", torch.randn(6, 4).double(), 0)]
    for layers in (group, mixed):
        staged = stage_block(layers, 2)
        assert staged.dtype == torch.uint8 and staged.is_contiguous()
        assert staged.numpy().tobytes() == gather(layers, 2)
        before = gather(layers, 4)
        unstage_block(layers, 4, staged)
        assert gather(layers, 4) == gather(layers, 2) != before


class Recorder:
    def __init__(self, accept: bool = True) -> None:
        self.accept = accept
        self.registered: list[tuple[int, int]] = []
        self.unregistered: list[int] = []

    def register(self, address: int, length: int) -> bool:
        self.registered.append((address, length))
        return self.accept

    def unregister(self, address: int) -> None:
        self.unregistered.append(address)


@pytest.fixture
def arena_file() -> Iterator[int]:
    if SHM is None:
        pytest.skip("no /dev/shm")
    fd, path = tempfile.mkstemp(dir=SHM, prefix="kvtag-pin-test-")
    os.ftruncate(fd, 4 << 20)
    try:
        yield fd
    finally:
        os.close(fd)
        os.unlink(path)


def address_of(mapped: mmap.mmap, offset: int) -> int:
    return int(torch.frombuffer(memoryview(mapped)[offset:], dtype=torch.uint8).data_ptr())


def test_an_arena_mapping_is_registered_whole_and_once(arena_file: int) -> None:
    mapped = mmap.mmap(arena_file, 4 << 20, flags=mmap.MAP_SHARED)
    recorder = Recorder()
    pins = ArenaPins(recorder.register, recorder.unregister)
    base = address_of(mapped, 0)
    assert pins.ensure(address_of(mapped, 8192), 4096)
    assert pins.ensure(address_of(mapped, 1 << 20), 1 << 20)
    assert recorder.registered == [(base, 4 << 20)], "one registration covering the whole mapping"
    anonymous = torch.zeros(1 << 16, dtype=torch.uint8)
    assert not pins.ensure(anonymous.data_ptr(), 4096), "only file mappings (the arena) are registered"
    pins.release()
    assert recorder.unregistered == [base]


def test_a_replaced_mapping_is_unregistered_and_the_new_one_registered(arena_file: int) -> None:
    recorder = Recorder()
    pins = ArenaPins(recorder.register, recorder.unregister)
    first = mmap.mmap(arena_file, 4 << 20, flags=mmap.MAP_SHARED)
    first_base = address_of(first, 0)
    assert pins.ensure(first_base, 4096)
    first.close()
    fd, path = tempfile.mkstemp(dir=SHM, prefix="kvtag-pin-test-")
    try:
        os.ftruncate(fd, 4 << 20)
        second = mmap.mmap(fd, 4 << 20, flags=mmap.MAP_SHARED)  # often at the same addresses
        second_base = address_of(second, 0)
        assert mapping_of(second_base) is not None
        assert pins.ensure(second_base, 4096)
        assert recorder.registered == [(first_base, 4 << 20), (second_base, 4 << 20)]
        assert recorder.unregistered == [first_base], "the stale registration is dropped first"
        second.close()
    finally:
        os.close(fd)
        os.unlink(path)


def test_a_refused_registration_falls_back_to_pageable_copies_without_retrying(arena_file: int) -> None:
    mapped = mmap.mmap(arena_file, 4 << 20, flags=mmap.MAP_SHARED)
    recorder = Recorder(accept=False)
    pins = ArenaPins(recorder.register, recorder.unregister)
    assert not pins.ensure(address_of(mapped, 0), 4096)
    assert not pins.ensure(address_of(mapped, 4096), 4096)
    assert len(recorder.registered) == 1
