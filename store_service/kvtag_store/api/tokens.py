"""The token ids engines send with their puts (BlockRef.token_ids), kept for the KV events' BlockStored.

Nothing keeps them unless the store publishes KV events: then the publisher's `note` takes them before
the put reaches the backend, and the block's BlockStored carries them (kvtag_store.events.publisher).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import repeat

from kvtag.v1 import store_pb2 as pb

from kvtag_store.api.codec import split_keys

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


def slot_tokens(request: pb.ReserveSlotsRequest | pb.CommitSlotsRequest) -> list[tuple[int, bytes, bytes]]:
    """(group, key, token_ids) of the blocks of a checked ReserveSlots or CommitSlots (packed runs,
    validation.packed_runs, or ReserveSlots' items, codec.reserve_items) that carry token ids."""
    out: list[tuple[int, bytes, bytes]] = []
    for run in request.packed_items:
        if run.token_ids:
            keys = split_keys(run.keys, run.key_length)
            out.extend(
                zip(repeat(run.group), keys, split_keys(run.token_ids, len(run.token_ids) // len(keys)))
            )
    if isinstance(request, pb.ReserveSlotsRequest):
        out.extend(
            (i.block.group, i.block.key, i.block.token_ids) for i in request.items if i.block.token_ids
        )
    return out
