"""A second, deliberately naive implementation of docs/canonical-keys.md, written from the text alone.

The known-answer vectors are produced and checked by this module, so a change
to kvtag_client.keys that drifts from the specification cannot also move the
vectors with it.
"""

from __future__ import annotations

import hashlib
from typing import Any


def u32(v: int) -> bytes:
    return v.to_bytes(4, "big")


def text(s: str) -> bytes:
    raw = s.encode("utf-8")
    return u32(len(raw)) + raw


def optional_text(s: str | None) -> bytes:
    return b"\x00" if s is None else b"\x01" + text(s)


def mm_list(items: list[tuple[str, int, int]], start: int, end: int) -> bytes:
    chosen = [it for it in items if start < end and it[1] < end and it[1] + it[2] > start]
    chosen.sort(key=lambda it: (it[1], it[2], it[0].encode("utf-8")))
    return u32(len(chosen)) + b"".join(text(i) + u32(o) + u32(n) for i, o, n in chosen)


def root(h: int, lora_name: str | None, cache_salt: str | None) -> bytes:
    return hashlib.sha256(
        b"kvtag.canonical.v1/root\x00" + u32(h) + optional_text(lora_name) + optional_text(cache_salt)
    ).digest()


def keys(
    tokens: list[int],
    h: int,
    la: int,
    lora_name: str | None = None,
    cache_salt: str | None = None,
    mm_items: list[tuple[str, int, int]] | None = None,
) -> list[bytes]:
    items = list(mm_items or [])
    out: list[bytes] = []
    chain = root(h, lora_name, cache_salt)
    i = 0
    while len(tokens) >= (i + 1) * h + la:
        s, e = i * h, (i + 1) * h
        chain = hashlib.sha256(
            b"kvtag.canonical.v1/block\x00"
            + chain
            + b"".join(u32(t) for t in tokens[s:e])
            + mm_list(items, s, e)
        ).digest()
        out.append(
            hashlib.sha256(
                b"kvtag.canonical.v1/key\x00"
                + chain
                + u32(la)
                + b"".join(u32(t) for t in tokens[e : e + la])
                + mm_list(items, e, e + la)
            ).digest()
        )
        i += 1
    return out


def keys_of_vector(vector: dict[str, Any]) -> list[str]:
    extras = vector["extras"]
    return [
        k.hex()
        for k in keys(
            vector["token_ids"],
            vector["hash_block_size"],
            vector["lookahead_tokens"],
            extras["lora_name"],
            extras["cache_salt"],
            [(i, o, n) for i, o, n in extras["mm_items"]],
        )
    ]
