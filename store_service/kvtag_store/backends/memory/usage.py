"""The memory backend's usage report: what GetStats, /metrics and the status page show of it.

A function of the backend's parts, apart from the facade, so the facade stays about the contract;
the caller holds the backend's lock. Per namespace, keys count blocks in either tier (with the disk
tier on); used bytes are memory's.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

from kvtag_store.backends.base import BackendStats, TenantUsage, TierUsage
from kvtag_store.backends.memory.disk.records import MAX_MODE_NUMBER
from kvtag_store.backends.memory.entries import Namespace
from kvtag_store.backends.memory.pools import Pool


def usage_report(
    *,
    name: str,
    capacity: int,
    namespaces: Mapping[str, Namespace],
    pools: Sequence[Pool],
    tenant_pools: Mapping[str, Pool],
    shared: Pool,
    evictions: Mapping[str | None, int],
    corrupted: int,
    prefault: tuple[int, int] = (0, 0),
) -> BackendStats:
    keys: Counter[str] = Counter()
    used: Counter[str] = Counter()
    for ns in namespaces.values():
        if ns.tenant is not None:
            keys[ns.tenant] += len(ns.entries)
            used[ns.tenant] += ns.used_bytes
    tenants = set(keys) | set(tenant_pools) | {t for t in evictions if t is not None}
    used_bytes = sum(pool.used for pool in pools)
    key_count = sum(len(pool.lru) for pool in pools)
    memory = TierUsage(
        tier="memory",
        used_bytes=used_bytes,
        capacity_bytes=capacity,
        keys=key_count,
        corrupted_dropped=corrupted,
        evictions=sum(evictions.values()),
    )
    return BackendStats(
        backend=name,
        capacity_bytes=capacity,
        used_bytes=used_bytes,
        keys=key_count,
        evictions=sum(evictions.values()),
        leased_keys=sum(
            1
            for ns in namespaces.values()
            for address in ns.pinned_addresses()
            if address in ns.entries or ns.disk.holds(address)
        ),
        corrupted_dropped=corrupted,
        per_namespace={
            ns_id: (blocks_held(ns), ns.used_bytes)
            for ns_id, ns in namespaces.items()
            if ns.entries or ns.disk
        },
        per_tenant={
            tenant: TenantUsage(
                keys=keys[tenant],
                used_bytes=used[tenant],
                quota_bytes=pool.capacity if (pool := tenant_pools.get(tenant)) else 0,
                evictions=evictions.get(tenant, 0),
            )
            for tenant in tenants
        },
        shared_pool_bytes=shared.capacity,
        reserved_bytes=sum(pool.reserved for pool in pools),
        spare_bytes=sum(pool.spare for pool in pools),
        tiers=[memory],
        prefault=prefault,
    )


def blocks_held(ns: Namespace) -> int:
    """Distinct blocks of the namespace in either tier: the census must not take a namespace whose
    blocks are on disk only for empty. An entry read back from disk (or written there) is in both."""
    if not ns.disk:
        return len(ns.entries)
    in_both = sum(1 for entry in ns.entries.values() if entry.disk is not None)
    return len(ns.entries) + len(ns.disk) - in_both


def modes_in_memory_and_disk(ns: Namespace) -> tuple[set[str], list[int]]:
    """The modes of the namespace's entries in memory, and a copy of its disk index's packed
    locations (their low bits are mode numbers) for `disk_modes` to read outside the lock. Caller
    holds the lock."""
    return {mode for mode, count in ns.mode_blocks.items() if count > 0}, list(ns.disk.values())


def disk_modes(locations: list[int], mode_numbers: Mapping[str, int]) -> set[str]:
    """The mode ids of disk records, by their mode numbers (a pass over every record: called at
    OpenSession, outside the lock)."""
    numbers = {packed & MAX_MODE_NUMBER for packed in locations}
    return {mode for mode, number in mode_numbers.items() if number in numbers}
