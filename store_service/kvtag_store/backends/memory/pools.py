"""Pools: the bytes some namespaces share (one quota tenant's, or all the others') and their LRU order.

Tenant quotas (--tenant-quota) split the capacity into pools: each tenant with a quota gets a pool of
that size, and the tenants without one share the rest. Eviction (allocation.py) walks one pool's order
only, so a tenant over its quota evicts its own blocks and never another pool's.
"""

from __future__ import annotations

from collections import OrderedDict

from kvtag_store.backends.base import BlockAddress

# (namespace_id, (group, key)): a block's address across the whole store.
StoreKey = tuple[str, BlockAddress]


class Pool:
    """Bytes shared by some namespaces (one quota tenant's, or all the others') and their LRU order."""

    __slots__ = (
        "around",
        "capacity",
        "eager_left",
        "lru",
        "reserved",
        "spare",
        "tenant",
        "used",
    )

    def __init__(self, capacity: int, tenant: str | None) -> None:
        self.capacity = capacity
        # Bytes of this pool's arenas still to be prefaulted up front: the first arena of a pool takes
        # its capacity, so prefaulting never commits more memory than the capacities add up to.
        self.eager_left = capacity
        self.tenant = tenant  # None: the shared pool
        self.used = 0
        self.reserved = 0  # bytes of slots reserved and not yet inserted
        self.spare = 0  # of which spare slots, reserved for no key yet
        # Bytes of slots shared-memory Gets read disk records into around a full memory, held by their
        # leases, outside `used` and `reserved`; at most `capacity` (the arena has room for twice it).
        self.around = 0
        # Every block of the pool, least recently used first (pinned ones too: eviction skips them).
        self.lru: OrderedDict[StoreKey, None] = OrderedDict()

    def too_large(self, size: int) -> str:
        if self.tenant is None:
            return (
                f"value of {size} bytes exceeds the store capacity of {self.capacity} bytes; "
                "raise --capacity or store smaller blocks"
            )
        return (
            f"value of {size} bytes exceeds tenant {self.tenant!r}'s quota of {self.capacity} bytes; "
            "raise its --tenant-quota or store smaller blocks"
        )

    def full_of_leases(self, leased: int) -> str:
        where, knob = ("store", "--capacity") if self.tenant is None else ("tenant quota", "--tenant-quota")
        return (
            f"{where} full of leased blocks: {leased} of {self.capacity} bytes are leased or being written; "
            f"release leases (Get with lease_id, ReleaseLeases) or raise {knob}"
        )
