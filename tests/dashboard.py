"""The PromQL of the Grafana dashboard (deploy/grafana/dashboards/kvtag.json), for the tests that check
it against a live /metrics (tests/service) and a real Prometheus (tests/container)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DASHBOARD = REPO / "deploy" / "grafana" / "dashboards" / "kvtag.json"


def load() -> dict[str, Any]:
    dashboard: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return dashboard


def panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Every panel, rows' nested panels included."""
    for panel in items:
        yield panel
        yield from panels(panel.get("panels", []))


def queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target and template variable."""
    found = [
        (panel["title"], target["expr"])
        for panel in panels(dashboard["panels"])
        for target in panel.get("targets", [])
    ]
    found += [(f"variable {v['name']}", v["query"]["query"]) for v in dashboard["templating"]["list"]]
    return found


LABEL_VALUES = re.compile(r"^label_values\((?P<metric>[^,]+),\s*(?P<label>\w+)\)$")


def as_prometheus_query(expr: str) -> str:
    """The expression as Grafana would send it with every namespace selected. A variable's
    `label_values(metric, label)` is Grafana's, not PromQL: it becomes `group by (label) (metric)`,
    which selects the same series."""
    if match := LABEL_VALUES.match(expr):
        return f"group by ({match['label']}) ({match['metric']})"
    return expr.replace("$namespace", ".*").replace("$__rate_interval", "1m")
