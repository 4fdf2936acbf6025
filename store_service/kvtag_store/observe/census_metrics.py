"""Per-mode Prometheus series read from the census at scrape time, for the Grafana dashboard.

Labels are the namespace and mode digests (never tenant names or anything a client typed), and the
series count is bounded by the census: modes per namespace are few, and a mode's series go when
its namespace does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from kvtag.v1 import store_pb2 as pb
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector


class CensusCollector(Collector):
    def __init__(self, report: Callable[[], pb.DiagnoseResponse]) -> None:
        self._report = report

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        keys = CounterMetricFamily(
            "kvtag_mode_keys",
            "Looked-up and read keys per namespace and mode, by status (hit, miss, mode_mismatch)",
            labels=["namespace", "mode", "status"],
        )
        cross = CounterMetricFamily(
            "kvtag_mode_cross_mode_misses",
            "A mode's lookup misses whose block another mode (held_by) held: the hit rate the split costs",
            labels=["namespace", "mode", "held_by"],
        )
        engines = GaugeMetricFamily(
            "kvtag_mode_live_engines", "Live sessions per namespace and mode", labels=["namespace", "mode"]
        )
        for ns in self._report().namespaces:
            ns_id = ns.namespace_id
            for m in ns.modes:
                c = m.counters
                keys.add_metric([ns_id, m.mode_id, "hit"], c.hits)
                keys.add_metric([ns_id, m.mode_id, "miss"], c.misses)
                keys.add_metric([ns_id, m.mode_id, "mode_mismatch"], c.mode_mismatches)
                for x in m.cross_mode_misses:
                    cross.add_metric([ns_id, m.mode_id, x.held_by_mode_id], x.count)
                engines.add_metric([ns_id, m.mode_id], sum(1 for e in m.engines if e.live))
        yield keys
        yield cross
        yield engines
