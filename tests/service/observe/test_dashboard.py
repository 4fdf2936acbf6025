"""The Grafana dashboard (deploy/grafana/dashboards/kvtag.json) reads only metrics the service exports.

Checked against a live `/metrics` of a real server after the status scenario's traffic, so a renamed
or dropped metric fails here rather than as an empty panel in production.
"""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from tests import dashboard as dashboards

from .. import status_scenario as sc

REPO = Path(__file__).resolve().parents[3]
DATASOURCE = REPO / "deploy" / "grafana" / "provisioning" / "datasources" / "prometheus.yaml"
METRIC = re.compile(r"\b(kvtag_[a-z0-9_]+)\b")


def exported_names(exposition: str) -> set[str]:
    """Sample names, plus the `_total` name of every counter family (a counter with no labelled
    children yet, such as backend errors on a healthy backend, still exports its family)."""
    names: set[str] = set()
    for family in text_string_to_metric_families(exposition):
        names.update(sample.name for sample in family.samples)
        names.add(family.name)
        if family.type == "counter":
            names.add(family.name + "_total")
    return names


def test_every_dashboard_query_names_a_metric_the_service_exports() -> None:
    dashboard = dashboards.load()
    s = sc.start()
    try:
        sc.run(s)
        code, _, exposition = s.fetch("/metrics")
    finally:
        s.close()
    assert code == 200
    exported = exported_names(exposition)
    found = dashboards.queries(dashboard)
    assert len(found) >= 20
    for where, expr in found:
        names = METRIC.findall(expr)
        assert names, f"{where}: {expr!r} names no kvtag metric"
        missing = sorted(set(names) - exported)
        assert not missing, f"{where}: {missing} are not exported by /metrics"


def test_dashboard_covers_the_diagnostics_and_uses_the_provisioned_datasource() -> None:
    dashboard = dashboards.load()
    panels = [p for p in dashboards.panels(dashboard["panels"]) if p["type"] != "row"]
    titles = {p["title"] for p in panels}
    assert {
        "Hit rate per mode",
        "Cross-mode misses: mode M' held the block",
        "Hit-rate cost of each split",
        "Refusals and probe disagreements",
        "Bytes in / out",
        "RPC latency percentiles per method",
        "Capacity and used bytes",
        "Evictions",
        "Backend errors",
    } <= titles
    uid = re.search(r"^\s*uid:\s*(\S+)$", DATASOURCE.read_text(), re.MULTILINE)
    assert uid is not None
    for panel in panels:
        assert panel["datasource"]["uid"] == uid.group(1), panel["title"]
        assert all(t["datasource"]["uid"] == uid.group(1) for t in panel["targets"]), panel["title"]
    ids = [p["id"] for p in dashboards.panels(dashboard["panels"])]
    assert len(ids) == len(set(ids))
    latency = next(p for p in panels if p["title"] == "RPC latency percentiles per method")
    assert [t["expr"].split(",")[0] for t in latency["targets"]] == [
        "histogram_quantile(0.5",
        "histogram_quantile(0.9",
        "histogram_quantile(0.99",
    ]
