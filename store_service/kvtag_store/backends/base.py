"""The small contract every storage backend fulfils, and the census records replicas share.

The service layer (sessions, policy, leases, counters) sits above this; a
backend only stores tagged values and answers for them. The same contract
tests (tests/contract/backend_contract.py, subclassed once per backend)
run against every backend.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, NewType, Protocol, runtime_checkable

if TYPE_CHECKING:
    from kvtag_store.backends.arena import Arena

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


@runtime_checkable
class SharedMemoryBackend(Protocol):
    """A backend whose values pass through arena slots same-host clients map (the shared-memory
    path): the memory backend keeps them there, the Mooncake backend stages them there."""

    def shared_arena(self, namespace_id: str) -> Arena | None: ...

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
