"""BlockBackend over a Mooncake Store cluster: tagged, checksummed values that outlive the service.

Every value carries the header of `mooncake.format`, so any replica (or a restarted one) can
verify a value without this process's memory. `MooncakeBackend` is a facade over the paths that
do the work: `reads` (lookups and Gets), `writes` (puts, each judged by the header it left),
`shared_memory` (staging slots for same-host clients) and `leases` (Mooncake leases on pinned
blocks), all sharing one `cluster.Cluster` (client, header reader, mode directory, health).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from kvtag_store.backends.base import (
    TIER_MOONCAKE,
    BackendStats,
    BlockAddress,
    BlockEvents,
    EventRelay,
    KeyStatus,
    Payload,
    PutResult,
    ReadResult,
    SlotReference,
)
from kvtag_store.backends.mooncake.client import (
    MooncakeClient,
    MooncakeSettings,
    connect,
    read_master_metrics,
)
from kvtag_store.backends.mooncake.cluster import Cluster
from kvtag_store.backends.mooncake.errors import ErrorCounters
from kvtag_store.backends.mooncake.format import object_keys
from kvtag_store.backends.mooncake.health import MasterBreaker
from kvtag_store.backends.mooncake.leases import LeaseKeeper
from kvtag_store.backends.mooncake.reads import ClusterReader
from kvtag_store.backends.mooncake.shared_memory import SharedMemoryHalf
from kvtag_store.backends.mooncake.staging import StagedAddress, Staging
from kvtag_store.backends.mooncake.writes import ClusterWriter
from kvtag_store.backends.shm.arena import Arena

# Re-exported: callers name the client, its settings and connect beside the backend.
__all__ = ["MooncakeBackend", "MooncakeClient", "MooncakeSettings", "connect", "read_master_metrics"]


class MooncakeBackend:
    """A BlockBackend whose blocks live in a Mooncake Store cluster shared by kvtag replicas."""

    name = "mooncake"

    def __init__(self, client: MooncakeClient, settings: MooncakeSettings) -> None:
        self._cluster = Cluster(client, settings)
        self.errors: ErrorCounters = self._cluster.errors
        self._leases = LeaseKeeper(client, settings.lease_ttl_ms)
        self._reads = ClusterReader(self._cluster)
        self._writes = ClusterWriter(self._cluster)
        staging = (
            Staging(client, settings.shm_dir, settings.shm_staging_bytes, settings.shm_groups)
            if settings.shm_dir
            else None
        )
        # KV events (observe_blocks): what this replica stores. Mooncake's own evictions are not seen.
        self._events = EventRelay()
        self._shared = SharedMemoryHalf(self._cluster, self._reads, self._writes, staging, self._events)
        self._closers: list[Callable[[], None]] = []

    @property
    def max_value_bytes(self) -> int:
        return self._cluster.max_value_bytes

    @property
    def breaker(self) -> MasterBreaker:
        """The master breaker of every call through this backend's client (the census shares it)."""
        return self._cluster.breaker

    @property
    def staging_slots_in_use(self) -> int | None:
        """Staging slots handed out and not freed yet (reserved, or held by a Get's lease); None
        without shared-memory staging."""
        return self._shared.slots_in_use

    # -- writes -------------------------------------------------------------

    def observe_blocks(self, events: BlockEvents) -> None:
        """KV events (Observable): blocks this replica stores from now on. Nothing is told of blocks
        stored before, by other replicas, or evicted by Mooncake (its master tells no one)."""
        self._events.observer = events

    def put(self, namespace_id: str, mode_id: str, address: BlockAddress, value: Payload) -> PutResult:
        result = self._writes.put(namespace_id, mode_id, address, value)
        self._events.stored_results(namespace_id, mode_id, [address], [result], TIER_MOONCAKE)
        return result

    def put_many(
        self, namespace_id: str, mode_id: str, items: Sequence[tuple[BlockAddress, Payload]]
    ) -> list[PutResult]:
        """`put` for a batch: one Mooncake put_batch and one header read-back per chunk instead of a
        round trip pair per item. Per-item truth still comes from each item's stored header."""
        results = self._writes.put_many(namespace_id, mode_id, items)
        self._events.stored_results(namespace_id, mode_id, (a for a, _ in items), results, TIER_MOONCAKE)
        return results

    # -- reads --------------------------------------------------------------

    def lookup(self, namespace_id: str, mode_id: str, addresses: Sequence[BlockAddress]) -> list[KeyStatus]:
        """Existence checks alone: the mode is in the object key (see mooncake.modes)."""
        return self._reads.lookup(namespace_id, mode_id, addresses)

    def get(self, namespace_id: str, mode_id: str, addresses: Sequence[BlockAddress]) -> list[ReadResult]:
        return self._reads.get(namespace_id, mode_id, addresses)

    # -- shared memory (same-host clients; see mooncake.shared_memory) -------

    def assign_tenant(self, namespace_id: str, tenant: str, arena: str | None = None) -> None:
        """The namespace's tenant, and whose staging arena its shared-memory values pass through
        (`arena`, None: the tenant's own; an --shm-group tenant always has its own)."""
        self._shared.assign_tenant(namespace_id, tenant, arena)

    def shared_arena(self, namespace_id: str) -> Arena | None:
        """The staging arena a same-host client of the namespace maps, or None (inline path only)."""
        return self._shared.shared_arena(namespace_id)

    def reserve(
        self, namespace_id: str, mode_id: str, items: Sequence[tuple[BlockAddress, int]]
    ) -> list[SlotReference | PutResult]:
        """Shared-memory Put, step 1: a staging slot per item, or the outcome already known."""
        return self._shared.reserve(namespace_id, mode_id, items)

    def reserve_spare(self, namespace_id: str, lengths: Sequence[int]) -> list[SlotReference | PutResult]:
        """Staging slots for the session's next put (bound to keys at its commit: one round trip)."""
        return self._shared.reserve_spare(namespace_id, lengths)

    def commit(
        self,
        namespace_id: str,
        mode_id: str,
        generations: Sequence[int],
        digests: Sequence[int] | None = None,
        addresses: Sequence[BlockAddress] | None = None,
    ) -> tuple[list[PutResult], int]:
        """Shared-memory Put, step 2: each written slot gets its header in place (with the client's
        XXH3-64 `digests` when sent, else one computed here) and is put into the cluster straight
        from the arena, then judged by its stored header like any put. `addresses` bind spare slots."""
        return self._shared.commit(namespace_id, mode_id, generations, digests, addresses)

    def cancel(self, generations: Iterable[int]) -> None:
        """Free reserved slots that were never committed (their session ended)."""
        self._shared.cancel(generations)

    def get_references(
        self, namespace_id: str, mode_id: str, addresses: Sequence[BlockAddress], verify: bool = True
    ) -> tuple[list[KeyStatus], list[SlotReference | None], list[BlockAddress]]:
        """Shared-memory Get: values read into staging slots and referenced. Tag, address and length
        are checked here always; the payload digest here when `verify`, else by the reader against
        the digest its reference carries."""
        return self._shared.get_references(namespace_id, mode_id, addresses, verify)

    # -- leases -------------------------------------------------------------

    def pin(self, namespace_id: str, addresses: Sequence[BlockAddress]) -> None:
        # The lookup that found these blocks already took Mooncake leases; the keeper renews them.
        self._leases.pin(self._leased_keys(namespace_id, addresses))

    def unpin(self, namespace_id: str, addresses: Sequence[BlockAddress]) -> None:
        if addresses and isinstance(addresses[0], StagedAddress):
            # A shared-memory Get's lease: its slots (the blocks were never pinned in Mooncake).
            self._shared.release(addresses)
            return
        self._leases.unpin(self._leased_keys(namespace_id, addresses))

    def _leased_keys(self, namespace_id: str, addresses: Sequence[BlockAddress]) -> list[str]:
        """The blocks' keys in every mode known for the namespace (pin names no mode; modes are only
        added, so an unpin names at least what its pin did)."""
        modes = self._cluster.modes.known(namespace_id)
        return [k for mode in modes for k in object_keys(namespace_id, mode, addresses)]

    def modes_holding(self, namespace_id: str) -> frozenset[str]:
        """The modes the namespace's mode directory names (ModeHoldings): every mode registers there
        before its first put, through any replica. The cluster cannot count blocks per namespace, so
        a mode whose blocks were all evicted is still named: "may hold"."""
        return frozenset(self._cluster.modes.current(namespace_id))

    # -- reporting ----------------------------------------------------------

    def stats(self) -> BackendStats:
        """Cluster-wide figures from the master's metrics (they include other tenants' objects
        and kvtag's census records); leases and dropped values are this replica's."""
        metrics = read_master_metrics(self._cluster.settings.metrics)
        return BackendStats(
            backend=self.name,
            capacity_bytes=int(metrics.get("master_total_capacity_bytes", 0)),
            used_bytes=int(metrics.get("master_allocated_bytes", 0)),
            # The directory slots this replica knows are objects too, not blocks.
            keys=int(metrics.get("master_key_count", 0)) - self._cluster.modes.entries,
            evictions=int(metrics.get("master_evicted_key_count", 0)),
            leased_keys=self._leases.count(),
            corrupted_dropped=self._cluster.corrupted,
            errors=self.errors.snapshot(),
            reserved_bytes=self._shared.reserved_bytes(),
            spare_bytes=self._shared.spare_bytes(),
        )

    def close_first(self, close: Callable[[], None]) -> None:
        """Run close before this backend closes the client (for the census keeper sharing it)."""
        self._closers.append(close)

    def close(self) -> None:
        for close in self._closers:
            close()
        self._leases.close()
        self._cluster.breaker.close()
        self._cluster.headers.close()
        self._shared.close()
        self._cluster.client.close()
