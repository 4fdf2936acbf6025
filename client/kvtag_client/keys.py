"""The canonical block-key scheme: seed-free, vLLM-independent chained SHA-256 over fixed binary bytes.

docs/canonical-keys.md is the normative specification, with known-answer vectors
(docs/canonical-key-vectors.json). Keys are raw 32-byte digests: they go on the
wire as-is, and bytes avoid per-key object overhead in the connector's hot path.
"""

from __future__ import annotations

import array
import bisect
import hashlib
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from kvtag.v1 import store_pb2 as pb
from kvtag_proto.ids import probe_tokens

SCHEME = "canonical"
SCHEME_VERSION = "1"
HASH_ALGORITHM = "sha256"

# Domain separation: a chain value can never be mistaken for a key or a root.
ROOT_DOMAIN = b"kvtag.canonical.v1/root\x00"
BLOCK_DOMAIN = b"kvtag.canonical.v1/block\x00"
KEY_DOMAIN = b"kvtag.canonical.v1/key\x00"

_U32_MAX = 0xFFFFFFFF
_U32_CODE = next(code for code in "IL" if array.array(code).itemsize == 4)
_SWAP = sys.byteorder == "little"


class UnencodableExtraKeys(ValueError):
    """Extra keys that have no canonical encoding; such a request must be neither stored nor loaded."""


@dataclass(frozen=True, slots=True)
class ExtraKeys:
    """Request-level identifiers that change what the KV means, beyond the token ids."""

    lora_name: str | None = None
    cache_salt: str | None = None
    # (identifier, offset, length) of each multimodal placeholder run, in token positions.
    mm_items: tuple[tuple[str, int, int], ...] = ()


@dataclass(frozen=True, slots=True)
class _MMItem:
    offset: int
    length: int
    encoded: bytes  # str(identifier) || u32(offset) || u32(length)

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True, slots=True)
class _Encoded:
    """Extras validated and encoded once per request."""

    root: bytes
    mm_items: tuple[_MMItem, ...]  # sorted by (offset, length, utf8(identifier))
    mm_offsets: tuple[int, ...]  # mm_items' offsets, for bisection
    mm_max_length: int


def _u32(value: int) -> bytes:
    return struct.pack(">I", value)


def _utf8(value: object, what: str) -> bytes:
    if not isinstance(value, str):
        raise UnencodableExtraKeys(f"{what} must be a str, got {type(value).__name__}")
    try:
        raw = value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise UnencodableExtraKeys(f"{what} is not valid UTF-8 ({exc.reason}): {value!r}") from exc
    if len(raw) > _U32_MAX:
        raise UnencodableExtraKeys(f"{what} is longer than 2^32-1 bytes")
    return raw


def _str(value: object, what: str) -> bytes:
    raw = _utf8(value, what)
    return _u32(len(raw)) + raw


def _opt_str(value: object, what: str) -> bytes:
    return b"\x00" if value is None else b"\x01" + _str(value, what)


def _position(value: object, what: str, minimum: int) -> int:
    # bool is an int subclass; True as an offset is a bug upstream, not a position.
    if not isinstance(value, int) or isinstance(value, bool):
        raise UnencodableExtraKeys(f"{what} must be an int, got {type(value).__name__}")
    if not minimum <= value <= _U32_MAX:
        raise UnencodableExtraKeys(f"{what} must be in [{minimum}, 2^32-1], got {value}")
    return value


def _check_geometry(hash_block_size: int, lookahead_tokens: int) -> None:
    if not 0 < hash_block_size <= _U32_MAX:
        raise ValueError(f"hash_block_size must be in [1, 2^32-1], got {hash_block_size}")
    if not 0 <= lookahead_tokens <= _U32_MAX:
        raise ValueError(f"lookahead_tokens must be in [0, 2^32-1], got {lookahead_tokens}")


def _encode_extras(hash_block_size: int, extras: ExtraKeys | None) -> _Encoded:
    extras = extras if extras is not None else ExtraKeys()
    root_input = (
        ROOT_DOMAIN
        + _u32(hash_block_size)
        + _opt_str(extras.lora_name, "lora_name")
        + _opt_str(extras.cache_salt, "cache_salt")
    )
    if not isinstance(extras.mm_items, tuple | list):
        raise UnencodableExtraKeys(f"mm_items must be a sequence, got {type(extras.mm_items).__name__}")
    items: list[tuple[int, int, bytes, bytes]] = []
    for n, item in enumerate(extras.mm_items):
        if not isinstance(item, tuple | list) or len(item) != 3:
            raise UnencodableExtraKeys(f"mm_items[{n}] must be (identifier, offset, length), got {item!r}")
        identifier, offset, length = item
        ident = _utf8(identifier, f"mm_items[{n}] identifier")
        if not ident:
            # An empty identifier would make two different images share keys.
            raise UnencodableExtraKeys(f"mm_items[{n}] identifier is empty")
        start = _position(offset, f"mm_items[{n}] offset", 0)
        size = _position(length, f"mm_items[{n}] length", 1)
        if start + size > _U32_MAX:
            raise UnencodableExtraKeys(f"mm_items[{n}] ends beyond token position 2^32-1")
        items.append((start, size, ident, _u32(len(ident)) + ident + _u32(start) + _u32(size)))
    items.sort(key=lambda it: (it[0], it[1], it[2]))
    return _Encoded(
        root=hashlib.sha256(root_input).digest(),
        mm_items=tuple(_MMItem(offset=o, length=s, encoded=e) for o, s, _, e in items),
        mm_offsets=tuple(it[0] for it in items),
        mm_max_length=max((it[1] for it in items), default=0),
    )


def check_extra_keys(extras: ExtraKeys) -> None:
    """Raise UnencodableExtraKeys now if `extras` has no canonical encoding (before any key is derived)."""
    _encode_extras(1, extras)


_EMPTY_MM = struct.pack(">I", 0)  # u32(0): a block no multimodal item overlaps


def _mm_list(encoded: _Encoded, start: int, end: int) -> bytes:
    """u32(count) || encoded items overlapping token range [start, end), in canonical order."""
    if start >= end or not encoded.mm_items:
        return _u32(0)
    # Only items starting in (start - longest item, end) can overlap: bisect instead of scanning all.
    lo = bisect.bisect_right(encoded.mm_offsets, start - encoded.mm_max_length)
    hi = bisect.bisect_left(encoded.mm_offsets, end)
    hits = [it.encoded for it in encoded.mm_items[lo:hi] if it.end > start]
    return _u32(len(hits)) + b"".join(hits)


def _pack_tokens(token_ids: Sequence[int]) -> bytes:
    """Big-endian u32 per token. An array and one byte swap: cheaper than struct.pack with one
    argument per token, and paid inside the scheduler's step."""
    try:
        packed = array.array(_U32_CODE, token_ids)
    except (OverflowError, TypeError) as exc:
        bad = next((t for t in token_ids if not isinstance(t, int) or not 0 <= t <= _U32_MAX), None)
        raise ValueError(f"token ids must be ints in [0, 2^32-1], got {bad!r}") from exc
    if _SWAP:
        packed.byteswap()
    return packed.tobytes()


def _chain_step(parent: bytes, block_tokens: bytes, mm: bytes) -> bytes:
    return hashlib.sha256(BLOCK_DOMAIN + parent + block_tokens + mm).digest()


def _finalize(chain_value: bytes, lookahead_tokens: int, lookahead: bytes, mm: bytes) -> bytes:
    return hashlib.sha256(KEY_DOMAIN + chain_value + _u32(lookahead_tokens) + lookahead + mm).digest()


def block_keys(
    token_ids: Sequence[int],
    hash_block_size: int,
    lookahead_tokens: int,
    extras: ExtraKeys | None = None,
) -> list[bytes]:
    """Keys of every block i with len(token_ids) >= (i+1)*H + L, in order (L=0: the base keys).

    Written straight from the specification; KeyChain is the incremental form and
    is tested to agree with this one.
    """
    _check_geometry(hash_block_size, lookahead_tokens)
    encoded = _encode_extras(hash_block_size, extras)
    h, la = hash_block_size, lookahead_tokens
    count = max(0, (len(token_ids) - la) // h)
    keys: list[bytes] = []
    chain = encoded.root
    for i in range(count):
        start, end = i * h, (i + 1) * h
        chain = _chain_step(chain, _pack_tokens(token_ids[start:end]), _mm_list(encoded, start, end))
        keys.append(
            _finalize(chain, la, _pack_tokens(token_ids[end : end + la]), _mm_list(encoded, end, end + la))
        )
    return keys


class KeyChain:
    """Incremental canonical keys of one request: each token is hashed once as the request grows.

    `keys` are the mode keys (lookahead keys when L > 0); `base_keys` are the L=0
    keys of the same blocks, sent for cross-mode-miss diagnostics. Base keys exist
    as soon as a block is full; lookahead keys lag by L tokens. Both lists grow
    in place; callers must not mutate them.
    """

    def __init__(self, hash_block_size: int, lookahead_tokens: int, extras: ExtraKeys | None = None) -> None:
        _check_geometry(hash_block_size, lookahead_tokens)
        self.hash_block_size = hash_block_size
        self.lookahead_tokens = lookahead_tokens
        self._encoded = _encode_extras(hash_block_size, extras)
        # Only tokens not yet needed by any key are dropped: [_offset, ...) is kept.
        self._tail: list[int] = []
        self._offset = 0
        self._num_tokens = 0
        self._chain: list[bytes] = []  # chain value of block i at index i - _chain_offset
        self._chain_offset = 0
        self._base_keys: list[bytes] = []
        self._keys: list[bytes] = [] if lookahead_tokens > 0 else self._base_keys

    @property
    def keys(self) -> list[bytes]:
        return self._keys

    @property
    def base_keys(self) -> list[bytes]:
        return self._base_keys

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    def extend(self, token_ids: Sequence[int]) -> None:
        """Append newly known tokens and derive every key they complete.

        The kept tokens are packed once per call and cut per block, and the constant parts of each
        hash input are joined once: a 64k-token prompt is keyed inside vLLM's scheduler step, so the
        per-block Python is what the engine waits for (docs/benchmarks.md, scheduler-side cost)."""
        if not token_ids:
            return
        # The kept tail is short (under H + L tokens) and valid; the new tokens are packed, and so
        # validated, once, before any state changes.
        packed = _pack_tokens(self._tail) + _pack_tokens(token_ids)
        self._tail.extend(token_ids)
        self._num_tokens += len(token_ids)
        h, la, encoded = self.hash_block_size, self.lookahead_tokens, self._encoded
        base = self._offset
        plain = not encoded.mm_items  # then every mm list is the empty one
        sha256 = hashlib.sha256
        base_suffix = _u32(0) + _u32(0)  # lookahead count 0, no lookahead tokens, empty mm list
        while self._num_tokens >= (len(self._base_keys) + 1) * h:
            i = len(self._base_keys)
            start, end = i * h, (i + 1) * h
            parent = self._chain[-1] if self._chain else encoded.root
            tokens = packed[(start - base) * 4 : (end - base) * 4]
            if plain:
                value = sha256(BLOCK_DOMAIN + parent + tokens + _EMPTY_MM).digest()
                self._chain.append(value)
                self._base_keys.append(sha256(KEY_DOMAIN + value + base_suffix).digest())
                continue
            value = _chain_step(parent, tokens, _mm_list(encoded, start, end))
            self._chain.append(value)
            self._base_keys.append(_finalize(value, 0, b"", _mm_list(encoded, end, end)))
        if la > 0:
            la_head = _u32(la)
            while self._num_tokens >= (len(self._keys) + 1) * h + la:
                i = len(self._keys)
                end = (i + 1) * h
                value = self._chain[i - self._chain_offset]
                ahead = packed[(end - base) * 4 : (end + la - base) * 4]
                if plain:
                    self._keys.append(sha256(KEY_DOMAIN + value + la_head + ahead + _EMPTY_MM).digest())
                else:
                    self._keys.append(_finalize(value, la, ahead, _mm_list(encoded, end, end + la)))
        self._trim()

    def _trim(self) -> None:
        """Forget tokens and chain values no pending key can need, so memory stays O(H + L)."""
        h = self.hash_block_size
        pending = len(self._keys)  # first block whose mode key is still missing
        keep_chain_from = pending
        drop_chain = keep_chain_from - self._chain_offset - 1  # keep the last value as the parent
        if drop_chain > 0:
            del self._chain[:drop_chain]
            self._chain_offset += drop_chain
        keep_tokens_from = min(len(self._base_keys) * h, (pending + 1) * h)
        drop_tokens = keep_tokens_from - self._offset
        if drop_tokens > 0:
            del self._tail[:drop_tokens]
            self._offset += drop_tokens


def probe_keys(hash_block_size: int, lookahead_tokens: int) -> list[bytes]:
    """The known-answer probe keys this scheme sends at OpenSession: exactly two."""
    keys = block_keys(probe_tokens(hash_block_size, lookahead_tokens), hash_block_size, lookahead_tokens)
    assert len(keys) == 2, "probe_tokens must yield exactly two keyed blocks"
    return keys


def mode(hash_block_size: int, lookahead_tokens: int) -> pb.HashingMode:
    """The HashingMode this scheme declares for a given geometry (seed-free: no seed fingerprint)."""
    _check_geometry(hash_block_size, lookahead_tokens)
    return pb.HashingMode(
        key_scheme=SCHEME,
        scheme_version=SCHEME_VERSION,
        hash_algorithm=HASH_ALGORITHM,
        hash_block_size=hash_block_size,
        lookahead_tokens=lookahead_tokens,
        seed_fingerprint="",
    )
