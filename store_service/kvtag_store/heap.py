"""Give freed heap back to the operating system after the census forgets namespaces.

glibc keeps what the process freed for reuse, and after a burst of short-lived namespaces (their
sessions, gRPC calls and protobuf arenas) that memory sits free in the middle of the heap, where
its ordinary trimming from the top never reaches. `malloc_trim` returns those free pages. Elsewhere
(musl, macOS) there is nothing to call and this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable


def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        trim: Callable[[int], int] = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    return trim


_TRIM = _malloc_trim()


def give_back() -> bool:
    """Return free heap pages to the system; True when some were."""
    return _TRIM is not None and bool(_TRIM(0))
