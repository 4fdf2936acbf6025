"""Which pool and which arena each namespace's values live in, and the arenas per tenant.

Which arena a tenant's values go to is the caller's to say (assign's `arena`: the service passes its
pool's shared one for tenants that are only labels a client picked, their own for tenants a tokens
file names), except that --tenant-quota and --shm-group tenants always get their own: the operator
named them. So the arenas are bounded by what the operator listed, never by what clients invent, and
no tenant is ever refused for want of one. An arena is freed (unmapped, its file removed) once no
namespace uses it and it holds no slot, unless it is a pool's up-front prefaulted one or a
--tenant-quota tenant's. Every method runs under the backend's lock.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence

from kvtag_store.backends.base import TIER_DISK, TIER_MEMORY, BlockEvents, EventRelay
from kvtag_store.backends.memory.disk.tier import DiskTier
from kvtag_store.backends.memory.entries import NO_DISK, Namespace
from kvtag_store.backends.memory.pools import Pool
from kvtag_store.backends.shm import Arena, arena_size, remove_orphans, shared_memory_room

log = logging.getLogger("kvtag_store.backends.memory.backend")

# The arena of namespaces no session has named a tenant for (a direct backend caller's), and of the
# shared pool's tenants when the caller says so.
SHARED_ARENA = ""


class Tenancy:
    """The namespaces by id with their pools and arenas (the backend's tables, shared, not copied)."""

    def __init__(
        self,
        namespaces: dict[str, Namespace],
        capacity: int,
        shared: Pool,
        tenant_pools: Mapping[str, Pool],
        shm_dir: str | None,
        shm_groups: Mapping[str, int],
        key_index_lag: int,
        events: EventRelay,
    ) -> None:
        """`events`: the backend's, given to every namespace (KV events)."""
        self.namespaces = namespaces
        self._capacity = capacity
        self.shared = shared
        self.tenant_pools = tenant_pools
        self._shm_dir = shm_dir
        self._shm_groups = shm_groups
        self._key_index_lag = key_index_lag
        self._events = events
        self.arenas: dict[str, Arena] = {}  # tenant -> arena
        self.mode_numbers: dict[str, int] = {}  # mode_id -> its number in the key indexes
        self.disk: DiskTier | None = None  # set once, before any namespace exists
        if shm_dir is not None:
            remove_orphans(shm_dir)

    def pool_of(self, tenant: str | None) -> Pool:
        return self.shared if tenant is None else self.tenant_pools.get(tenant, self.shared)

    def arena_key(self, tenant: str, arena: str | None) -> str:
        """Whose arena the tenant's values go to: its own when the operator named it (a quota or an
        --shm-group) or the caller asked for none other, else `arena`."""
        if arena is None or tenant in self.tenant_pools or tenant in self._shm_groups:
            return tenant
        return arena

    def ns(self, namespace_id: str) -> Namespace:
        """The namespace; created in the shared pool and arena if no session named its tenant."""
        ns = self.namespaces.get(namespace_id)
        if ns is None:
            ns = self.namespaces[namespace_id] = self._new(namespace_id, self.shared, None, SHARED_ARENA)
        return ns

    def assign(self, namespace_id: str, tenant: str, arena: str | None) -> None:
        """Record the namespace's tenant: its pool, and its arena while it holds nothing (blocks stored
        before move to the pool; they stay in the arena they were written to)."""
        pool = self.pool_of(tenant)
        key = self.arena_key(tenant, arena)
        ns = self.namespaces.get(namespace_id)
        if ns is None:
            self.namespaces[namespace_id] = self._new(namespace_id, pool, tenant, key)
            return
        ns.tenant = tenant
        ns.touched = time.monotonic()
        if not ns.entries:
            ns.arena = self.arena(key)
        if ns.pool is pool:
            return
        old = ns.pool
        for address, entry in ns.entries.items():
            del old.lru[(namespace_id, address)]
            pool.lru[(namespace_id, address)] = None
            old.used -= entry.slot.length
            pool.used += entry.slot.length
        ns.pool = pool

    def restore(self, namespace_id: str, tenant: str | None) -> None:
        """A namespace the disk tier found records of at start-up, in its tenant's pool, and in its
        pool's arena until a session names its tenant (the records hold no memory yet, so a restart
        makes no arena per tenant it finds)."""
        key = self.arena_key(tenant, SHARED_ARENA) if tenant is not None else SHARED_ARENA
        self.namespaces[namespace_id] = self._new(namespace_id, self.pool_of(tenant), tenant, key)

    def _new(self, namespace_id: str, pool: Pool, tenant: str | None, arena_key: str) -> Namespace:
        disk = self.disk
        return Namespace(
            namespace_id,
            pool,
            tenant,
            self.arena(arena_key),
            self.mode_numbers,
            self._key_index_lag,
            disk=disk.index(namespace_id) if disk is not None else NO_DISK,
            spill=disk.queue if disk is not None and not disk.degraded else None,
            events=self._events,
        )

    def announce(self, events: BlockEvents) -> None:
        """Tell `events` of every block held, in memory and on disk (a KV-events observer's start)."""
        for ns in self.namespaces.values():
            for address, entry in ns.entries.items():
                events.stored(ns.namespace_id, entry.mode_id, address, TIER_MEMORY)
            for mode_id, address in ns.disk.records():
                events.stored(ns.namespace_id, mode_id, address, TIER_DISK)

    def queue_unwritten(self) -> None:
        """Queue every value only in memory for the disk tier's writer (at close), unless it is off."""
        disk = self.disk
        if disk is not None and not disk.degraded:
            for ns in self.namespaces.values():
                for address, entry in ns.entries.items():
                    if entry.disk is None:
                        disk.queue.append(
                            (ns.namespace_id, address, entry.slot.generation, entry.slot.length)
                        )

    def forget(self, namespace_ids: Sequence[str], idle_since: float, reserved: set[str]) -> list[Arena]:
        """Drop the namespaces that hold nothing and no session named since `idle_since`, then take out
        every arena no namespace uses: not a quota tenant's or a pool's up-front prefaulted one, no
        slot in use, not admitted since `idle_since`. Returns those arenas (the caller closes them)."""
        for namespace_id in namespace_ids:
            ns = self.namespaces.get(namespace_id)
            if ns is not None and ns.idle(idle_since) and namespace_id not in reserved:
                del self.namespaces[namespace_id]
                if self.disk is not None:
                    self.disk.forget(namespace_id)
        used = {id(ns.arena) for ns in self.namespaces.values()}
        idle = [
            tenant
            for tenant, arena in self.arenas.items()
            if id(arena) not in used
            and not arena.slots_in_use
            and not arena.eager
            and tenant not in self.tenant_pools
            and arena.last_used <= idle_since
        ]
        return [self.arenas.pop(tenant) for tenant in idle]

    def arena(self, tenant: str) -> Arena:
        """The tenant's arena, created on first use."""
        arena = self.arenas.get(tenant)
        if arena is not None:
            return arena
        size = arena_size(self._capacity)
        pool = self.pool_of(tenant)
        eager, pool.eager_left = pool.eager_left, 0
        if self._shm_dir is not None:
            try:
                free = shared_memory_room(self._shm_dir)
                if free < self._capacity + (16 << 20):
                    raise OSError(
                        f"it has {free} bytes free and the store's capacity is {self._capacity} bytes "
                        "(give the container a larger /dev/shm, e.g. --shm-size, or lower --capacity)"
                    )
                arena = Arena(tenant, size, self._shm_dir, group=self._shm_groups.get(tenant), eager=eager)
            except OSError as exc:
                log.warning(
                    "cannot create a shared-memory arena in %s (%s); values stay in process memory and "
                    "clients use the inline path",
                    self._shm_dir,
                    exc,
                )
        if arena is None:
            arena = Arena(tenant, size, None, eager=eager)
        self.arenas[tenant] = arena
        return arena
