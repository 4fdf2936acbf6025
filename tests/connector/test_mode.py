"""Opt-in, lookahead decision, and the namespace/mode/probe keys sent at session open."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from kvtag_client import keys
from kvtag_client.connector import KvtagConnector, compat
from kvtag_client.connector.config import ConnectorConfigError, parse
from kvtag_proto import ids

from tests.store_process import StoreProcess

from .harness import Engine
from .test_hit_length import B


def test_eagle_engine_opens_a_lookahead_session_with_its_namespace_and_probe_keys(
    make_engine: Callable[..., Engine], store: StoreProcess
) -> None:
    engine = make_engine(store.endpoint, eagle=True, extra={"tenant": "team-a", "engine_id": "mode-la"})
    connector = engine.connector
    assert KvtagConnector.supports_lookahead_block_hashes(engine.vc.kv_transfer_config) is True
    assert connector.lookahead_tokens == 1
    ns = connector.namespace_descriptor()
    assert ns.kv_dtype == "float32"
    assert ns.block_size == B
    assert ns.tenant == "team-a"
    assert "g0:FullAttentionSpec:bs16" in ns.kv_layout
    assert ns.parallel_sharding.startswith("tp=1/rank=0,pp=1/rank=0")
    assert ns.weights_fingerprint.startswith("sha256:")
    client = connector.client()
    assert client.state.name == "CONNECTED"
    assert client.mode_id == ids.mode_id(keys.mode(B, 1))
    assert client.namespace_id == ids.namespace_id(ns)
    assert connector.probe_keys() == keys.probe_keys(B, 1)
    census = store.cli("diagnose")
    assert client.mode_id in census and "lookahead" in census


@pytest.mark.parametrize(
    ("eagle", "extra", "expected"),
    [(False, {}, 0), (True, {"lookahead": "off"}, 0), (True, {}, 1)],
    ids=["no-spec-decode", "switched-off", "eagle"],
)
def test_lookahead_is_decided_from_the_speculative_config(
    make_engine: Callable[..., Engine], store: StoreProcess, eagle: bool, extra: dict[str, str], expected: int
) -> None:
    engine = make_engine(store.endpoint, eagle=eagle, extra=extra)
    assert engine.connector.lookahead_tokens == expected
    assert engine.worker_connector.lookahead_tokens == expected
    assert engine.connector.hashing_mode().lookahead_tokens == expected
    # Where the core decides (0.34+), its VllmConfig asked KvtagConnector and hashes with the same L:
    # they agree by construction. Before, the core hashes without lookahead whenever a connector is set.
    core = getattr(engine.vc, "num_hash_lookahead_tokens", 0)
    assert core == (expected if compat.core_decides_lookahead() else 0)


def test_bad_extra_config_names_the_key() -> None:
    assert parse({}).endpoint == "127.0.0.1:50051"
    with pytest.raises(ConnectorConfigError, match="key_scheme"):
        parse({"key_scheme": "md5"})
    with pytest.raises(ConnectorConfigError, match="lookahead"):
        parse({"lookahead": "on"})
    with pytest.raises(ConnectorConfigError, match="rpc_timeout_ms"):
        parse({"rpc_timeout_ms": "soon"})


def test_plugin_registers_the_connector_by_name() -> None:
    from importlib.metadata import entry_points

    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    (entry,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "kvtag"]
    entry.load()()
    cls = KVConnectorFactory.get_connector_class(
        KVTransferConfig(kv_connector="KvtagConnector", kv_role="kv_both")
    )
    assert cls is KvtagConnector
