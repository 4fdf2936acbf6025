"""Per-request block keys: which physical blocks of a request have a key yet, and what it is.

Keys are chained at the hash block size H; the store unit is the scheduler block of B = k*H tokens,
keyed by the key of its last hash block (which covers every token before it). With lookahead L, a
block's key exists only once the L tokens after it exist, so keys lag the tokens by up to a block.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from kvtag_client.extra_keys import extra_keys_from_request
from kvtag_client.keys import KeyChain, UnencodableExtraKeys

from .compat import LookaheadHasher
from .metadata import BlockTransfer
from .namespace import Geometry, vllm_lookahead_key


class _VllmChain:
    """key_scheme=vllm: the engine's own request.block_hashes.

    Where the core hashes with lookahead itself (0.34+ with the opt-in, `legacy_hasher` set), they are
    the keys, and the base keys come from vLLM's legacy hasher. Otherwise they are the base keys, and
    with lookahead L the keys are vLLM's own lookahead hashes where it defines them (`lookahead_hasher`,
    0.33), else the block hash with the L successor tokens appended (0.32)."""

    def __init__(
        self,
        request: Any,
        hash_block_size: int,
        lookahead: int,
        lookahead_hasher: LookaheadHasher | None,
        legacy_hasher: LookaheadHasher | None,
    ) -> None:
        self._request = request
        self._hash_block_size = hash_block_size
        self._lookahead = lookahead
        self._lookahead_hasher = lookahead_hasher
        self._legacy_hasher = legacy_hasher
        self.keys: list[bytes] = []
        self.base_keys: list[bytes] = []

    def refresh(self) -> None:
        hashes = self._request.block_hashes
        tokens = self._request.all_token_ids
        if self._legacy_hasher is not None:
            self.keys.extend(bytes(h) for h in hashes[len(self.keys) :])
            self.base_keys.extend(self._legacy_hasher(self._request, self.base_keys))
            return
        while len(self.base_keys) < len(hashes):
            self.base_keys.append(bytes(hashes[len(self.base_keys)]))
        if self._lookahead and self._lookahead_hasher is not None:
            self.keys.extend(self._lookahead_hasher(self._request, self.keys))
            return
        while len(self.keys) < len(self.base_keys):
            i = len(self.keys)
            end = (i + 1) * self._hash_block_size
            if len(tokens) < end + self._lookahead:
                break
            self.keys.append(vllm_lookahead_key(self.base_keys[i], list(tokens[end : end + self._lookahead])))


@dataclass
class RequestKeys:
    """Keys of one request's blocks, grown as tokens become known."""

    request: Any
    geometry: Geometry
    lookahead: int
    scheme: str
    # key_scheme=vllm with lookahead: vLLM's own lookahead hasher where kvtag computes the keys (0.33),
    # or its legacy hasher for the base keys where the core's block_hashes are the keys (0.34+).
    lookahead_hasher: LookaheadHasher | None = None
    legacy_hasher: LookaheadHasher | None = None
    encodable: bool = True
    _chain: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        try:
            if self.scheme == "canonical":
                self._chain = KeyChain(
                    self.geometry.hash_block_size, self.lookahead, extra_keys_from_request(self.request)
                )
            else:
                extra_keys_from_request(self.request)  # same refusal rule: no encodable identity, no sharing
                self._chain = _VllmChain(
                    self.request,
                    self.geometry.hash_block_size,
                    self.lookahead,
                    self.lookahead_hasher,
                    self.legacy_hasher,
                )
        except UnencodableExtraKeys:
            self.encodable = False

    def refresh(self) -> None:
        """Derive keys for tokens the request gained since the last call."""
        if not self.encodable:
            return
        if isinstance(self._chain, KeyChain):
            tokens = self.request.all_token_ids
            if len(tokens) > self._chain.num_tokens:
                self._chain.extend(tokens[self._chain.num_tokens :])
        else:
            self._chain.refresh()

    def num_keyed_blocks(self) -> int:
        """Store blocks (B tokens each) whose key exists: max_save_tokens = this * B."""
        if not self.encodable:
            return 0
        return len(self._chain.keys) // self.geometry.hashes_per_block

    def key(self, block: int) -> bytes:
        return bytes(self._chain.keys[(block + 1) * self.geometry.hashes_per_block - 1])

    def keys_of(self, start: int, end: int) -> list[bytes]:
        """key(j) for the blocks j in [start, end), by one C-level slice: a 64k-token load plan keys
        4,096 blocks inside the scheduler's step. Shorter when the later blocks have no key yet."""
        step = self.geometry.hashes_per_block
        keys: list[bytes] = self._chain.keys[(start + 1) * step - 1 : end * step : step]
        return keys

    def base_key(self, block: int) -> bytes:
        index = (block + 1) * self.geometry.hashes_per_block - 1
        base = self._chain.base_keys
        return bytes(base[index]) if index < len(base) else b""

    def packed(self, start: int, end: int) -> tuple[bytes, int, bytes] | None:
        """Keys of blocks [start, end) concatenated, their length, and the base keys concatenated
        (b"" unless every block has one): Lookup's packed form, built by C-level slicing and join.
        None when the keys differ in length (they cannot be packed as one run)."""
        step = self.geometry.hashes_per_block
        first, stop = (start + 1) * step - 1, end * step
        selected = self._chain.keys[first:stop:step]
        if not selected:
            return None
        lengths = set(map(len, selected))
        if len(lengths) != 1:
            return None
        base = self._chain.base_keys
        base_selected = base[first:stop:step] if stop <= len(base) else []
        bases = b"".join(base_selected) if len(set(map(len, base_selected))) == 1 else b""
        return b"".join(selected), lengths.pop(), bases


@dataclass
class LoadPlan:
    """An external hit found by a lookup, waiting for the scheduler to allocate blocks for it."""

    start_block: int
    num_blocks: int
    # Per TP rank, the read leases of its lookup (see LoadJob.leases).
    leases: tuple[tuple[str, ...], ...]
    # (start_block, keyed blocks) the plan was computed for: repeat queries reuse it.
    query: tuple[int, int]


@dataclass(frozen=True)
class Hit:
    """A Lookup's answer: the blocks every TP rank can load, and each rank's lease ids."""

    num_blocks: int
    leases: tuple[tuple[str, ...], ...]


@dataclass
class RequestState:
    """What the scheduler side remembers about one request."""

    keys: RequestKeys
    next_save_block: int = 0
    state_stored: set[int] = field(default_factory=set)
    plan: LoadPlan | None = None
    # A Lookup still running on the lookup threads: (query, its future).
    pending: tuple[tuple[int, int], Future[Hit]] | None = None
    load_confirmed: bool = False
    # A load for this request failed: it recomputes instead of asking the store again (and looping).
    load_failed: bool = False
    # With audit on: every KV block this request saved, re-read from the engine when it finishes.
    saved: list[BlockTransfer] = field(default_factory=list)
