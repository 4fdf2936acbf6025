"""The status document behind `/api/v1/status` and the status page: the census report, the store's
figures and the hit-rate history, as one JSON-ready dict (schema: docs/status-api.md,
docs/status.schema.json).

The page is rendered from this same document, so the two never disagree. A view is filtered to the
tenants its caller may see; store-wide figures (other tenants' bytes, evictions) are shown only to a
caller that sees everything.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvtag.v1 import store_pb2 as pb

from kvtag_store.backends.base import BackendStats, BackendUnavailable
from kvtag_store.config import policy_name
from kvtag_store.observe.diagnose_pages import DiagnosePager
from kvtag_store.observe.history import HitRateHistory, Point
from kvtag_store.observe.tenant_stats import tenant_usage
from kvtag_store.policy.mode_diff import MODE_FIELDS, field_text

log = logging.getLogger("kvtag_store.observe.status")

SCHEMA = "kvtag.status/v1"
DESCRIPTOR_FIELDS = (
    "model_name",
    "weights_fingerprint",
    "kv_dtype",
    "kv_layout",
    "block_size",
    "parallel_sharding",
    "tenant",
)


@dataclass(frozen=True)
class View:
    """Whose view: which tenants' namespaces it includes, and whether it sees store-wide figures."""

    may_see: Callable[[str], bool]
    store_wide: bool

    @classmethod
    def everything(cls) -> View:
        return cls(lambda _tenant: True, True)

    @classmethod
    def tenants(cls, tenants: frozenset[str]) -> View:
        return cls(tenants.__contains__, False)


class StatusSource:
    """Reads the live census, backend figures and history into a status document."""

    def __init__(
        self,
        report: Callable[[], pb.DiagnoseResponse],
        stats: Callable[[], BackendStats],
        history: HitRateHistory,
        pages: DiagnosePager | None = None,
    ) -> None:
        """With `pages`, documents hold one page of namespaces (paged); without, every namespace."""
        self._report = report
        self._stats = stats
        self.history = history
        self._pages = pages

    def document(self, view: View) -> dict[str, Any]:
        """Every namespace the view may see (or the first page of them, with `pages`)."""
        return self.paged(view, pb.DiagnoseRequest())[0]

    def paged(self, view: View, request: pb.DiagnoseRequest) -> tuple[dict[str, Any], str, int]:
        """The document of one page of namespaces (Diagnose's filter, page_size and page_token), the
        next page's token ("" on the last) and the namespaces across all pages."""
        try:
            stats: BackendStats | None = self._stats()
        except BackendUnavailable as exc:
            log.warning("status without backend figures: %s", exc)
            stats = None
        per_ns = stats.per_namespace if stats is not None else {}
        if self._pages is not None:
            report = self._pages.page(request, view.may_see)
            tenant_of = self._pages.tenants()
            visible = list(report.namespaces)
        else:
            report = self._report()
            tenant_of = {ns.namespace_id: ns.namespace.tenant for ns in report.namespaces}
            visible = [ns for ns in report.namespaces if view.may_see(ns.namespace.tenant)]
            report.total_namespaces = len(visible)
        namespaces = [_namespace(ns, per_ns.get(ns.namespace_id), self.history) for ns in visible]
        document = self._document(stats, view, tenant_of, namespaces)
        return document, report.next_page_token, report.total_namespaces

    def _document(
        self,
        stats: BackendStats | None,
        view: View,
        tenant_of: dict[str, str],
        namespaces: list[dict[str, Any]],
    ) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "generated_at_unix_ms": int(time.time() * 1000),
            "history_interval_s": self.history.interval_s,
            "history_points": self.history.points,
            "store": _store(stats, view),
            "tenants": _tenants(stats, tenant_of, view),
            "namespaces": namespaces,
        }


def _store(stats: BackendStats | None, view: View) -> dict[str, Any]:
    if stats is None:
        return {
            "backend_up": False,
            "backend": None,
            "capacity_bytes": None,
            "degraded": [],
            "store_wide": None,
        }
    store_wide = None
    if view.store_wide:
        store_wide = {
            "used_bytes": stats.used_bytes,
            "keys": stats.keys,
            "leased_keys": stats.leased_keys,
            "evictions": stats.evictions,
            "corrupted_dropped": stats.corrupted_dropped,
            "backend_errors": dict(sorted(stats.errors.items())),
            "tiers": [dataclasses.asdict(tier) for tier in stats.tiers],
            "prefault": {"done_bytes": stats.prefault[0], "total_bytes": stats.prefault[1]},
        }
    return {
        "backend_up": True,
        "backend": stats.backend,
        "capacity_bytes": stats.capacity_bytes,
        # Every viewer sees that a tier is out of use: it explains everyone's lost hits.
        "degraded": [
            {"tier": tier.tier, "reason": tier.degraded_reason} for tier in stats.tiers if tier.degraded
        ],
        "store_wide": store_wide,
    }


def _tenants(stats: BackendStats | None, tenant_of: dict[str, str], view: View) -> list[dict[str, Any]]:
    """Capacity (quota), used bytes and evictions per tenant: what a viewer limited to some tenants
    sees instead of the store-wide figures."""
    if stats is None:
        return []
    return [
        {
            "tenant": tenant,
            "keys": u.keys,
            "used_bytes": u.used_bytes,
            "quota_bytes": u.quota_bytes,
            "evictions": u.evictions,
        }
        for tenant, u in sorted(tenant_usage(stats, tenant_of).items())
        if view.may_see(tenant)
    ]


def _rate(part: int, whole: int) -> float | None:
    return part / whole if whole else None


def _namespace(
    ns: pb.NamespaceReport, usage: tuple[int, int] | None, history: HitRateHistory
) -> dict[str, Any]:
    differing = [name for name in MODE_FIELDS if len({field_text(m.mode, name) for m in ns.modes}) > 1]
    modes = [_mode(ns.namespace_id, m, history) for m in ns.modes]
    splits = [
        {
            "mode_id": m.mode_id,
            "held_by_mode_id": x.held_by_mode_id,
            "misses": x.count,
            "hit_rate_cost": _rate(x.count, _keys(m.counters)),
        }
        for m in ns.modes
        for x in m.cross_mode_misses
    ]
    keys, used = usage if usage is not None else (0, 0)
    return {
        "namespace_id": ns.namespace_id,
        "descriptor": {name: getattr(ns.namespace, name) for name in DESCRIPTOR_FIELDS},
        "policy": policy_name(ns.policy),
        "established_mode_id": ns.established_mode_id or None,
        "keys": keys,
        "used_bytes": used,
        "differing_fields": differing,
        "modes": modes,
        "splits": splits,
        "refused": [_refused(r) for r in ns.refused],
        "probe_disagreements": [
            {
                "mode_id": p.mode_id,
                "engine_id": p.engine_id,
                "reference_engine_id": p.reference_engine_id,
                "likely_cause": p.likely_cause,
                "at_unix_ms": p.at_unix_ms,
            }
            for p in ns.probe_disagreements
        ],
    }


def _keys(c: pb.ModeCounters) -> int:
    return c.hits + c.misses + c.mode_mismatches


def hit_rate_if_aligned(c: pb.ModeCounters) -> float | None:
    """The hit rate had the namespace's modes agreed: a key another mode holds would have been a
    hit, whether the caller's mode missed it (a cross-mode miss, found by base key) or found it
    tagged with the other mode (a mode mismatch)."""
    return _rate(c.hits + c.cross_mode_misses + c.mode_mismatches, _keys(c))


def _mode(ns_id: str, m: pb.ModeReport, history: HitRateHistory) -> dict[str, Any]:
    c = m.counters
    keys = _keys(c)
    return {
        "mode_id": m.mode_id,
        "fields": {name: field_text(m.mode, name) for name in MODE_FIELDS},
        "engines": [
            {
                "engine_id": e.engine_id,
                "live": e.live,
                "opened_unix_ms": e.opened_unix_ms,
                "last_seen_unix_ms": e.last_seen_unix_ms,
                "labels": dict(sorted(e.labels.items())),
            }
            for e in m.engines
        ],
        "counters": {
            "hits": c.hits,
            "misses": c.misses,
            "mode_mismatches": c.mode_mismatches,
            "cross_mode_misses": c.cross_mode_misses,
            "conflicts": c.conflicts,
            "stored": c.stored,
        },
        "hit_rate": _rate(c.hits, keys),
        "hit_rate_if_aligned": hit_rate_if_aligned(c),
        "cross_mode": [
            {"held_by_mode_id": x.held_by_mode_id, "misses": x.count} for x in m.cross_mode_misses
        ],
        "history": [_point(p) for p in history.series(ns_id, m.mode_id)],
    }


def _point(p: Point) -> dict[str, Any]:
    return {
        "at_unix_ms": p.at_unix_ms,
        "hits": p.hits,
        "misses": p.misses,
        "mode_mismatches": p.mode_mismatches,
        "cross_mode_misses": p.cross_mode_misses,
        "hit_rate": p.hit_rate,
        "cross_mode_share": p.cross_mode_share,
    }


def _refused(r: pb.RefusedSession) -> dict[str, Any]:
    refusal = r.refusal if r.HasField("refusal") else None
    return {
        "engine_id": r.engine_id,
        "at_unix_ms": r.at_unix_ms,
        "kind": "MODE_REFUSED" if refusal is not None else "PROBE_DISAGREEMENT",
        "reason": r.reason,
        "established_mode_id": refusal.established_mode_id if refusal is not None else None,
        "requested_mode_id": refusal.requested_mode_id if refusal is not None else None,
        "diffs": [
            {"field": d.field, "established": d.established, "requested": d.requested}
            for d in (refusal.diffs if refusal is not None else ())
        ],
    }
