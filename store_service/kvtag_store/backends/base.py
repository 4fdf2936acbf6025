"""The small contract every storage backend fulfils, the capabilities some add, and the census
records replicas share.

The service layer (sessions, policy, leases, counters) sits above this; a
backend only stores tagged values and answers for them. What a backend offers
beyond BlockBackend is declared as capability Protocols and found by one check,
`Capabilities.of`: the API and policy layers ask it, never the backend's class. The same
contract tests (tests/contract/backend_contract.py, subclassed once per
backend) run against every backend, through these Protocols.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, NewType, Protocol, runtime_checkable

# A block's key bytes in its mode. Raw bytes, not a tuple or object: lookups of
# thousands of keys stay cheap.
BlockKey = NewType("BlockKey", bytes)
# (group, key): the address of a block inside one namespace.
BlockAddress = tuple[int, BlockKey]
# A value to store: bytes, or a view into the request that carried it (valid for the call only, so a
# backend copies it before returning). Inline puts hand views, saving a copy of every value.
Payload = bytes | memoryview


class SlotReference(NamedTuple):
    """A slot handed to a shared-memory writer (reserve) or reader (get_references, pinned)."""

    segment: str
    offset: int
    length: int
    generation: int
    # The committed XXH3-64, when the reader verifies its own copy (get_references(verify=False)).
    digest: int | None = None


class KeyStatus(enum.IntEnum):
    """Values equal kvtag.v1.KeyStatus so results map to the wire without a table."""

    HIT = 1
    MISS = 2
    MODE_MISMATCH = 3


class PutOutcome(enum.IntEnum):
    """Values equal kvtag.v1.PutStatus."""

    STORED = 1
    ALREADY_PRESENT = 2
    CONFLICT = 3
    REJECTED = 4


@dataclass(frozen=True, slots=True)
class PutResult:
    outcome: PutOutcome
    reason: str = ""


# The answer to a commit or cancel naming a slot generation this session does not hold.
NO_RESERVATION = PutResult(
    PutOutcome.REJECTED,
    "no such reservation: the slot was not reserved by this session for this block, was already "
    "committed, or its session expired; reserve again (ReserveSlots)",
)


@dataclass(frozen=True, slots=True)
class ReadResult:
    status: KeyStatus
    value: Payload | None = None


@dataclass(frozen=True, slots=True)
class TenantUsage:
    """One tenant's share of a backend that keeps per-tenant quotas (the memory backend)."""

    keys: int
    used_bytes: int
    quota_bytes: int  # 0: the tenant shares the pool the quotas leave
    evictions: int


@dataclass(frozen=True, slots=True)
class TierUsage:
    """One storage tier of a backend that has several (the memory backend with --disk-dir); equals
    kvtag.v1.TierStats field for field."""

    tier: str
    used_bytes: int
    capacity_bytes: int
    keys: int
    hits: int = 0
    spills: int = 0
    reads_back: int = 0
    corrupted_dropped: int = 0
    evictions: int = 0
    failures: int = 0
    degraded: bool = False
    degraded_reason: str = ""


@dataclass(frozen=True, slots=True)
class BackendStats:
    backend: str
    capacity_bytes: int
    used_bytes: int
    keys: int
    evictions: int
    leased_keys: int
    corrupted_dropped: int
    # namespace_id -> (keys, used_bytes)
    per_namespace: dict[str, tuple[int, int]] = field(default_factory=dict)
    # Backend errors met by this replica, by kind (Mooncake: full, transfer, master_rpc, ...).
    errors: dict[str, int] = field(default_factory=dict)
    # tenant -> usage, from backends that know tenants (see MemoryBackend.assign_tenant); else empty.
    per_tenant: dict[str, TenantUsage] = field(default_factory=dict)
    # Bytes shared by the tenants without a quota (capacity minus the quotas).
    shared_pool_bytes: int = 0
    # Shared-memory slots reserved and not yet committed (memory backend).
    reserved_bytes: int = 0
    # Of which spare slots held for sessions' next puts.
    spare_bytes: int = 0
    # Per storage tier, memory first (memory backend); empty for backends without tiers.
    tiers: list[TierUsage] = field(default_factory=list)
    # The up-front prefault: (bytes touched, bytes to touch); (0, 0) when there is none.
    prefault: tuple[int, int] = (0, 0)


class BackendUnavailable(Exception):
    """The backend cannot be reached; the API layer maps it to UNAVAILABLE."""


class BlockBackend(Protocol):
    """Stores values tagged with a mode_id. Never overwrites; never serves a
    value to another mode; never serves a value whose checksum fails."""

    name: str

    @property
    def max_value_bytes(self) -> int: ...

    def put(self, namespace_id: str, mode_id: str, address: BlockAddress, value: bytes) -> PutResult: ...

    def put_many(
        self, namespace_id: str, mode_id: str, items: Sequence[tuple[BlockAddress, Payload]]
    ) -> list[PutResult]:
        """`put` for a batch, results in item order; a repeated address is judged after the first
        (ALREADY_PRESENT). One call per request lets a backend amortise its round trips."""

    def lookup(
        self, namespace_id: str, mode_id: str, addresses: Sequence[BlockAddress]
    ) -> list[KeyStatus]: ...

    def get(self, namespace_id: str, mode_id: str, addresses: Sequence[BlockAddress]) -> list[ReadResult]: ...

    def pin(self, namespace_id: str, addresses: Sequence[BlockAddress]) -> None:
        """Hold the blocks against eviction (a read lease); pins nest."""

    def unpin(self, namespace_id: str, addresses: Sequence[BlockAddress]) -> None: ...

    def stats(self) -> BackendStats: ...

    def close(self) -> None: ...


# -- capabilities: what a backend may offer beyond BlockBackend ---------------


@runtime_checkable
class TenantAware(Protocol):
    """Keeps each tenant's blocks apart (its pool, quota or arena), so it is told a namespace's tenant
    when a session opens, before any put."""

    def assign_tenant(self, namespace_id: str, tenant: str, arena: str | None = None) -> None:
        """`arena`: whose shared-memory arena the namespace's values use (None: the tenant's own);
        the service passes one shared by tenants that are only client-chosen labels."""
        ...


@runtime_checkable
class AtomicLookup(Protocol):
    """Looks up and pins the hits in one step, leaving no window for an eviction between the two."""

    def lookup_and_pin(
        self, namespace_id: str, mode_id: str, addresses: Sequence[BlockAddress]
    ) -> tuple[list[KeyStatus], Sequence[BlockAddress]]:
        """The statuses and exactly what was pinned (the lease unpins it later)."""
        ...


@runtime_checkable
class PackedLookup(Protocol):
    """Answers a lookup on packed key bytes, building no object per key."""

    def lookup_packed_and_pin(
        self, namespace_id: str, mode_id: str, runs: Sequence[tuple[int, bytes, int]]
    ) -> tuple[bytes, Sequence[BlockAddress] | None]:
        """Runs of (group, concatenated keys, key length) -> a status byte per key, and the pinned hits
        (None: nothing pinned), to be unpinned whole."""
        ...


@runtime_checkable
class ViewReads(Protocol):
    """Reads values as views of their stored bytes rather than copies."""

    def get_views(
        self, namespace_id: str, mode_id: str, addresses: Sequence[BlockAddress]
    ) -> tuple[list[ReadResult], list[BlockAddress]]:
        """get() without the copy: each verified hit is a view, pinned (the returned addresses) until the
        caller unpins it."""
        ...


class SharedArena(Protocol):
    """The part of a shared-memory arena a same-host client is told about to map it."""

    segment: str
    path: str | None
    size: int
    nonce: bytes


@runtime_checkable
class SharedMemoryBackend(Protocol):
    """A backend whose values pass through arena slots same-host clients map (the shared-memory
    path): the memory backend keeps them there, the Mooncake backend stages them there."""

    def shared_arena(self, namespace_id: str) -> SharedArena | None: ...

    def reserve(
        self, namespace_id: str, mode_id: str, items: Sequence[tuple[BlockAddress, int]]
    ) -> list[SlotReference | PutResult]: ...

    def reserve_spare(self, namespace_id: str, lengths: Sequence[int]) -> list[SlotReference | PutResult]:
        """Slots for no key yet, for the session's next put (CommitSlotsRequest.spare_lengths)."""
        ...

    def commit(
        self,
        namespace_id: str,
        mode_id: str,
        generations: Sequence[int],
        digests: Sequence[int] | None = None,
        addresses: Sequence[BlockAddress] | None = None,
    ) -> tuple[list[PutResult], int]: ...

    def cancel(self, generations: Iterable[int]) -> None: ...

    def get_references(
        self, namespace_id: str, mode_id: str, addresses: Sequence[BlockAddress], verify: bool = True
    ) -> tuple[list[KeyStatus], list[SlotReference | None], list[BlockAddress]]: ...


@runtime_checkable
class Forgetting(Protocol):
    """Holds memory per namespace and per tenant (the memory backend's arenas) that it gives back once
    nothing uses it."""

    def admit_tenant(self, tenant: str, arena: str | None = None) -> None:
        """Make the tenant's memory (in `arena`'s arena, as assign_tenant) ready before a session of it
        opens. Never refuses: which tenants get memory of their own is bounded by what the operator
        names (quotas, tokens file), not by a cap clients could fill."""
        ...

    def forget_namespaces(self, namespace_ids: Sequence[str], idle_since: float) -> int:
        """Drop the state of namespaces the census forgot, when they hold nothing and were not used
        since `idle_since` (time.monotonic()), then every tenant's memory nothing uses any more.
        Returns the bytes of memory given back."""
        ...

    def arenas(self) -> int:
        """Tenant arenas held now."""
        ...

    def prefault_progress(self) -> tuple[int, int]:
        """(bytes touched, bytes to touch) of the up-front prefault (--prefault=full)."""
        ...


@runtime_checkable
class NamespaceCounting(Protocol):
    """Counts its stored blocks per namespace, in every tier, so the census forgets a namespace
    exactly when it holds none. A backend without it (Mooncake: the cluster's figures are not per
    namespace) leaves the census to keep every namespace whose modes stored blocks."""

    def blocks_per_namespace(self) -> dict[str, int]:
        """namespace_id -> stored blocks, for every namespace holding at least one."""
        ...


@runtime_checkable
class ModeHoldings(Protocol):
    """Says which modes hold blocks in a namespace, whoever stored them and however long ago, so
    OpenSession tells an engine of blocks it can never read even on a replica (or after a restart)
    that never saw the engine that stored them."""

    def modes_holding(self, namespace_id: str) -> frozenset[str]:
        """The mode ids whose blocks the namespace holds, or may hold where the backend cannot count
        them (Mooncake: the modes its mode directory names, blocks evicted or not)."""
        ...


# The tiers a block enters and leaves (BlockEvents' `tier`): TierUsage's names, and Mooncake's.
TIER_MEMORY = "memory"
TIER_DISK = "disk"
TIER_MOONCAKE = "mooncake"


class BlockEvents(Protocol):
    """Told each time a block enters or leaves a tier (kvtag_store.events publishes it). Called under
    the backend's lock on its hot paths, so an implementation only queues: O(1), never blocks."""

    def stored(self, namespace_id: str, mode_id: str, address: BlockAddress, tier: str) -> None: ...

    def removed(self, namespace_id: str, mode_id: str, address: BlockAddress, tier: str) -> None: ...


class EventRelay:
    """The BlockEvents a backend hands its parts when it builds them: it tells the observer that
    `observe_blocks` (Observable) names, and nothing before there is one."""

    __slots__ = ("observer",)

    def __init__(self) -> None:
        self.observer: BlockEvents | None = None

    def stored(self, namespace_id: str, mode_id: str, address: BlockAddress, tier: str) -> None:
        if self.observer is not None:
            self.observer.stored(namespace_id, mode_id, address, tier)

    def removed(self, namespace_id: str, mode_id: str, address: BlockAddress, tier: str) -> None:
        if self.observer is not None:
            self.observer.removed(namespace_id, mode_id, address, tier)

    def removed_each(self, namespace_id: str, held: Iterable[tuple[str, BlockAddress]], tier: str) -> None:
        """`removed` for each (mode_id, address) of `held`, which is not read without an observer."""
        if self.observer is not None:
            for mode_id, address in held:
                self.observer.removed(namespace_id, mode_id, address, tier)

    def stored_results(
        self,
        namespace_id: str,
        mode_id: str,
        addresses: Iterable[BlockAddress],
        results: Iterable[PutResult],
        tier: str,
    ) -> None:
        """`stored` for the addresses whose put was STORED, for backends that learn it from results
        (Mooncake)."""
        if self.observer is not None:
            for address, result in zip(addresses, results, strict=True):
                if result.outcome is PutOutcome.STORED:
                    self.observer.stored(namespace_id, mode_id, address, tier)


@runtime_checkable
class Observable(Protocol):
    """Reports blocks entering and leaving it to a BlockEvents (KV events)."""

    def observe_blocks(self, events: BlockEvents) -> None:
        """From now on tell `events`; first, the blocks held already (a disk tier's after a restart)."""
        ...


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What one backend offers beyond BlockBackend, each the backend itself or None. `of` is the one
    place a capability is checked (runtime-checkable Protocols: the methods are present)."""

    tenants: TenantAware | None
    atomic_lookup: AtomicLookup | None
    packed_lookup: PackedLookup | None
    views: ViewReads | None
    shared_memory: SharedMemoryBackend | None
    forgetting: Forgetting | None
    counting: NamespaceCounting | None
    holdings: ModeHoldings | None
    observable: Observable | None

    @classmethod
    def of(cls, backend: object) -> Capabilities:
        return cls(
            tenants=backend if isinstance(backend, TenantAware) else None,
            atomic_lookup=backend if isinstance(backend, AtomicLookup) else None,
            packed_lookup=backend if isinstance(backend, PackedLookup) else None,
            views=backend if isinstance(backend, ViewReads) else None,
            shared_memory=backend if isinstance(backend, SharedMemoryBackend) else None,
            forgetting=backend if isinstance(backend, Forgetting) else None,
            counting=backend if isinstance(backend, NamespaceCounting) else None,
            holdings=backend if isinstance(backend, ModeHoldings) else None,
            observable=backend if isinstance(backend, Observable) else None,
        )


@dataclass(frozen=True, slots=True)
class ProbeRecord:
    engine_id: str
    probe_keys: tuple[bytes, ...]


class CensusStore(Protocol):
    """First-writer-wins records that every replica of the service must agree on.

    The memory backend keeps them in process; the Mooncake backend keeps them
    in Mooncake (its put is first-writer-wins), so replicas over one cluster
    enforce the same policy.
    """

    def establish_mode(self, namespace_id: str, mode_encoding: bytes) -> bytes:
        """Record mode_encoding as the namespace's first mode if none is; return the established one."""

    def reference_probe(self, namespace_id: str, mode_id: str, record: ProbeRecord) -> ProbeRecord:
        """Record the probe keys for (namespace, mode) if none are; return the reference record."""

    # What namespaces and modes are, so a replica that never saw an engine can still name what it
    # left: the fields another mode differs in, the layout of a sibling namespace of the same model.
    # Best effort: a lost record loses a warning's detail, never a decision.

    def describe(
        self, namespace_id: str, model_key: str, namespace: bytes, mode_id: str, mode: bytes
    ) -> None:
        """Record the namespace's descriptor (serialized NamespaceDescriptor) under its model (the
        namespaces of one model and tenant share a model_key), and the mode's canonical encoding."""

    def described_modes(self, namespace_id: str, mode_ids: Iterable[str]) -> dict[str, bytes]:
        """mode_id -> canonical encoding, of those of mode_ids described in the namespace."""

    def namespaces_of(self, model_key: str) -> dict[str, bytes]:
        """namespace_id -> serialized NamespaceDescriptor, of the namespaces described under the model."""
