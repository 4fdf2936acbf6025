"""The kvtag store client: one session, bounded deadlines, degrade-never-fail.

Every public call returns within its deadline and never raises: when the store
is unreachable, slow or erroring, lookups report misses, puts are dropped and
counted, and a background thread re-opens the session once the store answers
again. A session refused by policy (strict namespace, probe disagreement) is
logged once with the field diff and the engine runs without the store.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvtag_client.calls import Leases
from kvtag_client.get_decoding import Value
from kvtag_client.inline_transfer import InlineTransfer
from kvtag_client.items import PutItem, PutItemFields, SizedItem, SizedItemFields
from kvtag_client.lookups import LookupResult, Lookups, PackedKeys, pack_blocks
from kvtag_client.session import ClientCounters, StoreState
from kvtag_client.shared_memory import copy_into
from kvtag_client.shared_memory_transfer import SharedMemoryTransfer, SharedPut

__all__ = [
    "ClientCounters",
    "Leases",
    "LookupResult",
    "PackedKeys",
    "PutItem",
    "SharedPut",
    "SizedItem",
    "StoreClient",
    "StoreState",
    "pack_blocks",
]


class StoreClient(Lookups, InlineTransfer, SharedMemoryTransfer):
    """Thread-safe client of one kvtag store session (see module docstring): each put and get goes
    through the shared-memory arena while the session has one, inline otherwise."""

    def put(self, items: Sequence[PutItemFields]) -> list[int] | None:
        """Store (group, key, value, base_key) items; a PutStatus per item, or None when all were dropped.

        Batches are split into Put messages within the server's Limits (at most
        max_batch_items items, under max_message_bytes), several in flight. Items that
        cannot be sent at all (bad key, value larger than a message) are REJECTED
        locally; items lost to a failure mid-batch are UNSPECIFIED and counted as dropped,
        except those of the messages answered before the failure.
        """
        if not items:
            return []
        if self._shared_arena() is not None:

            def copy(index: int, slot: memoryview) -> None:
                copy_into(slot, items[index][2])

            return self.put_from([(g, k, len(v), b) for g, k, v, b in items], copy)
        return self._put_inline(items)

    def get(self, blocks: Sequence[tuple[int, bytes]], leases: Leases = ()) -> list[Value | None]:
        """Values of (group, key) blocks; None for each block not served (miss, mismatch, degraded).

        A value is a read-only buffer (a view into the received message, see get_decoding): compare,
        len() and copy it like bytes; take bytes(value) to keep it beyond the caller's use.

        Get messages of ~_message_target bytes (by the largest value seen so far; the
        server's largest value before any is seen) go several in flight; a lookup's leases are
        released with the single message (when there is one lease), or after all of them.
        """
        if blocks and self._shared_arena() is not None:
            copies: list[Value | None] = [None] * len(blocks)

            def copy(index: int, slot: memoryview) -> bool:
                copies[index] = bytes(slot)
                return True

            served = self.get_into(blocks, leases, copy)
            return [value if ok else None for value, ok in zip(copies, served, strict=True)]
        return self._get_inline(blocks, leases)

    def put_from(
        self, items: Sequence[SizedItemFields], fill: Callable[[int, memoryview], None]
    ) -> list[int] | None:
        """Store (group, key, length, base_key) items whose bytes `fill(index, destination)` writes
        (exactly `length` bytes into the memoryview): straight into arena slots on the shared-memory
        path, into a fresh buffer sent inline otherwise. Results as for put(). `fill` may be called
        from two threads at once, for distinct indices (see write_slots)."""
        reservation = self.reserve(items)
        if reservation is None:
            if self._shared_arena() is not None or not items:
                return None if items else []
            buffers: list[bytes] = []
            for index, (_, _, length, _) in enumerate(items):
                buffer = bytearray(length)
                fill(index, memoryview(buffer))
                buffers.append(bytes(buffer))
            return self.put([(g, k, buffers[n], b) for n, (g, k, _, b) in enumerate(items)])
        self.write_slots(reservation, fill)
        return self.commit(reservation)

    def get_into(
        self, blocks: Sequence[tuple[int, bytes]], leases: Leases, sink: Callable[[int, memoryview], bool]
    ) -> list[bool]:
        """Hand each served block's bytes to `sink(index, source)`, which copies them where they belong
        and returns False to reject them (e.g. the wrong size); True per block whose copy stands.
        On the shared-memory path `source` is the pinned arena slot, valid only during the call, and a
        copy from a slot reused meanwhile is voided (False); inline it is the received value."""
        arena = self._shared_arena()
        if arena is None:
            values = self.get(blocks, leases)
            return [value is not None and sink(n, memoryview(value)) for n, value in enumerate(values)]
        return self._get_shared(arena, blocks, leases, sink)
