"""Prometheus metrics: request counters updated per batch, store and census figures read at scrape time."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

from kvtag.v1 import store_pb2 as pb
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvtag_store.backends.base import BackendStats, BackendUnavailable

log = logging.getLogger("kvtag_store.observe.metrics")


class StoreMetrics:
    """One registry per server, so several in-process servers (tests) never collide."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.rpc_seconds = Histogram(
            "kvtag_rpc_duration_seconds",
            "Server-side RPC latency",
            ["method"],
            registry=self.registry,
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0),
        )
        self.rpc_errors = Counter(
            "kvtag_rpc_errors_total",
            "RPCs failed with a kvtag error",
            ["method", "reason"],
            registry=self.registry,
        )
        self.lookup_keys = Counter(
            "kvtag_lookup_keys_total", "Looked-up keys by status", ["status"], registry=self.registry
        )
        self.get_keys = Counter(
            "kvtag_get_keys_total", "Read keys by status", ["status"], registry=self.registry
        )
        self.put_items = Counter(
            "kvtag_put_items_total", "Put items by result", ["status"], registry=self.registry
        )
        self.put_bytes = Counter("kvtag_put_bytes_total", "Value bytes stored", registry=self.registry)
        self.get_bytes = Counter("kvtag_get_bytes_total", "Value bytes served", registry=self.registry)
        self.cross_mode_misses = Counter(
            "kvtag_cross_mode_misses_total",
            "Lookup misses whose block another mode held",
            registry=self.registry,
        )
        self.usage_base_keys_dropped = Counter(
            "kvtag_usage_base_keys_dropped_total",
            "Base keys companion engines left out of their usage reports (bounded lists full)",
            registry=self.registry,
        )
        self.sessions_refused = Counter(
            "kvtag_sessions_refused_total", "OpenSession refusals", ["reason"], registry=self.registry
        )
        self.probe_disagreements = Counter(
            "kvtag_probe_disagreements_total", "Sessions whose probe keys disagreed", registry=self.registry
        )
        self.sessions_expired = Counter(
            "kvtag_sessions_expired_total", "Sessions expired without heartbeat", registry=self.registry
        )

        self.namespaces_forgotten = Counter(
            "kvtag_census_namespaces_forgotten_total",
            "Namespaces dropped from the census after --census-retention without session, block or lease",
            registry=self.registry,
        )

    def watch(self, stats: Callable[[], BackendStats], live_sessions: Callable[[], int]) -> None:
        self.registry.register(_StoreCollector(stats, live_sessions))

    def watch_census(self, namespaces: Callable[[], int]) -> None:
        """The census's size, the figure its caps (--max-namespaces) bound."""
        gauge = Gauge("kvtag_census_namespaces", "Namespaces the census holds", registry=self.registry)
        gauge.set_function(lambda: float(namespaces()))

    def watch_arenas(self, arenas: Callable[[], int], prefault: Callable[[], tuple[int, int]]) -> None:
        """The memory backend's tenant arenas (what the operator names bounds them) and its up-front prefault:
        touched reaching target means the store has settled (docs/operations.md, "Prefault")."""
        Gauge("kvtag_tenant_arenas", "Tenant arenas held", registry=self.registry).set_function(
            lambda: float(arenas())
        )
        touched = Gauge(
            "kvtag_prefault_touched_bytes", "Bytes the up-front prefault has touched", registry=self.registry
        )
        touched.set_function(lambda: float(prefault()[0]))
        target = Gauge(
            "kvtag_prefault_target_bytes",
            "Bytes the up-front prefault touches in all",
            registry=self.registry,
        )
        target.set_function(lambda: float(prefault()[1]))


class _StoreCollector(Collector):
    def __init__(self, stats: Callable[[], BackendStats], live_sessions: Callable[[], int]) -> None:
        self._stats = stats
        self._live = live_sessions

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        """A scrape never fails because the backend does: an unreachable backend (Mooncake master
        down) reports kvtag_backend_up 0 and leaves out the figures it could not read."""
        yield GaugeMetricFamily("kvtag_live_sessions", "Live sessions", value=self._live())
        try:
            stats = self._stats()
        except BackendUnavailable as exc:
            log.warning("metrics scrape without backend figures: %s", exc)
            stats = None
        except Exception:  # a bug in a backend's stats must not take the metrics endpoint down
            log.exception("reading backend stats for a metrics scrape failed")
            stats = None
        yield GaugeMetricFamily(
            "kvtag_backend_up",
            "1 if the backend answered this scrape's stats, else 0",
            value=0 if stats is None else 1,
        )
        if stats is None:
            return
        yield GaugeMetricFamily("kvtag_capacity_bytes", "Store capacity", value=stats.capacity_bytes)
        yield GaugeMetricFamily("kvtag_used_bytes", "Value bytes held", value=stats.used_bytes)
        yield GaugeMetricFamily("kvtag_keys", "Blocks held", value=stats.keys)
        yield GaugeMetricFamily("kvtag_leased_keys", "Blocks held by read leases", value=stats.leased_keys)
        yield CounterMetricFamily("kvtag_evictions", "Blocks evicted for room", value=stats.evictions)
        yield CounterMetricFamily(
            "kvtag_corrupted_dropped", "Values dropped on checksum mismatch", value=stats.corrupted_dropped
        )
        errors = CounterMetricFamily(
            "kvtag_backend_errors", "Backend errors met by this replica, by kind", labels=["kind"]
        )
        for kind, count in sorted(stats.errors.items()):
            errors.add_metric([kind], count)
        yield errors
        per_ns = GaugeMetricFamily(
            "kvtag_namespace_used_bytes", "Value bytes per namespace", labels=["namespace"]
        )
        for ns_id, (_keys, used) in sorted(stats.per_namespace.items()):
            per_ns.add_metric([ns_id], used)
        yield per_ns
        yield from _tenant_families(stats)
        yield from _tier_families(stats)


# Per-tier counters of the memory backend's tiers (TierUsage field -> help text).
_TIER_COUNTERS = (
    ("hits", "Blocks served from the tier"),
    ("spills", "Blocks written to the tier (disk: evicted from memory)"),
    ("reads_back", "Blocks read back from the tier into a reply or a slot"),
    ("corrupted_dropped", "Records dropped from the tier: checksum mismatch or torn by a crash"),
    ("evictions", "Blocks evicted from the tier for room (its own LRU)"),
    ("failures", "I/O failures of the tier (ENOSPC, EIO, read-only)"),
)


def _tier_families(stats: BackendStats) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    """kvtag_tier_* per storage tier (label tier=memory|disk); nothing for backends without tiers.
    The degraded reason is not a label (it names paths and errno text): read it on the status page."""
    if not stats.tiers:
        return
    used = GaugeMetricFamily("kvtag_tier_used_bytes", "Value bytes held per tier", labels=["tier"])
    capacity = GaugeMetricFamily("kvtag_tier_capacity_bytes", "Capacity per tier", labels=["tier"])
    keys = GaugeMetricFamily("kvtag_tier_keys", "Blocks held per tier", labels=["tier"])
    degraded = GaugeMetricFamily(
        "kvtag_tier_degraded",
        "1 while the tier is out of use after a failure (the store serves from memory only), else 0",
        labels=["tier"],
    )
    counters = {
        name: CounterMetricFamily(f"kvtag_tier_{name}", text, labels=["tier"])
        for name, text in _TIER_COUNTERS
    }
    for tier in stats.tiers:
        used.add_metric([tier.tier], tier.used_bytes)
        capacity.add_metric([tier.tier], tier.capacity_bytes)
        keys.add_metric([tier.tier], tier.keys)
        degraded.add_metric([tier.tier], 1 if tier.degraded else 0)
        for name, family in counters.items():
            family.add_metric([tier.tier], getattr(tier, name))
    yield from (used, capacity, keys, degraded)
    yield from counters.values()


def _tenant_families(stats: BackendStats) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    """Per-tenant figures (tenant names are labels: the metrics port is the operator's, docs/security.md)."""
    used = GaugeMetricFamily("kvtag_tenant_used_bytes", "Value bytes per tenant", labels=["tenant"])
    keys = GaugeMetricFamily("kvtag_tenant_keys", "Blocks per tenant", labels=["tenant"])
    quota = GaugeMetricFamily(
        "kvtag_tenant_quota_bytes", "Tenant quota (0: shares the pool)", labels=["tenant"]
    )
    evictions = CounterMetricFamily(
        "kvtag_tenant_evictions", "Blocks of the tenant evicted for room", labels=["tenant"]
    )
    for tenant, usage in sorted(stats.per_tenant.items()):
        used.add_metric([tenant], usage.used_bytes)
        keys.add_metric([tenant], usage.keys)
        quota.add_metric([tenant], usage.quota_bytes)
        evictions.add_metric([tenant], usage.evictions)
    families: tuple[GaugeMetricFamily | CounterMetricFamily, ...] = (used, keys, quota, evictions)
    yield from families


KEY_STATUS_NAMES = {pb.HIT: "hit", pb.MISS: "miss", pb.MODE_MISMATCH: "mode_mismatch"}
PUT_STATUS_NAMES = {
    pb.STORED: "stored",
    pb.ALREADY_PRESENT: "already_present",
    pb.CONFLICT: "conflict",
    pb.REJECTED: "rejected",
}
