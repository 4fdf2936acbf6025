"""Give freed heap back to the operating system after the census forgets namespaces.

glibc keeps what the process freed for reuse, and after a burst of short-lived namespaces (their
sessions, gRPC calls and protobuf arenas) that memory sits free in the middle of the heap, where
its ordinary trimming from the top never reaches. `malloc_trim` returns those free pages. Elsewhere
(musl, macOS) there is nothing to call and this does nothing.
"""

from __future__ import annotations

import ctypes
import gc
from collections.abc import Callable


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        # The symbols the interpreter already has loaded: glibc's when it is the C library (no lookup
        # of library files, which ctypes.util does with a subprocess).
        trim: Callable[[int], int] = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    return trim


_TRIM = _malloc_trim()


def give_back() -> bool:
    """Collect reference cycles, then return free heap pages to the system; True when some were.

    The collection comes first because forgotten namespaces leave cycles behind, and until the
    collector's next full pass they keep whole small-object arenas of the interpreter mapped. The
    full pass holds the GIL for a time that grows with the store's tracked objects
    (docs/benchmarks.md); a sweep forgets namespaces at most every 30 s, and the interpreter's own
    full passes cost the same."""
    gc.collect()
    return _TRIM is not None and bool(_TRIM(0))
