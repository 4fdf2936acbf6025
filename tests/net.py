"""Loopback ports and polling, for every suite and benchmark that runs a real server on 127.0.0.1."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on right now (the caller binds it soon after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str, interval_s: float = 0.02) -> float:
    """Poll `condition` every interval_s until true; return the seconds it took, fail after timeout_s."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(interval_s)
    return time.monotonic() - start
