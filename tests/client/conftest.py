"""Fixtures: real kvtag-store subprocesses on free loopback ports, and clients built against them."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from kvtag_client import keys
from kvtag_client.store import StoreClient

from tests.descriptors import namespace
from tests.store_process import StoreProcess, store_starter

StoreFactory = Callable[..., StoreProcess]


@pytest.fixture
def start_store(tmp_path: Path) -> Iterator[StoreFactory]:
    """start_store(*extra_serve_args, port=None) -> a started StoreProcess, stopped at teardown."""
    with store_starter(tmp_path) as start:
        yield start


@pytest.fixture(scope="module")
def shared_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StoreProcess]:
    """One isolate-policy store for the tests that do not fault it."""
    with StoreProcess(tmp_path_factory.mktemp("store") / "store.log") as store:
        yield store


ClientFactory = Callable[..., StoreClient]


@pytest.fixture
def make_client() -> Iterator[ClientFactory]:
    """make_client(endpoint, lookahead_tokens=0, tenant="", **kwargs) -> a canonical-scheme StoreClient."""
    clients: list[StoreClient] = []

    def factory(endpoint: str, lookahead_tokens: int = 0, tenant: str = "", **kwargs: object) -> StoreClient:
        # Generous by default: the machine is shared, and only the fault tests are about deadlines.
        options: dict[str, object] = {
            "rpc_timeout_s": 5.0,
            "reconnect_interval_s": 0.3,
            "probe_keys": keys.probe_keys(16, lookahead_tokens),
        }
        options.update(kwargs)
        client = StoreClient(
            endpoint,
            engine_id=f"engine-{len(clients)}",
            namespace=namespace(tenant=tenant),
            mode=keys.mode(16, lookahead_tokens),
            labels={"test": "client"},
            **options,  # type: ignore[arg-type]
        )
        clients.append(client)
        return client

    yield factory
    for client in clients:
        client.close()
