"""The up-front prefault: several threads over disjoint chunks, its progress in /metrics, and
--prefault=lazy committing nothing up front. Real arenas in a tmpfs-like directory, a real server on
loopback."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from kvtag.v1 import store_pb2_grpc
from kvtag_proto import pages
from kvtag_store.app.server import start_server
from kvtag_store.backends.memory import MemoryBackend, MemoryCensus
from kvtag_store.backends.shm.arena import Arena, arena_size
from kvtag_store.config import ServiceConfig
from prometheus_client import generate_latest

from tests.descriptors import namespace

from ..helpers import Store

MiB = 1 << 20


def wait_until(check: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


@pytest.mark.parametrize("threads", [1, 3])
def test_the_eager_prefault_touches_every_chunk_and_publishes_it(tmp_path: Path, threads: int) -> None:
    arena = Arena("t", arena_size(80 * MiB), str(tmp_path), eager=80 * MiB)
    try:
        assert arena.prefault_eager(threads)
        assert arena.faulted_bytes >= arena.eager == 80 * MiB
        assert pages.faulted(arena.view) == arena.faulted_bytes  # what a mapping client reads
        assert (tmp_path / Path(arena.path or "").name).stat().st_blocks * 512 >= 80 * MiB  # reserved
    finally:
        arena.close()


def test_closing_an_arena_while_it_prefaults_waits_for_the_chunks_in_flight(tmp_path: Path) -> None:
    arena = Arena("t", arena_size(512 * MiB), str(tmp_path), eager=512 * MiB)
    time.sleep(0.05)
    arena.close()  # the background prefault is mid-way: close waits for its chunks, then unmaps
    assert arena.path is not None and not Path(arena.path).exists()
    assert arena.faulted_bytes <= arena.eager


def serve(backend: MemoryBackend) -> tuple[Store, Callable[[], None]]:
    server = start_server(backend, MemoryCensus(), ServiceConfig(), listen="127.0.0.1:0")
    channel = grpc.insecure_channel(server.address)
    stub = store_pb2_grpc.KvStoreStub(channel)  # type: ignore[no-untyped-call]

    def stop() -> None:
        channel.close()
        server.stop(grace=0)

    return Store(server=server, stub=stub, backend=backend, channel=channel), stop


def gauge(store: Store, name: str) -> float:
    for line in generate_latest(store.server.service.metrics.registry).decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not exported")


def test_full_prefault_progress_is_visible_in_metrics_until_it_settles(tmp_path: Path) -> None:
    store, stop = serve(MemoryBackend(96 * MiB, shm_dir=str(tmp_path), prefault="full"))
    try:
        assert gauge(store, "kvtag_prefault_target_bytes") == 0  # nothing before the first session
        store.open(ns=namespace(tenant="a"))
        assert gauge(store, "kvtag_prefault_target_bytes") == 96 * MiB
        wait_until(lambda: gauge(store, "kvtag_prefault_touched_bytes") == 96 * MiB)
        assert store.backend.prefault_progress() == (96 * MiB, 96 * MiB)
        assert gauge(store, "kvtag_tenant_arenas") == 1
    finally:
        stop()


def test_lazy_prefault_commits_only_a_window_ahead_of_use(tmp_path: Path) -> None:
    store, stop = serve(MemoryBackend(96 * MiB, shm_dir=str(tmp_path), prefault="lazy"))
    try:
        session = store.open(ns=namespace(tenant="a"))
        time.sleep(0.3)
        assert store.backend.prefault_progress() == (0, 0)
        arena = store.backend.shared_arena(session.namespace_id)
        assert arena is not None and arena.eager == 0
        assert arena.faulted_bytes <= arena.size // 4 + 4 * MiB < 96 * MiB  # the window, not the capacity
    finally:
        stop()


def test_an_unknown_prefault_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="full or lazy"):
        MemoryBackend(MiB, prefault="eager")
