"""The companion mode (data_path MooncakeStoreConnector), scheduler side: kvtag builds vLLM's own
connector with a cache_prefix naming the namespace and mode, answers vLLM's class-level questions as it
does, admits the mode at start-up, and counts its lookups in the store's census. (Its worker needs a
Mooncake cluster: the e2e suite runs whole engines, tests/e2e/test_bench_serve.py.)"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kvtag_client.connector import KvtagConnector, compat
from kvtag_client.connector.companion import PEER, CompanionConnector, cache_prefix, peer_class
from vllm import SamplingParams
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.request import Request

from tests.net import wait_until
from tests.store_process import StoreProcess

from .harness import Setup, llama_dir
from .test_hit_length import B, fresh_prompt

COMPANION = {"data_path": PEER}


@pytest.fixture
def build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Any]]:
    """build(endpoint, eagle=False, hash_algo="sha256", **extra) -> the scheduler role's connector.

    The peer's own settings stay the peer's: MOONCAKE_CONFIG_PATH names a cluster (none runs here; the
    scheduler side never dials it)."""
    config = tmp_path / "mooncake.json"
    config.write_text(
        json.dumps(
            {
                "metadata_server": "P2PHANDSHAKE",
                "master_server_address": "127.0.0.1:1",
                "protocol": "tcp",
                "device_name": "",
                "mode": "standalone-store",
                "global_segment_size": 0,
                "local_buffer_size": 16 << 20,
            }
        )
    )
    monkeypatch.setenv("MOONCAKE_CONFIG_PATH", str(config))
    built: list[Any] = []

    def factory(endpoint: str, *, eagle: bool = False, hash_algo: str = "sha256", **extra: Any) -> Any:
        model = llama_dir(tmp_path)
        setup = Setup(
            model,
            endpoint,
            eagle_dir=model if eagle else None,
            hash_algo=hash_algo,
            extra={**COMPANION, **extra},
        )
        vc, kvc, _, _ = setup.resolved()
        connector = KvtagConnector(vc, KVConnectorRole.SCHEDULER, kvc)
        connector.vc = vc
        built.append(connector)
        return connector

    yield factory
    for connector in built:
        connector.shutdown()


def test_kvtag_builds_vllms_mooncake_connector_with_the_namespace_and_mode_as_its_cache_prefix(
    build: Callable[..., Any], store: StoreProcess
) -> None:
    connector = build(store.endpoint, eagle=True, engine_id="companion-a")
    assert isinstance(connector, CompanionConnector)
    assert type(connector.inner) is peer_class() and type(connector.inner).__name__ == PEER
    client = connector.client
    assert client is not None and client.state.name == "CONNECTED", "the session is open before any request"
    assert connector.cache_prefix == cache_prefix("", client.namespace_id, client.mode_id)
    inner_extra = connector.inner._vllm_config.kv_transfer_config.kv_connector_extra_config
    assert inner_extra["cache_prefix"] == connector.cache_prefix
    # The mode is the core's: on 0.34 it hashes with lookahead once kvtag (and the peer) opted in.
    core = getattr(connector.vc, "num_hash_lookahead_tokens", 0)
    assert core == (1 if compat.core_decides_lookahead() else 0)
    assert connector.lookahead_tokens == core
    census = store.diagnose()
    engines = [e for ns in census["namespaces"] for m in ns["modes"] for e in m["engines"]]
    ours = [e for e in engines if e.get("engine_id", "").startswith("companion-a")]
    assert ours and ours[0]["labels"]["data_path"] == PEER, ours


def test_class_level_hooks_answer_as_the_peers_for_that_config(
    build: Callable[..., Any], store: StoreProcess
) -> None:
    connector = build(store.endpoint, eagle=True, engine_id="companion-hooks")
    ktc = connector.vc.kv_transfer_config
    if compat.core_decides_lookahead():
        peer = peer_class()
        assert KvtagConnector.supports_lookahead_block_hashes(ktc) is peer.supports_lookahead_block_hashes(
            ktc
        )
        assert KvtagConnector.kv_cache_access(ktc) == peer.kv_cache_access(ktc)
        off = type(ktc)(**{**_fields(ktc), "kv_connector_extra_config": {**COMPANION, "lookahead": "off"}})
        assert KvtagConnector.supports_lookahead_block_hashes(off) is False
    if compat.sleep_hooks_called():
        # The peer's answer, or the peer's refusal (0.34's asks for RDMA): the same either way.
        assert _outcome(KvtagConnector.supports_sleep_mode, ktc) == _outcome(
            peer_class().supports_sleep_mode, ktc
        )
    # Every instance hook is the peer's own.
    assert connector.build_connector_meta == connector.inner.build_connector_meta
    assert connector.request_finished == connector.inner.request_finished
    assert connector.get_finished == connector.inner.get_finished


def test_two_modes_get_two_prefixes_and_a_user_prefix_stays_in_front(
    build: Callable[..., Any], store: StoreProcess
) -> None:
    sha = build(store.endpoint, eagle=True, engine_id="companion-sha")
    cbor = build(store.endpoint, eagle=True, hash_algo="sha256_cbor", engine_id="companion-cbor")
    assert sha.client.namespace_id == cbor.client.namespace_id
    assert sha.client.mode_id != cbor.client.mode_id
    assert sha.cache_prefix != cbor.cache_prefix, "two modes never address each other's objects"
    team = build(store.endpoint, eagle=True, engine_id="companion-team", cache_prefix="team-a")
    assert team.cache_prefix == "team-a." + sha.cache_prefix


def test_strict_refuses_a_second_mode_before_any_request_and_it_runs_without_external_kv(
    build: Callable[..., Any], start_store: Callable[..., StoreProcess], caplog: pytest.LogCaptureFixture
) -> None:
    store = start_store("--policy", "strict")
    first = build(store.endpoint, eagle=True, engine_id="companion-first")
    assert first.client.state.name == "CONNECTED"
    with caplog.at_level(logging.WARNING, logger="kvtag"):
        second = build(store.endpoint, eagle=True, hash_algo="sha256_cbor", engine_id="companion-second")
    assert second.refused and second.client.state.name == "REFUSED"
    errors = [
        r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR and r.name.startswith("kvtag")
    ]
    assert any("hash_algorithm" in m for m in errors), errors  # the refusal's field diff
    assert sum("runs without external KV" in m for m in errors) == 1, errors
    request = Request(
        request_id="r",
        prompt_token_ids=fresh_prompt(3 * B + 2),
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
    )
    assert second.get_num_new_matched_tokens(request, 0) == (0, False), "no lookup reaches the peer"


def test_the_census_counts_a_companions_lookups_and_catches_up_after_an_outage(
    build: Callable[..., Any], start_store: Callable[..., StoreProcess]
) -> None:
    store = start_store()
    connector = build(store.endpoint, eagle=True, engine_id="companion-census")
    client = connector.client
    client.report_usage(lookups=2, hits=3, misses=5)
    assert client.flush_usage()
    store.stop()
    client.report_usage(lookups=1, hits=4, misses=1, stored=6)  # while the store is down: kept, not lost
    assert not client.flush_usage()
    store.start()
    wait_until(lambda: client.flush_usage(), 20, "the census catching up once the store is back")
    modes = [
        m for ns in store.diagnose()["namespaces"] for m in ns["modes"] if m["mode_id"] == client.mode_id
    ]
    counters = modes[0]["counters"] if modes else {}
    assert [int(counters.get(k, -1)) for k in ("hits", "misses", "stored")] == [4, 1, 6], modes


def _fields(ktc: Any) -> dict[str, Any]:
    import dataclasses

    return {f.name: getattr(ktc, f.name) for f in dataclasses.fields(ktc) if f.init}


def _outcome(hook: Callable[[Any], Any], ktc: Any) -> Any:
    try:
        return hook(ktc)
    except Exception as exc:
        return type(exc), str(exc)
