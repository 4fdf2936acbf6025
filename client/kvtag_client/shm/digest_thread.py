"""The shared-memory path's second thread: a put's or get's large slots are copied and digested in two
halves, one on the calling thread and one here, so both cores work on one transfer."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

from kvtag_client.shm.mapping import LARGE_SLOT_BYTES

_A = TypeVar("_A")
_R = TypeVar("_R")


class DigestThread:
    """One worker thread, started at the first large transfer and shut down with the client."""

    def __init__(self, closed: threading.Event) -> None:
        self._closed = closed
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None

    def in_halves(self, work: Callable[[list[_A]], _R], parts: list[_A], slots: list[memoryview]) -> list[_R]:
        """work(parts), or, when there are several slots and every one is large, work on the second
        half on this thread while the caller does the first (results in order). Each core copying
        and then hashing its own half beats one copying while the other hashes each finished slot
        (docs/benchmarks.md, "Figures behind choices in the code")."""
        if len(parts) < 2 or any(slot.nbytes < LARGE_SLOT_BYTES for slot in slots):
            return [work(parts)]
        half = len(parts) // 2
        beside = self._run_beside(work, parts[half:])
        try:
            first = work(parts[:half])
        finally:
            second = beside.result()
        return [first, second]

    def _run_beside(self, work: Callable[[_A], _R], argument: _A) -> Future[_R]:
        """work(argument) on the digest thread, or here once shutdown() has run."""
        with self._lock:
            if self._executor is None and not self._closed.is_set():
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="kvtag-digest")
            executor = self._executor
        try:
            if executor is not None:
                return executor.submit(work, argument)
        except RuntimeError:  # shut down by close(): take it here
            pass
        done: Future[_R] = Future()
        try:
            done.set_result(work(argument))
        except Exception as error:  # handed to the caller, as the thread would
            done.set_exception(error)
        return done

    def shutdown(self) -> None:
        """End the thread after its work in hand (the client is closing: `closed` is set)."""
        with self._lock:
            executor = self._executor
        if executor is not None:
            executor.shutdown(wait=True)
