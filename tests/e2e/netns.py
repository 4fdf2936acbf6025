"""A private network namespace for the calling thread, for a test module that runs Mooncake itself.

Mooncake's transfer engine listens on every interface, so every process of a Mooncake test runs where
loopback is the only interface. `private_netns()` moves the calling thread (pytest's, which starts every
process of the module) into a fresh namespace with loopback up, and back on exit: processes it starts
meanwhile (the cluster, kvtag stores, engines, `kvtag-store diagnose`) are born inside it, as under
`unshare -n`. Needs CAP_SYS_ADMIN (root here, as `unshare -n` does).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import subprocess
from collections.abc import Iterator

CLONE_NEWNET = 0x40000000


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


@contextlib.contextmanager
def private_netns() -> Iterator[None]:
    libc = ctypes.CDLL(None, use_errno=True)
    original = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        _check(libc.unshare(CLONE_NEWNET), "unshare(CLONE_NEWNET)")
        try:
            subprocess.run(["ip", "link", "set", "lo", "up"], check=True, timeout=10)
            yield
        finally:
            _check(libc.setns(original, CLONE_NEWNET), "setns back to the original network namespace")
    finally:
        os.close(original)
