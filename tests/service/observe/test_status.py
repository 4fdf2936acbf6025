"""The status JSON and page on the service's HTTP port, through a real server and real traffic.

The scenario (status_scenario.py): an isolate namespace split between two modes with cross-mode
misses and a probe disagreement, and a strict namespace with a refused engine.
"""

from __future__ import annotations

import base64
import json
import re
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from kvtag_proto.channels import ChannelSecurity
from kvtag_store.observe import status_page
from kvtag_store.security.options import Security
from kvtag_store.security.tokens import TokenRegistry

from .. import status_scenario as sc
from ..security_harness import Grant, write_tokens

SCHEMA = json.loads((Path(__file__).resolve().parents[3] / "docs" / "status.schema.json").read_text())


@pytest.fixture(scope="module")
def scenario() -> Iterator[sc.Scenario]:
    s = sc.start()
    try:
        sc.run(s)
        yield s
    finally:
        s.close()


def _namespace(doc: dict[str, Any], ns_id: str) -> dict[str, Any]:
    found: list[dict[str, Any]] = [n for n in doc["namespaces"] if n["namespace_id"] == ns_id]
    assert len(found) == 1, found
    return found[0]


def test_status_json_follows_its_schema_and_reports_the_scenario(scenario: sc.Scenario) -> None:
    doc = scenario.status()
    jsonschema.validate(doc, SCHEMA)
    split = _namespace(doc, scenario.split_ns)
    assert split["policy"] == "isolate"
    assert split["differing_fields"] == ["lookahead_tokens"]
    modes = {m["mode_id"]: m for m in split["modes"]}
    assert set(modes) == {scenario.lookahead_mode, scenario.legacy_mode}
    ahead = modes[scenario.lookahead_mode]
    assert ahead["fields"]["lookahead_tokens"] == "1"
    # Four misses then two hits; the legacy mode held three of the four missed blocks.
    assert (ahead["counters"]["hits"], ahead["counters"]["misses"]) == (2, 4)
    assert ahead["cross_mode"] == [{"held_by_mode_id": scenario.legacy_mode, "misses": sc.CROSS_MODE_MISSES}]
    assert split["splits"] == [
        {
            "mode_id": scenario.lookahead_mode,
            "held_by_mode_id": scenario.legacy_mode,
            "misses": 3,
            "hit_rate_cost": 0.5,
        }
    ]
    assert (ahead["hit_rate"], ahead["hit_rate_if_aligned"]) == (pytest.approx(2 / 6), pytest.approx(5 / 6))
    engines = {e["engine_id"]: e for m in split["modes"] for e in m["engines"]}
    assert {k: e["live"] for k, e in engines.items()} == {
        "engine-lookahead": True,
        "engine-legacy": True,
        "engine-drifted": False,
    }
    assert engines["engine-legacy"]["labels"] == {"host": "node-2", "vllm": "0.32.0"}
    assert engines["engine-legacy"]["last_seen_unix_ms"] >= engines["engine-legacy"]["opened_unix_ms"] > 0
    [drift] = split["probe_disagreements"]
    assert (drift["engine_id"], drift["reference_engine_id"]) == ("engine-drifted", "engine-legacy")
    assert "labels differ (host: node-2 vs node-3" in drift["likely_cause"]

    strict = _namespace(doc, scenario.strict_ns)
    assert (strict["policy"], strict["established_mode_id"]) == ("strict", scenario.lookahead_mode)
    [refused] = strict["refused"]
    assert (refused["engine_id"], refused["kind"]) == ("engine-strict-b", "MODE_REFUSED")
    assert refused["requested_mode_id"] == scenario.refused_mode
    assert refused["diffs"] == [
        {"field": "hash_algorithm", "established": "sha256", "requested": "xxh3-128"},
        {"field": "lookahead_tokens", "established": "1", "requested": "0"},
    ]
    store = doc["store"]
    assert (store["backend"], store["capacity_bytes"]) == ("memory", 16 << 20)
    assert store["store_wide"]["used_bytes"] == split["used_bytes"] == 7 * 512
    assert store["store_wide"]["evictions"] == 0
    assert doc["tenants"] == [
        {"tenant": "team-split", "keys": 7, "used_bytes": 7 * 512, "quota_bytes": 0, "evictions": 0},
        {"tenant": "team-strict", "keys": 0, "used_bytes": 0, "quota_bytes": sc.STRICT_QUOTA, "evictions": 0},
    ]


def test_page_renders_the_same_figures_without_scripts_or_remote_assets(scenario: sc.Scenario) -> None:
    code, kind, page = scenario.fetch("/")
    assert (code, kind) == (200, "text/html; charset=utf-8")
    assert '<meta http-equiv="refresh" content="10">' in page
    assert "<script" not in page.lower()
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", page), "the page loads nothing remote"
    assert f'mode <span class="mono">{scenario.legacy_mode}</span> held <b>3</b> of mode' in page
    assert '<th class="diff">lookahead_tokens</th>' in page
    assert "engine-strict-b" in page and "xxh3-128" in page


def test_a_tenant_over_its_quota_shows_its_evictions() -> None:
    s = sc.start()
    try:
        engine = s.store.open("engine-strict-a", sc.LOOKAHEAD, sc.STRICT_NS)
        # Three 400 KiB blocks in a 1 MiB quota: the oldest is evicted, within the tenant's pool.
        for i in range(3):
            s.store.put(engine.session_id, (b"big-%d" % i, b"x" * (400 << 10)))
        doc = s.status()
        _, _, page = s.fetch("/")
    finally:
        s.close()
    jsonschema.validate(doc, SCHEMA)
    [row] = [t for t in doc["tenants"] if t["tenant"] == "team-strict"]
    assert (row["keys"], row["used_bytes"], row["evictions"]) == (2, 800 << 10, 1)
    assert doc["store"]["store_wide"]["evictions"] == 1
    tenants = page[page.index('<table id="tenants">') :].split("</table>")[0]
    assert "<td>team-strict</td><td>1.0 MiB (1048576 bytes)</td>" in tenants
    assert '<td class="num">2</td><td class="num">1</td></tr>' in tenants


def test_client_strings_are_escaped_on_the_page() -> None:
    s = sc.start()
    try:
        s.store.open("<script>alert(1)</script>", sc.LOOKAHEAD, sc.SPLIT_NS, labels={"x": "<b>y</b>"})
        _, _, page = s.fetch("/")
    finally:
        s.close()
    assert "<script>" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "&lt;b&gt;y&lt;/b&gt;" in page


def test_tenant_parameter_narrows_the_view(scenario: sc.Scenario) -> None:
    doc = scenario.status("?tenant=team-strict")
    jsonschema.validate(doc, SCHEMA)
    assert [n["namespace_id"] for n in doc["namespaces"]] == [scenario.strict_ns]
    assert [t["tenant"] for t in doc["tenants"]] == ["team-strict"]
    assert scenario.status("?tenant=nobody")["namespaces"] == []
    _, _, page = scenario.fetch("/?tenant=team-strict")
    assert scenario.strict_ns in page and scenario.split_ns not in page


def test_history_samples_interval_deltas_and_draws_a_sparkline() -> None:
    s = sc.start(history_interval_s=0.05)
    try:
        sc.run(s)
        deadline = time.monotonic() + 30
        while True:  # more traffic until the history holds two intervals with lookups
            legacy = s.store.open("engine-legacy-2", sc.LEGACY, sc.SPLIT_NS)
            s.store.lookup(legacy.session_id, b"legacy-0", b"legacy-9")
            doc = s.status()
            ns = _namespace(doc, s.split_ns)
            [legacy_mode] = [m for m in ns["modes"] if m["mode_id"] == s.legacy_mode]
            busy = [p for p in legacy_mode["history"] if p["hit_rate"] is not None]
            if len(busy) >= 2 or time.monotonic() > deadline:
                break
            time.sleep(0.06)
        _, _, page = s.fetch("/")
    finally:
        s.close()
    jsonschema.validate(doc, SCHEMA)
    assert len(busy) >= 2
    history = legacy_mode["history"]
    # The points are per-interval deltas: they add up to no more than the lifetime counters.
    assert sum(p["hits"] for p in history) <= legacy_mode["counters"]["hits"]
    assert all(p["hit_rate"] == p["hits"] / (p["hits"] + p["misses"] + p["mode_mismatches"]) for p in busy)
    # Busy intervals are drawn (a line, or a dot where the neighbours were quiet).
    assert re.search(r'<svg class="spark"[^>]*>.*<(polyline|circle) ', page)


def test_sparkline_leaves_gaps_for_quiet_intervals() -> None:
    svg = status_page.sparkline([1.0, 0.5, None, 0.25], slots=4, width=30, height=12)
    assert svg.count("<polyline") == 1 and svg.count("<circle") == 1
    assert 'points="0.0,1.0 10.0,6.0"' in svg


def test_http_port_keeps_metrics_and_refuses_unknown_paths(scenario: sc.Scenario) -> None:
    code, _, metrics = scenario.fetch("/metrics")
    assert code == 200
    assert (
        f'kvtag_mode_cross_mode_misses_total{{held_by="{scenario.legacy_mode}",'
        f'mode="{scenario.lookahead_mode}",namespace="{scenario.split_ns}"}} 3.0'
    ) in metrics
    hits = f'mode="{scenario.lookahead_mode}",namespace="{scenario.split_ns}",status="hit"'
    assert f"kvtag_mode_keys_total{{{hits}}} 2.0" in metrics
    assert scenario.fetch("/nothing-here")[0] == 404


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[sc.Scenario, dict[str, str]]]:
    """The scenario on a store with tokens: the page needs a viewer or admin token."""
    directory = tmp_path_factory.mktemp("status-auth")
    grants: list[Grant] = [
        ("admin", "admin", ["*"]),
        ("viewer-strict", "viewer", ["team-strict"]),
        ("engine-split", "engine", ["team-split"]),
    ]
    tokens = write_tokens(directory / "tokens.toml", grants)
    (directory / "admin.token").write_text(tokens["admin"] + "\n")
    s = sc.start(
        security=Security(tokens=TokenRegistry.from_file(directory / "tokens.toml")),
        channel_security=ChannelSecurity(token_file=str(directory / "admin.token"), use_env_token=False),
    )
    try:
        sc.run(s)
        yield s, tokens
    finally:
        s.close()


def test_with_tokens_the_page_needs_a_viewer_and_shows_only_its_tenants(
    secured: tuple[sc.Scenario, dict[str, str]],
) -> None:
    s, tokens = secured
    for path in ("/", "/api/v1/status"):
        code, _, body = s.fetch(path)
        assert code == 401 and "token" in body, body
        assert s.fetch(path, {"Authorization": "Bearer kvt_not-a-token"})[0] == 401
        assert s.fetch(path, {"Authorization": f"Bearer {tokens['engine-split']}"})[0] == 403
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(s.http + "/", timeout=10)
    assert refused.value.headers["WWW-Authenticate"] == 'Basic realm="kvtag status"'

    viewer = {"Authorization": f"Bearer {tokens['viewer-strict']}"}
    code, _, body = s.fetch("/api/v1/status", viewer)
    doc = json.loads(body)
    jsonschema.validate(doc, SCHEMA)
    assert [n["namespace_id"] for n in doc["namespaces"]] == [s.strict_ns]
    assert doc["store"]["store_wide"] is None, "a tenant viewer sees no store-wide figures"
    assert [(t["tenant"], t["quota_bytes"]) for t in doc["tenants"]] == [("team-strict", sc.STRICT_QUOTA)]
    # ?tenant= narrows a view; it never widens it.
    code, _, body = s.fetch("/api/v1/status?tenant=team-split", viewer)
    assert json.loads(body)["namespaces"] == []
    # A browser sends the token as the Basic password (it prompts on the 401, no JavaScript).
    basic = base64.b64encode(f"me:{tokens['viewer-strict']}".encode()).decode()
    code, _, page = s.fetch("/", {"Authorization": f"Basic {basic}"})
    assert code == 200 and s.strict_ns in page and s.split_ns not in page
    assert "engine-lookahead" not in page

    admin = s.status_as(tokens["admin"])
    assert {n["namespace_id"] for n in admin["namespaces"]} == {s.split_ns, s.strict_ns}
    assert admin["store"]["store_wide"]["used_bytes"] == 7 * 512
    # /metrics is not the status page's to gate (docs/security.md says how to expose the port).
    assert s.fetch("/metrics")[0] == 200
