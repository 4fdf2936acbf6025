"""What a companion engine's scheduler reports for the store's census (data_path MooncakeStoreConnector).

The peer moves the bytes, so the store sees none of them: the scheduler counts them itself and sends the
counts with its session's heartbeats (StoreClient.report_usage), off the step.

- **Lookups, hits, misses**: per `get_num_new_matched_tokens` the peer answered, the full blocks asked
  about beyond the locally computed ones, and how many of them the peer found.
- **Stored**: the full blocks the engine offered the peer to save: per save job in the metadata the peer
  built for a step (`ReqMeta.can_save`), the B-token blocks in its new token range
  [`token_ids_start`, `token_len_chunk`), once per block position (not per KV cache group). The peer's
  worker still skips blocks the cluster already holds and may fail a put, so this counts what was
  offered, not what was written; partial tails and Mamba boundary states (`boundary_puts`) are not
  counted.
- **Base keys**, for cross-mode misses (the store's base-key index, policy/base_keys.py): each stored
  block's, and those of the first MISSED_SAMPLE_PER_REQUEST missed blocks of each lookup. A block's
  base key is vLLM's legacy (L=0) block hash of its last hash block: `request.block_hashes` where the
  core hashes without lookahead, vLLM's legacy hasher where it hashes with it (0.34+ opted in).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvtag_proto.usage import MISSED_SAMPLE_PER_REQUEST

from . import compat
from .namespace import vllm_hash_fn

# Requests whose legacy hash chain is kept (0.34+ with lookahead): one per live request, a bound
# all the same (the oldest leave first; a request past it reports no base keys).
_MAX_CHAINS = 4096


class CompanionCensus:
    def __init__(
        self,
        report: Callable[..., None],
        vllm_config: Any,
        block_size: int,
        hash_block_size: int,
        lookahead_tokens: int,
    ) -> None:
        """`report`: StoreClient.report_usage. With core lookahead the request's block hashes are
        lookahead hashes, so the base keys come from vLLM's legacy hasher."""
        self._report = report
        self.block_size = block_size
        self._per_block = max(block_size // hash_block_size, 1)
        self._legacy = (
            compat.vllm_legacy_hasher(vllm_hash_fn(vllm_config), hash_block_size)
            if lookahead_tokens
            else None
        )
        # req_id -> (request, its legacy hash chain so far): only with core lookahead.
        self._chains: dict[str, tuple[Any, list[bytes]]] = {}

    def looked_up(self, request: Any, num_computed_tokens: int, tokens: int) -> None:
        """The peer answered `tokens` new matched tokens for `request`."""
        first = num_computed_tokens // self.block_size
        asked = max((request.num_tokens - 1) // self.block_size - first, 0)
        hits = min(tokens // self.block_size, asked)
        if self._legacy is not None:
            self._chains.setdefault(request.request_id, (request, []))
            if len(self._chains) > _MAX_CHAINS:
                del self._chains[next(iter(self._chains))]
        sample = range(first + hits, min(first + asked, first + hits + MISSED_SAMPLE_PER_REQUEST))
        self._report(
            lookups=1,
            hits=hits,
            misses=asked - hits,
            missed_base_keys=self._base_keys(request.request_id, request.block_hashes, sample),
        )

    def offered(self, metadata: Any) -> None:
        """The save jobs of one step's peer metadata (see the module docstring for what counts)."""
        stored = 0
        keys: list[tuple[int, bytes]] = []
        for job in getattr(metadata, "requests", ()):
            if not getattr(job, "can_save", False):
                continue
            start = int(getattr(job, "token_ids_start", 0)) // self.block_size
            end = int(getattr(job, "token_len_chunk", 0)) // self.block_size
            if end <= start:
                continue
            stored += end - start
            keys.extend(self._base_keys(job.req_id, getattr(job, "block_hashes", ()), range(start, end)))
        if stored:
            self._report(stored=stored, stored_base_keys=keys)

    def finished(self, req_id: str) -> None:
        self._chains.pop(req_id, None)

    def _base_keys(self, req_id: str, block_hashes: Any, blocks: range) -> list[tuple[int, bytes]]:
        """(group 0, base key) of `blocks` that have one yet."""
        if not blocks:
            return []
        hashes: Any = block_hashes
        if self._legacy is not None:
            tracked = self._chains.get(req_id)
            if tracked is None:
                return []
            request, chain = tracked
            if len(chain) < blocks[-1] * self._per_block + self._per_block:
                chain.extend(self._legacy(request, chain))
            hashes = chain
        keys = []
        for block in blocks:
            index = (block + 1) * self._per_block - 1
            if index >= len(hashes):
                break
            keys.append((0, bytes(hashes[index])))
        return keys
