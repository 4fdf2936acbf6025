"""The kvtag store client: one session, bounded deadlines, degrade-never-fail.

Every public call returns within its deadline and never raises: when the store
is unreachable, slow or erroring, lookups report misses, puts are dropped and
counted, and a background thread re-opens the session once the store answers
again. A session refused by policy (strict namespace, probe disagreement) is
logged once with the field diff and the engine runs without the store.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Generic, Self, TypeVar, overload

from kvtag.v1 import store_pb2 as pb
from kvtag_proto.channels import ChannelSecurity
from kvtag_proto.errors import KvtagError

from kvtag_client.calls import Caller, Leases
from kvtag_client.inline.get_decoding import Value
from kvtag_client.inline.transfer import InlinePath
from kvtag_client.items import PutItem, PutItemFields, SizedItem, SizedItemFields
from kvtag_client.lookups import LookupResult, Lookups
from kvtag_client.packed_keys import PackedKeys, pack_blocks
from kvtag_client.session import ClientCounters, Session, StoreState
from kvtag_client.shm.mapping import copy_into
from kvtag_client.shm.path import SharedMemoryPath
from kvtag_client.shm.put import SharedPut
from kvtag_client.usage import BaseKey

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
    "Value",
    "pack_blocks",
]

_T = TypeVar("_T")


class _OfSession(Generic[_T]):
    """An attribute of the session, read and written through the client under the same name."""

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    @overload
    def __get__(self, client: None, owner: type) -> Self: ...
    @overload
    def __get__(self, client: StoreClient, owner: type) -> _T: ...
    def __get__(self, client: StoreClient | None, owner: type) -> Any:
        return self if client is None else getattr(client.session, self._name)

    def __set__(self, client: StoreClient, value: _T) -> None:
        setattr(client.session, self._name, value)


class StoreClient:
    """Thread-safe client of one kvtag store session (see module docstring): each put and get goes
    through the shared-memory arena while the session has one, inline otherwise.

    Built of parts, each public for tests and tools: `session` (state machine, heartbeat, channel),
    `caller` (deadlines, retry, limits), `lookups`, `inline` and `shm` (the two data paths)."""

    endpoint = _OfSession[str]()
    engine_id = _OfSession[str]()
    namespace = _OfSession[pb.NamespaceDescriptor]()
    mode = _OfSession[pb.HashingMode]()
    probe_keys = _OfSession[list[bytes]]()
    labels = _OfSession[dict[str, str]]()
    rpc_timeout_s = _OfSession[float]()
    reconnect_interval_s = _OfSession[float]()
    min_transfer_bytes_per_s = _OfSession[float]()
    state = _OfSession[StoreState]()
    session_id = _OfSession[str]()
    mode_id = _OfSession[str]()
    namespace_id = _OfSession[str]()
    refusal = _OfSession[pb.ModeRefusal | None]()
    refusal_error = _OfSession[KvtagError | None]()
    warnings = _OfSession[list[pb.CensusWarning]]()
    counters = _OfSession[ClientCounters]()
    limits = _OfSession[pb.Limits]()
    session_ttl_ms = _OfSession[int]()
    wants_token_ids = _OfSession[bool]()

    def __init__(
        self,
        endpoint: str,
        *,
        engine_id: str,
        namespace: pb.NamespaceDescriptor,
        mode: pb.HashingMode,
        probe_keys: Sequence[bytes],
        labels: Mapping[str, str] | None = None,
        rpc_timeout_s: float = 1.0,
        reconnect_interval_s: float = 2.0,
        block_bytes_hint: int = 0,
        min_transfer_bytes_per_s: float = 20e6,
        security: ChannelSecurity | None = None,
        data_path: str = "auto",
    ) -> None:
        """Builds the channel and starts the heartbeat thread; does not contact the store (see open()).

        block_bytes_hint (bytes per stored value, if known) and min_transfer_bytes_per_s
        stretch the deadline of large puts and gets: rpc_timeout_s + bytes / rate.
        security: TLS files and the token file (default: plaintext, token from $KVTAG_TOKEN if set);
        a file that cannot be read raises kvtag_proto.channels.ChannelConfigError here.

        data_path "auto" moves values through the store's shared-memory arena when the store offers it
        and this process can map it (same host, shared /dev/shm), else inline in gRPC messages;
        "inline" never uses shared memory. `data_path` (the property) says which one is in use.
        """
        self.session = Session(
            endpoint,
            engine_id=engine_id,
            namespace=namespace,
            mode=mode,
            probe_keys=probe_keys,
            labels=labels,
            rpc_timeout_s=rpc_timeout_s,
            reconnect_interval_s=reconnect_interval_s,
            min_transfer_bytes_per_s=min_transfer_bytes_per_s,
            security=security,
            data_path=data_path,
        )
        self.caller = Caller(self.session)
        self.lookups = Lookups(self.caller)
        self.inline = InlinePath(self.caller, block_bytes_hint)
        self.shm = SharedMemoryPath(self.caller)
        if data_path == "auto":
            self.session.on_open.append(self.shm.attach)
        self.session.on_close.append(self.shm.close)

    # ---- session -------------------------------------------------------------------

    def open(self) -> bool:
        """Try to open the session now, within rpc_timeout_s; True when CONNECTED."""
        return self.session.open()

    def close(self) -> None:
        """Stop the background threads, close the session (best effort) and the channel. Idempotent."""
        self.session.close()

    def report_usage(
        self,
        *,
        lookups: int = 0,
        hits: int = 0,
        misses: int = 0,
        stored: int = 0,
        stored_base_keys: Sequence[BaseKey] = (),
        missed_base_keys: Sequence[BaseKey] = (),
    ) -> None:
        """Blocks another data path looked up, hit, missed and stored (the companion mode), for the
        store's census, with the (group, base key) of stored blocks and of a sample of missed ones, for
        its cross-mode misses (bounded: see usage.PendingUsage); sent with the session's heartbeats,
        never on the caller's thread."""
        self.session.add_usage(
            lookups=lookups,
            hits=hits,
            misses=misses,
            stored=stored,
            stored_base_keys=stored_base_keys,
            missed_base_keys=missed_base_keys,
        )

    def flush_usage(self) -> bool:
        """Send the reported usage now; True once the store has it (False while it is unreachable)."""
        return self.session.flush_usage()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def data_path(self) -> str:
        """ "shared_memory" while values move through the store's arena, else "inline"."""
        return "shared_memory" if self.shm.arena() is not None else "inline"

    # ---- lookups -------------------------------------------------------------------

    def lookup(self, blocks: Sequence[tuple[int, bytes, bytes]], lease_ms: int = 0) -> LookupResult:
        """Leading HIT count, a status per (group, key, base_key) block and a read lease on the hits;
        misses when degraded. Sent in the packed form (see lookup_packed)."""
        return self.lookups.lookup(blocks, lease_ms)

    def lookup_packed(self, runs: Sequence[PackedKeys], lease_ms: int = 0) -> LookupResult:
        """lookup() over runs of concatenated keys: no Python object per key on either side.

        Statuses follow the runs' concatenation. A run with an invalid key length is
        answered MISS locally; invalid base keys are dropped (they only feed diagnostics).
        """
        return self.lookups.lookup_packed(runs, lease_ms)

    def release(self, leases: Leases) -> None:
        """Release lookup leases early (best effort; leases also expire on their own)."""
        self.caller.release(leases)

    # ---- puts and gets -------------------------------------------------------------

    def put(self, items: Sequence[PutItemFields], token_ids: Sequence[bytes] = ()) -> list[int] | None:
        """Store (group, key, value, base_key) items; a PutStatus per item, or None when all were dropped.
        `token_ids`: each item's token ids (uint32 little-endian), or none; send them only when the
        store asks (wants_token_ids): they feed its KV events.

        Batches are split into Put messages within the server's Limits (at most
        max_batch_items items, under max_message_bytes), several in flight. Items that
        cannot be sent at all (bad key, value larger than a message) are REJECTED
        locally; items lost to a failure mid-batch are UNSPECIFIED and counted as dropped,
        except those of the messages answered before the failure.
        """
        if not items:
            return []
        if self.shm.arena() is not None:

            def copy(index: int, slot: memoryview) -> None:
                copy_into(slot, items[index][2])

            return self.put_from([(g, k, len(v), b) for g, k, v, b in items], copy, token_ids)
        return self.inline.put(items, token_ids)

    def get(self, blocks: Sequence[tuple[int, bytes]], leases: Leases = ()) -> list[Value | None]:
        """Values of (group, key) blocks; None for each block not served (miss, mismatch, degraded).

        A value is a read-only buffer (a view into the received message, see inline.get_decoding):
        compare, len() and copy it like bytes; take bytes(value) to keep it beyond the caller's use.

        Inline, Get messages of a share of the batch (sized by the largest value seen so far, or the
        server's largest value before any is seen) go several in flight; a lookup's leases are
        released with the single message (when there is one lease), or after all of them.
        """
        if blocks and self.shm.arena() is not None:
            copies: list[Value | None] = [None] * len(blocks)

            def copy(index: int, slot: memoryview) -> bool:
                copies[index] = bytes(slot)
                return True

            served = self.get_into(blocks, leases, copy)
            return [value if ok else None for value, ok in zip(copies, served, strict=True)]
        return self.inline.get(blocks, leases)

    def put_from(
        self,
        items: Sequence[SizedItemFields],
        fill: Callable[[int, memoryview], None],
        token_ids: Sequence[bytes] = (),
    ) -> list[int] | None:
        """Store (group, key, length, base_key) items whose bytes `fill(index, destination)` writes
        (exactly `length` bytes into the memoryview): straight into arena slots on the shared-memory
        path, into a fresh buffer sent inline otherwise. Results as for put(). `fill` may be called
        from two threads at once, for distinct indices (see write_slots)."""
        reservation = self.reserve(items, token_ids)
        if reservation is None:
            if self.shm.arena() is not None or not items:
                return None if items else []
            buffers: list[bytes] = []
            for index, (_, _, length, _) in enumerate(items):
                buffer = bytearray(length)
                fill(index, memoryview(buffer))
                buffers.append(bytes(buffer))
            return self.put([(g, k, buffers[n], b) for n, (g, k, _, b) in enumerate(items)], token_ids)
        self.write_slots(reservation, fill)
        return self.commit(reservation)

    def get_into(
        self, blocks: Sequence[tuple[int, bytes]], leases: Leases, sink: Callable[[int, memoryview], bool]
    ) -> list[bool]:
        """Hand each served block's bytes to `sink(index, source)`, which copies them where they belong
        and returns False to reject them (e.g. the wrong size); True per block whose copy stands.
        On the shared-memory path `source` is the pinned arena slot, valid only during the call, and a
        copy from a slot reused meanwhile is voided (False); inline it is the received value."""
        arena = self.shm.arena()
        if arena is None:
            values = self.get(blocks, leases)
            return [value is not None and sink(n, memoryview(value)) for n, value in enumerate(values)]
        return self.shm.get_into(arena, blocks, leases, sink)

    # ---- shared-memory puts in steps -------------------------------------------------

    def reserve(self, items: Sequence[SizedItemFields], token_ids: Sequence[bytes] = ()) -> SharedPut | None:
        """Slots for a shared-memory put, or None when this session is not on the shared-memory path
        (or the store failed: the items are then counted as dropped)."""
        return self.shm.reserve(items, token_ids)

    def write_slots(self, reservation: SharedPut, fill: Callable[[int, memoryview], None]) -> None:
        """fill(index, slot) for each granted slot of a reservation, each digested right after, from
        cache; large slots in halves on two threads. `fill` must then be safe to call from two threads
        for distinct slots (a memmove or a torch copy: both release the GIL, so the halves do run at
        once)."""
        self.shm.puts.write_slots(reservation, fill)

    def commit(self, reservation: SharedPut) -> list[int] | None:
        """Make the written slots of a reservation visible; a PutStatus per item, or None when the
        store could not be reached (the slots are freed when the session ends). The last message
        also asks for spare slots for a next put like this one."""
        return self.shm.puts.commit(reservation)
