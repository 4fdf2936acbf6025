"""kvtag_proto.pages: mapping pages ahead of use lets the process's other threads run meanwhile."""

from __future__ import annotations

import mmap
import threading
import time

from kvtag_proto import pages


def test_populating_a_range_maps_it_and_releases_the_gil_meanwhile() -> None:
    """The prefaulter (service) and the arena follower (client) run beside threads that serve calls or
    an engine: while a large range is mapped, another thread must keep running, and the pages must
    be writable afterwards."""
    size = 256 << 20
    memory = mmap.mmap(-1, size, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
    ticks: list[float] = []
    stop = threading.Event()

    def tick() -> None:
        while not stop.is_set():
            ticks.append(time.monotonic())

    ticker = threading.Thread(target=tick)
    ticker.start()
    try:
        time.sleep(0.05)
        started = time.monotonic()
        pages.populate_write(pages.base_address(memory), 0, size)
        ended = time.monotonic()
    finally:
        stop.set()
        ticker.join()
    during = [t for t in ticks if started <= t <= ended]
    gaps = [b - a for a, b in zip([started, *during], [*during, ended], strict=True)]
    # mmap.madvise would hold the GIL for the whole call: one gap as long as the call.
    assert max(gaps) < max(0.5 * (ended - started), 0.02), (ended - started, max(gaps))
    memory[size - 1 : size] = b"x"
    assert memory[size - 1 : size] == b"x"
    memory.close()  # the address taken for madvise left no export behind
