"""GetStats as one caller may see it: per-tenant figures, and only the caller's tenants when its token
does not cover them all."""

from __future__ import annotations

import dataclasses
from collections import defaultdict

from kvtag.v1 import store_pb2 as pb

from kvtag_store.backends.base import BackendStats, TenantUsage
from kvtag_store.security.tokens import Principal


def tenant_usage(stats: BackendStats, tenants: dict[str, str]) -> dict[str, TenantUsage]:
    """The backend's own per-tenant figures, or (backends without them) sums over the namespaces
    whose tenant this replica knows from their sessions."""
    if stats.per_tenant:
        return dict(stats.per_tenant)
    keys: defaultdict[str, int] = defaultdict(int)
    used: defaultdict[str, int] = defaultdict(int)
    for ns_id, (ns_keys, ns_used) in stats.per_namespace.items():
        tenant = tenants.get(ns_id)
        if tenant is not None:
            keys[tenant] += ns_keys
            used[tenant] += ns_used
    return {t: TenantUsage(keys=keys[t], used_bytes=used[t], quota_bytes=0, evictions=0) for t in keys}


def stats_response(stats: BackendStats, tenants: dict[str, str], caller: Principal) -> pb.GetStatsResponse:
    """Everything for an admin of every tenant; otherwise the caller's tenants only, and store-wide
    figures replaced by sums over them, so nothing about another tenant's blocks shows."""
    usage = tenant_usage(stats, tenants)
    everything = caller.sees_everything
    tenant_rows = [
        pb.TenantStats(
            tenant=tenant,
            keys=u.keys,
            used_bytes=u.used_bytes,
            quota_bytes=u.quota_bytes,
            evictions=u.evictions,
        )
        for tenant, u in sorted(usage.items())
        if everything or caller.may_use(tenant)
    ]
    namespace_rows = [
        pb.NamespaceStats(namespace_id=ns_id, keys=keys, used_bytes=used, tenant=tenants.get(ns_id, ""))
        for ns_id, (keys, used) in sorted(stats.per_namespace.items())
        if everything or (ns_id in tenants and caller.may_use(tenants[ns_id]))
    ]
    if everything:
        return pb.GetStatsResponse(
            backend=stats.backend,
            capacity_bytes=stats.capacity_bytes,
            used_bytes=stats.used_bytes,
            keys=stats.keys,
            evictions=stats.evictions,
            leased_keys=stats.leased_keys,
            corrupted_dropped=stats.corrupted_dropped,
            reserved_bytes=stats.reserved_bytes,
            spare_bytes=stats.spare_bytes,
            namespaces=namespace_rows,
            tenants=tenant_rows,
            tiers=[pb.TierStats(**dataclasses.asdict(tier)) for tier in stats.tiers],
            prefault_done_bytes=stats.prefault[0],
            prefault_total_bytes=stats.prefault[1],
        )
    quotas = sum(row.quota_bytes for row in tenant_rows)
    shares_pool = not tenant_rows or any(row.quota_bytes == 0 for row in tenant_rows)
    pool = (stats.shared_pool_bytes or stats.capacity_bytes) if shares_pool else 0
    return pb.GetStatsResponse(
        backend=stats.backend,
        capacity_bytes=quotas + pool,
        used_bytes=sum(row.used_bytes for row in namespace_rows),
        keys=sum(row.keys for row in namespace_rows),
        evictions=sum(row.evictions for row in tenant_rows),
        namespaces=namespace_rows,
        tenants=tenant_rows,
    )
