"""Opt-in, lookahead decision, and the namespace/mode/probe keys sent at session open."""

from __future__ import annotations

import re
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
    assert KvtagConnector.supports_lookahead_block_hashes is True
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


def test_set_lookahead_block_hashes_is_honoured_and_reopens_the_session(
    make_engine: Callable[..., Engine], store: StoreProcess
) -> None:
    engine = make_engine(store.endpoint, eagle=True, extra={"engine_id": "mode-toggle"})
    connector = engine.connector
    first = connector.client().mode_id
    connector.set_lookahead_block_hashes(False)
    assert connector.lookahead_tokens == 0
    assert connector.client().mode_id == ids.mode_id(keys.mode(B, 0)) != first
    connector.set_lookahead_block_hashes(True)
    assert connector.lookahead_tokens == 1
    assert connector.client().mode_id == first


def test_unsupported_vllm_versions_fail_with_the_version_named() -> None:
    for supported in ("0.32.0", "0.32.1+cpu", "0.33.0", "0.33.1rc1+cpu"):
        assert compat.check_supported(supported) == supported
    for version in ("0.31.2", "0.34.0", "0.34.0rc1+cpu", "1.0.0", "0.3.3"):
        with pytest.raises(compat.UnsupportedVllmVersion, match=re.escape(version)):
            compat.check_supported(version)


@pytest.mark.parametrize("version", ["0.34.0", "0.31.2"])
def test_an_engine_on_an_unsupported_vllm_refuses_to_build_its_connector(
    make_engine: Callable[..., Engine],
    store: StoreProcess,
    monkeypatch: pytest.MonkeyPatch,
    version: str,
) -> None:
    """The installed vLLM reports another version (the fault): the connector, not a request, fails."""
    import vllm

    monkeypatch.setattr(vllm, "__version__", version)
    wanted = r"supports vLLM 0\.32\.x, 0\.33\.x, but vLLM "
    with pytest.raises(compat.UnsupportedVllmVersion, match=wanted + re.escape(version)):
        make_engine(store.endpoint, extra={"engine_id": f"version-{version}"})


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
