"""compose.observability.yaml: Prometheus (built from Debian's package) beside the store of
compose.yaml scrapes it, and every query of the provisioned Grafana dashboard evaluates there.

Grafana itself is not started: no registry is reachable here and no package index carries it, so
its service (an upstream image) is checked only for the provisioning it mounts.
"""

from __future__ import annotations

import json
import os
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from kvtag.v1 import store_pb2 as pb

from tests import dashboard as dashboards
from tests.descriptors import PROBE, mode, namespace
from tests.net import free_port

from . import kvtag_calls as kc
from . import podman as pm

pytestmark = pytest.mark.slow  # real podman containers

SPLIT = namespace("observability")
PROMETHEUS_IMAGE = os.environ.get("KVTAG_TEST_PROMETHEUS_IMAGE", "localhost/kvtag-prometheus:test")


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as answer:
        return json.loads(answer.read())


def _query(port: int, expr: str) -> dict[str, Any]:
    """Prometheus's answer to an instant query; a rejected query's answer (HTTP 400) too."""
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        with urllib.request.urlopen(url, timeout=10) as answer:
            document: dict[str, Any] = json.loads(answer.read())
    except urllib.error.HTTPError as exc:
        document = json.loads(exc.read())
    return document


def _wait(what: str, check: Any, timeout_s: float = 90) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            result = check()
        except OSError:
            result = None
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(1)


@pytest.fixture(scope="module")
def stack(image: str) -> Iterator[tuple[pm.ComposeProject, int, int]]:
    if pm.podman("image", "exists", PROMETHEUS_IMAGE, check=False).returncode != 0:
        pm.podman(
            "build", "--format", "docker", "--build-arg", f"BASE_IMAGE={pm.BASE_IMAGE}",
            "--tag", PROMETHEUS_IMAGE, "--file", str(pm.REPO / "deploy/prometheus/Containerfile"),
            str(pm.REPO / "deploy/prometheus"),
            timeout=600,
        )  # fmt: skip
    grpc_port, metrics_port, prometheus_port = free_port(), free_port(), free_port()
    project = pm.ComposeProject(
        "compose.yaml",
        f"{pm.RUN_ID}-observability",
        {
            "KVTAG_IMAGE": image,
            "KVTAG_PROMETHEUS_IMAGE": PROMETHEUS_IMAGE,
            "KVTAG_GRPC_PORT": str(grpc_port),
            "KVTAG_METRICS_PORT": str(metrics_port),
            "KVTAG_PROMETHEUS_PORT": str(prometheus_port),
        },
        overlays=("compose.observability.yaml",),
    )
    try:
        # podman-compose 1.0 ignores profiles, so the services are named (Grafana left out).
        project.compose("up", "--detach", "kvtag", "prometheus")
        pm.wait_healthy(project.container("kvtag"))
        yield project, grpc_port, prometheus_port
    finally:
        project.down()


def _open_split(kv: Any) -> dict[int, str]:
    """Two engines in one namespace, one per mode (legacy and lookahead)."""
    sessions = {}
    for lookahead in (0, 1):
        request = pb.OpenSessionRequest(
            engine_id=f"engine-l{lookahead}", namespace=SPLIT, mode=mode(lookahead), probe_keys=PROBE
        )
        sessions[lookahead] = kv.OpenSession(request, timeout=10).session_id
    return sessions


def _split_traffic(kv: Any, sessions: dict[int, str]) -> None:
    """The legacy engine stores four blocks; the lookahead engine misses all four (cross-mode
    misses), the legacy engine hits them."""
    bases = [b"base-%d" % i for i in range(4)]
    items = [
        pb.PutItem(block=pb.BlockRef(key=b"legacy-%d" % i, base_key=b), value=b"v" * 256)
        for i, b in enumerate(bases)
    ]
    kv.Put(pb.PutRequest(session_id=sessions[0], items=items), timeout=10)
    for lookahead, prefix in ((1, b"ahead-%d"), (0, b"legacy-%d")):
        blocks = [pb.BlockRef(key=prefix % i, base_key=b) for i, b in enumerate(bases)]
        kv.Lookup(pb.LookupRequest(session_id=sessions[lookahead], blocks=blocks), timeout=10)


def test_prometheus_scrapes_the_store_and_evaluates_every_dashboard_query(
    stack: tuple[pm.ComposeProject, int, int],
) -> None:
    project, grpc_port, port = stack
    _wait("prometheus ready", lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=5))
    bindings = pm.inspect(project.container("prometheus"))["HostConfig"]["PortBindings"]
    assert {b["HostIp"] for ports in bindings.values() for b in ports} == {"127.0.0.1"}

    def scraping() -> bool:
        targets = _get(f"http://127.0.0.1:{port}/api/v1/targets")["data"]["activeTargets"]
        return any(t["labels"]["job"] == "kvtag" and t["health"] == "up" for t in targets)

    _wait("the kvtag target to be up", scraping)
    with kc.channel(f"127.0.0.1:{grpc_port}") as chan:
        kv = kc.stub(chan)
        sessions = _open_split(kv)
        # Prometheus first sees both modes' counters at 0, so rate() has a before and an after.
        keys = 'kvtag_mode_keys_total{namespace=~".+"}'
        _wait("both modes' counters", lambda: len(_query(port, keys)["data"]["result"]) == 6)
        _split_traffic(kv, sessions)
    cross = 'kvtag_mode_cross_mode_misses_total{namespace=~".+"}'
    # The lookahead engine missed four blocks the legacy mode held.
    [series] = _wait("the cross-mode misses in Prometheus", lambda: _query(port, cross)["data"]["result"])
    assert series["value"][1] == "4"

    for where, expr in dashboards.queries(dashboards.load()):
        answer = _query(port, dashboards.as_prometheus_query(expr))
        assert answer["status"] == "success", f"{where}: {expr}: {answer}"
        if where == "variable namespace":  # the namespace picker offers the split's namespace
            assert [r["metric"]["namespace"] for r in answer["data"]["result"]] == [
                series["metric"]["namespace"]
            ]
    hit_rate = next(
        expr for where, expr in dashboards.queries(dashboards.load()) if where == "Hit rate per mode"
    )
    # rate() needs two scrapes after the traffic (5 s apart): then both modes have a hit rate.
    rates = _wait(
        "a hit rate for both modes",
        lambda: len(r := _query(port, dashboards.as_prometheus_query(hit_rate))["data"]["result"]) == 2 and r,
    )
    assert {float(r["value"][1]) for r in rates} == {0.0, 1.0}


def test_grafana_service_mounts_the_provisioning_the_dashboard_needs() -> None:
    compose = (pm.REPO / "compose.observability.yaml").read_text()
    assert "./deploy/grafana/provisioning:/etc/grafana/provisioning:ro" in compose
    assert "./deploy/grafana/dashboards:/var/lib/grafana/dashboards:ro" in compose
    provider = (pm.REPO / "deploy/grafana/provisioning/dashboards/kvtag.yaml").read_text()
    assert re.search(r"^\s+path: /var/lib/grafana/dashboards$", provider, re.MULTILINE)
    datasource = (pm.REPO / "deploy/grafana/provisioning/datasources/prometheus.yaml").read_text()
    assert "url: http://prometheus:9090" in datasource and re.search(
        r"^  prometheus:$", compose, re.MULTILINE
    )
    assert (pm.REPO / "deploy/grafana/dashboards/kvtag.json").is_file()
