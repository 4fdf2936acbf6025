"""What an operator reads about the tiers: /metrics per tier, the status page's tiers table and
degraded line, and a status page left open across an expired page token (its refresh starts again
from the first page instead of answering 400). The real disk faults are in test_disk_restart.py."""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest
from kvtag_store.observe import status_page

from .. import status_scenario as sc

SCHEMA = json.loads((Path(__file__).resolve().parents[3] / "docs" / "status.schema.json").read_text())


@pytest.fixture(scope="module")
def scenario() -> Iterator[sc.Scenario]:
    s = sc.start()
    try:
        sc.run(s)
        yield s
    finally:
        s.close()


def test_an_open_status_page_with_an_expired_token_starts_again_from_the_first_page(
    scenario: sc.Scenario,
) -> None:
    stale = scenario.http + "/?page_size=1&page_token=feedfacefeedface.1"
    with urllib.request.urlopen(stale, timeout=10) as r:
        final_url, code, body = r.geturl(), r.status, r.read().decode()
    assert code == 200
    assert "page_token=feedface" not in final_url, final_url
    assert "page_size=1" in final_url, "the redirect keeps the page's own query"
    assert "<h1>kvtag store status</h1>" in body
    # The JSON keeps its contract: a client following tokens must learn that its token expired.
    code, _, text = scenario.fetch("/api/v1/status?page_token=feedfacefeedface.1")
    assert code == 400 and "expired" in text


def test_metrics_and_status_show_the_memory_tier_and_the_prefault(scenario: sc.Scenario) -> None:
    _, _, metrics = scenario.fetch("/metrics")
    for family in ("used_bytes", "capacity_bytes", "keys", "degraded", "hits_total", "spills_total"):
        assert re.search(rf'^kvtag_tier_{family}\{{tier="memory"\}} ', metrics, re.M), family
    assert 'kvtag_tier_degraded{tier="memory"} 0.0' in metrics
    doc = scenario.status()
    jsonschema.validate(doc, SCHEMA)
    tiers = doc["store"]["store_wide"]["tiers"]
    assert [t["tier"] for t in tiers] == ["memory"]
    assert tiers[0]["used_bytes"] == doc["store"]["store_wide"]["used_bytes"]
    assert doc["store"]["degraded"] == []
    prefault = doc["store"]["store_wide"]["prefault"]
    assert prefault["total_bytes"] > 0 and 0 <= prefault["done_bytes"] <= prefault["total_bytes"]
    _, _, page = scenario.fetch("/")
    assert '<table id="tiers">' in page and "tier degraded" not in page
    assert "<th>prefault</th>" in page


def test_a_degraded_disk_tier_is_a_visible_line_on_the_page(scenario: sc.Scenario) -> None:
    doc = scenario.status()
    disk = dict(doc["store"]["store_wide"]["tiers"][0], tier="disk", degraded=True)
    disk["degraded_reason"] = "ENOSPC writing /var/lib/kvtag/seg-0001 <full>"
    doc["store"]["store_wide"]["tiers"].append(disk)
    doc["store"]["degraded"] = [{"tier": "disk", "reason": disk["degraded_reason"]}]
    jsonschema.validate(doc, SCHEMA)
    page = status_page.render(doc)
    assert "disk tier degraded: ENOSPC writing /var/lib/kvtag/seg-0001 &lt;full&gt;" in page
    assert page.count('<span class="warn">degraded</span>') == 1
