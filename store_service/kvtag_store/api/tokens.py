"""The token ids engines send with their puts (BlockRef.token_ids), kept for the KV events' BlockStored.

Nothing keeps them unless the store publishes KV events: then the publisher's `note` takes them before
the put reaches the backend, and the block's BlockStored carries them (kvtag_store.events.publisher).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import repeat

from kvtag.v1 import store_pb2 as pb

from kvtag_store import errors

# At most 4,096 token ids a block (uint32 each): beyond any block size vLLM uses.
MAX_TOKEN_ID_BYTES = 16 << 10

Note = Callable[[str, Sequence[tuple[int, bytes, bytes]]], None]


class TokenSink:
    """Where the token ids of puts go: nowhere until KV events start (app.server sets `note`)."""

    __slots__ = ("note",)

    def __init__(self) -> None:
        self.note: Note | None = None

    @property
    def wanted(self) -> bool:
        return self.note is not None

    def keep(self, namespace_id: str, items: Sequence[tuple[int, bytes, bytes]]) -> None:
        """(group, key, token_ids) of blocks about to be stored; items without tokens are skipped."""
        if self.note is not None:
            with_tokens = [item for item in items if item[2]]
            if with_tokens:
                self.note(namespace_id, with_tokens)


def check(token_ids: bytes, field: str) -> None:
    if len(token_ids) % 4 or len(token_ids) > MAX_TOKEN_ID_BYTES:
        raise errors.invalid_request(
            f"{field} is {len(token_ids)} bytes: send uint32 token ids, 4 bytes each, at most "
            f"{MAX_TOKEN_ID_BYTES // 4} a block, or leave it empty",
            field,
        )


def slot_tokens(request: pb.ReserveSlotsRequest | pb.CommitSlotsRequest) -> list[tuple[int, bytes, bytes]]:
    """(group, key, token_ids) of the blocks of a checked ReserveSlots or CommitSlots (packed runs,
    validation.packed_runs, or ReserveSlots' items) that carry token ids."""
    out: list[tuple[int, bytes, bytes]] = []
    for run in request.packed_items:
        if run.token_ids:
            k, count = run.key_length, len(run.keys) // run.key_length
            t = len(run.token_ids) // count
            keys = (run.keys[i * k : (i + 1) * k] for i in range(count))
            out.extend(
                zip(repeat(run.group), keys, (run.token_ids[i * t : (i + 1) * t] for i in range(count)))
            )
    if isinstance(request, pb.ReserveSlotsRequest):
        for index, item in enumerate(request.items):
            block = item.block
            if block.token_ids:
                check(block.token_ids, f"items[{index}].block.token_ids")
                out.append((block.group, block.key, block.token_ids))
    return out
