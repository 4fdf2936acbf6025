"""The block keys of Mooncake value format 1 (docs/mooncake.md), which the store never reads: tests
write blocks there to show they are ignored."""

from __future__ import annotations

from kvtag_store.backends.mooncake.format import CENSUS_PREFIX


def legacy_object_key(namespace_id: str, group: int, key: bytes) -> str:
    """Where format 1 kept a block: kvtag/v1/<namespace>/g<group>/<hex(key)>."""
    return f"{CENSUS_PREFIX}/{namespace_id}/g{group}/{key.hex()}"
