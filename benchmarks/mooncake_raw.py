"""The raw Mooncake client reading into memory it registered, as vLLM's MooncakeStoreConnector reads
into a registered KV cache: the zero-copy peer the Mooncake benches set beside kvtag."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any


def register(raw: Any, base: int, nbytes: int) -> None:
    """Register [base, base + nbytes) with the raw client, or exit saying so (never inside an
    assert: `python -O` would drop the registration with it)."""
    if raw.register_buffer(base, nbytes) != 0:
        raise SystemExit(f"Mooncake refused to register {nbytes} bytes with the raw client")


@dataclass(frozen=True)
class Landing:
    """A buffer allocated once and registered with the raw client; alive as long as this is (unregister
    `base` when done)."""

    buffer: ctypes.Array[ctypes.c_char]
    base: int


def landing(raw: Any, nbytes: int) -> Landing:
    buffer = ctypes.create_string_buffer(nbytes)
    register(raw, ctypes.addressof(buffer), nbytes)
    return Landing(buffer, ctypes.addressof(buffer))


def get_into(raw: Any, keys: list[str], base: int, size: int) -> None:
    """batch_get_into of `size`-byte values into consecutive places from `base` (registered)."""
    codes = raw.batch_get_into(keys, [base + n * size for n in range(len(keys))], [size] * len(keys))
    assert codes == [size] * len(keys), codes
