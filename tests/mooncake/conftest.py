"""Fixtures for the Mooncake suite: one real cluster per session, inside a private network namespace."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from kvtag_store.backends.mooncake.backend import MooncakeBackend
from kvtag_store.backends.mooncake.census import MooncakeCensus
from kvtag_store.backends.mooncake.client import MooncakeClient, connect
from kvtag_store.backends.mooncake.cluster import master_breaker
from kvtag_store.backends.mooncake.errors import ErrorCounters

from .mooncake_cluster import MooncakeCluster, in_private_netns, settings_for


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests that need a cluster run only in a private network namespace; pure ones run anywhere."""
    if in_private_netns():
        return
    skip = pytest.mark.skip(
        reason="Mooncake processes run only inside a private network namespace: scripts/test_mooncake.sh"
    )
    for item in items:
        if "tests/mooncake" in str(item.fspath) and _needs_cluster(item):
            item.add_marker(skip)


def _needs_cluster(item: pytest.Item) -> bool:
    names = getattr(item, "fixturenames", ())
    return any(name in names for name in ("cluster", "own_cluster", "replicas", "ha_cluster"))


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeCluster]:
    c = MooncakeCluster(tmp_path_factory.mktemp("mooncake"))
    c.start_master()
    c.start_storage(128 << 20)
    yield c
    c.stop()


@pytest.fixture(scope="session")
def mooncake_backend(cluster: MooncakeCluster) -> Iterator[MooncakeBackend]:
    backend = MooncakeBackend(connect(settings_for(cluster)), settings_for(cluster))
    yield backend
    backend.close()


@pytest.fixture(scope="session")
def mooncake_census(cluster: MooncakeCluster) -> Iterator[MooncakeCensus]:
    client = connect(settings_for(cluster))
    breaker = master_breaker(client, cluster.master_address, ErrorCounters())
    census = MooncakeCensus(client, breaker)
    yield census
    census.close()
    breaker.close()
    client.close()


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    return tmp_path


@pytest.fixture(scope="session")
def raw_client(cluster: MooncakeCluster) -> MooncakeClient:
    """A plain Mooncake client beside kvtag, for injecting faults and for comparisons."""
    return connect(settings_for(cluster))
