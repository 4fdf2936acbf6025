"""The companion mode (data_path MooncakeStoreConnector), scheduler side: kvtag builds vLLM's own
connector with a cache_prefix naming the namespace and mode, answers vLLM's class-level questions as it
does, admits the mode at start-up, and counts its lookups in the store's census. (Its worker needs a
Mooncake cluster: the e2e suite runs whole engines, tests/e2e/test_bench_serve.py.)"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kvtag_client.connector import KvtagConnector, compat
from kvtag_client.connector.companion import PEER, CompanionConnector, cache_prefix, peer_class
from vllm import SamplingParams
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request

from tests.net import wait_until
from tests.store_process import StoreProcess

from .harness import Setup, _req_index_field, engine_block_hasher, llama_dir
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
    # Control calls only: no shared-memory arena asked for, mapped or prefaulted for this engine.
    assert client.session.data_path_choice == "inline" and client.data_path == "inline"
    assert "peer keeps loading and saving" in client.session.outage_effect
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
    # Every instance hook is the peer's own, but for those the census wraps.
    assert connector.get_finished == connector.inner.get_finished
    assert connector.update_state_after_alloc == connector.inner.update_state_after_alloc


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
    return {f.name: getattr(ktc, f.name) for f in dataclasses.fields(ktc) if f.init}


def _outcome(hook: Callable[[Any], Any], ktc: Any) -> Any:
    try:
        return hook(ktc)
    except Exception as exc:
        return type(exc), str(exc)


# ---- a real Scheduler with a companion connector ------------------------------------------------


class PeerLookups:
    """Answers the peer scheduler's lookups over the peer's own ZMQ protocol with `hit_tokens` (0: an
    empty cluster). It stands in for the peer's worker rank 0, whose LookupKeyServer needs a Mooncake
    cluster; everything on the scheduler side is vLLM's and kvtag's own."""

    def __init__(self, vllm_config: Any, hit_tokens: int = 0) -> None:
        import zmq
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import MooncakeLookupResult
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.protocol import (
            encode_lookup_response,
        )
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker import get_zmq_rpc_path_lookup

        self._answer = encode_lookup_response(MooncakeLookupResult(hit_tokens))
        self._path = get_zmq_rpc_path_lookup(vllm_config)
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.REP)
        self._socket.bind(self._path)
        self._stop = threading.Event()
        self.lookups = 0
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if self._socket.poll(50):
                self._socket.recv_multipart()
                self.lookups += 1
                self._socket.send(self._answer)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._socket.close(linger=0)
        self._context.term()
        Path(self._path.removeprefix("ipc://")).unlink(missing_ok=True)


@dataclasses.dataclass
class CompanionEngine:
    scheduler: Scheduler
    vc: Any
    hash_block_size: int
    peer_lookups: PeerLookups

    @property
    def connector(self) -> Any:
        return self.scheduler.connector

    def add(self, req_id: str, prompt: list[int]) -> Request:
        """A request hashed as EngineCore hashes it (with the core's lookahead where it has one)."""
        init_none_hash(sha256)
        request = Request(
            request_id=req_id,
            prompt_token_ids=prompt,
            sampling_params=SamplingParams(max_tokens=1, ignore_eos=True),
            pooling_params=None,
            block_hasher=engine_block_hasher(self.vc, self.hash_block_size),
        )
        self.scheduler.add_request(request)
        return request

    def step(self) -> Any:
        """One scheduler step, its model output a token for each request past its prompt: the
        connector metadata the step handed the peer's worker."""
        out = self.scheduler.schedule()
        req_ids = list(out.num_scheduled_tokens)
        done = {
            r
            for r in req_ids
            if self.scheduler.requests[r].num_computed_tokens
            >= len(self.scheduler.requests[r].prompt_token_ids or ())
        }
        mro = ModelRunnerOutput(
            req_ids=req_ids,
            **_req_index_field(req_ids),
            sampled_token_ids=[[7] if r in done else [] for r in req_ids],
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=[],
        )
        self.scheduler.update_from_output(out, mro)
        return out.kv_connector_metadata


_PORTS = itertools.count(29_000 + os.getpid() % 1000 * 8)


@pytest.fixture
def companion_engine(tmp_path: Path, build: Callable[..., Any]) -> Iterator[Callable[..., CompanionEngine]]:
    """companion_engine(endpoint, eagle=True, **extra) -> a real vLLM Scheduler whose connector is
    KvtagConnector in the companion mode (`build` sets MOONCAKE_CONFIG_PATH)."""
    engines: list[CompanionEngine] = []

    def factory(endpoint: str, *, eagle: bool = True, **extra: Any) -> CompanionEngine:
        model = llama_dir(tmp_path)
        setup = Setup(
            model,
            endpoint,
            eagle_dir=model if eagle else None,
            extra={**COMPANION, "lookup_rpc_port": next(_PORTS), **extra},
        )
        vc, _, scheduler, _, hash_block_size = setup.scheduler()
        peer_lookups = PeerLookups(vc)
        engine = CompanionEngine(scheduler, vc, hash_block_size, peer_lookups)
        engines.append(engine)
        return engine

    yield factory
    for engine in engines:
        engine.connector.shutdown()
        engine.peer_lookups.close()


def _mode_counters(store: StoreProcess, mode_id: str) -> dict[str, Any]:
    modes = [m for ns in store.diagnose()["namespaces"] for m in ns["modes"] if m["mode_id"] == mode_id]
    assert modes, f"mode {mode_id} is not in the census"
    return dict(modes[0])


def _save_jobs(metadata: Any) -> list[Any]:
    return [job for job in metadata.requests if job.can_save]


def test_the_blocks_the_engine_offers_the_peer_to_save_reach_the_census_as_stored(
    companion_engine: Callable[..., CompanionEngine], start_store: Callable[..., StoreProcess]
) -> None:
    store = start_store()
    engine = companion_engine(store.endpoint, engine_id="companion-stored")
    engine.add("r1", fresh_prompt(3 * B + 2))
    metadata = engine.step()
    assert type(metadata).__name__ == "MooncakeStoreConnectorMetadata"
    [job] = _save_jobs(metadata)
    assert job.token_len_chunk == 3 * B, "the peer offers the prompt's full blocks"
    engine.add("r2", fresh_prompt(2 * B + 2))
    [job] = _save_jobs(engine.step())  # r1 finishes; r2's 2 full blocks are offered
    assert (job.req_id, job.token_len_chunk) == ("r2", 2 * B)
    assert engine.peer_lookups.lookups == 2
    client = engine.connector.client
    assert client.flush_usage()
    counters = _mode_counters(store, client.mode_id)["counters"]
    offered = 3 + 2
    assert int(counters.get("stored", 0)) == offered, counters
    # A lookup asks about the full blocks before the last token: (3B+2-1)//B and (2B+2-1)//B.
    assert int(counters.get("misses", 0)) == 3 + 2, counters


def test_a_companions_misses_of_blocks_another_mode_stored_count_as_cross_mode_misses(
    companion_engine: Callable[..., CompanionEngine],
    start_store: Callable[..., StoreProcess],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Engines of two vLLM versions (the same legacy block hashes, two modes) share a namespace: the
    newer one misses what the older one offered its peer, under the older one's prefix."""
    store = start_store()
    older = companion_engine(store.endpoint, engine_id="companion-older")
    with monkeypatch.context() as patch:
        patch.setattr(compat, "vllm_version", lambda: "99.0.0")
        newer = companion_engine(store.endpoint, engine_id="companion-newer")
    a, b = older.connector.client, newer.connector.client
    assert a.namespace_id == b.namespace_id and a.mode_id != b.mode_id
    assert older.connector.cache_prefix != newer.connector.cache_prefix
    prompt = fresh_prompt(4 * B + 2)
    older.add("stored", prompt)
    older.step()
    assert a.flush_usage()
    newer.add("missed", prompt)
    newer.step()
    assert b.flush_usage()
    mine = _mode_counters(store, b.mode_id)
    assert int(mine["counters"].get("misses", 0)) == 4
    assert int(mine["counters"].get("cross_mode_misses", 0)) == 4, mine
    assert [(x["held_by_mode_id"], int(x["count"])) for x in mine["cross_mode_misses"]] == [(a.mode_id, 4)]
    # The older engine's own miss of a cold prompt is no cross-mode miss.
    older.add("cold", fresh_prompt(2 * B + 2))
    older.step()
    assert a.flush_usage()
    assert int(_mode_counters(store, a.mode_id)["counters"].get("cross_mode_misses", 0)) == 0


@pytest.mark.skipif(not compat.core_decides_lookahead(), reason="the core hashes with lookahead from 0.34")
def test_lookahead_on_and_off_companions_see_each_others_blocks_as_cross_mode_misses(
    companion_engine: Callable[..., CompanionEngine], start_store: Callable[..., StoreProcess]
) -> None:
    """On 0.34 the core's block hashes are lookahead hashes when the peer opts in; the base keys are
    the legacy hashes either way, so the lookahead engine's miss is found under the legacy engine's."""
    store = start_store()
    legacy = companion_engine(store.endpoint, engine_id="companion-l0", lookahead="off")
    ahead = companion_engine(store.endpoint, engine_id="companion-l1")
    assert legacy.connector.lookahead_tokens == 0 and ahead.connector.lookahead_tokens == 1
    prompt = fresh_prompt(4 * B + 2)
    legacy.add("stored", prompt)
    legacy.step()
    assert legacy.connector.client.flush_usage()
    ahead.add("missed", prompt)
    ahead.step()
    client = ahead.connector.client
    assert client.flush_usage()
    mine = _mode_counters(store, client.mode_id)
    held = [(x["held_by_mode_id"], int(x["count"])) for x in mine["cross_mode_misses"]]
    assert held == [(legacy.connector.client.mode_id, 4)], mine


def test_a_refused_engine_hands_the_peer_no_load_and_no_save(
    companion_engine: Callable[..., CompanionEngine],
    start_store: Callable[..., StoreProcess],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store = start_store("--policy", "strict")
    first = companion_engine(store.endpoint, engine_id="companion-admitted")
    with monkeypatch.context() as patch:
        patch.setattr(compat, "vllm_version", lambda: "99.0.0")  # a second mode in the namespace
        refused = companion_engine(store.endpoint, engine_id="companion-refused")
    assert refused.connector.refused and not first.connector.refused
    refused.add("r", fresh_prompt(3 * B + 2))
    metadata = refused.step()
    assert type(metadata) is type(first.step()), "the peer's worker still gets the peer's metadata type"
    assert metadata.requests == [] and not metadata.unfinished_request_ids
    assert refused.peer_lookups.lookups == 0, "no lookup reached the peer"
    assert not refused.connector.has_pending_push_work()
    # Prefilled and sampled in one step, finished, and freed at once (no free delayed for a save).
    assert "r" not in refused.scheduler.requests
    assert refused.step().requests == []  # the next step's metadata: still nothing for the peer
    assert refused.connector.inner.connector_scheduler._unfinished_requests == {}
    # Control: the admitted engine's peer does get save work for the same prompt.
    first.add("r", fresh_prompt(3 * B + 2))
    assert _save_jobs(first.step())


def test_the_peers_transfer_stats_are_forwarded_and_rebuilt_as_the_peers(
    build: Callable[..., Any], store: StoreProcess
) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.metrics import (
        MooncakeStoreConnectorStats,
    )

    connector = build(store.endpoint, eagle=True, engine_id="companion-stats")
    # The scheduler role's peer has no worker, and says so: the companion answers as it does.
    assert connector.get_kv_connector_stats() is connector.inner.get_kv_connector_stats() is None
    record = {"duration_seconds": 0.002, "num_keys": 3, "num_bytes": 3 << 20, "num_failed_keys": 0}
    data = {"save_put": [dict(record, status="ok")]}
    rebuilt = KvtagConnector.build_kv_connector_stats(data)
    assert isinstance(rebuilt, MooncakeStoreConnectorStats)
    assert rebuilt.reduce()["save_put_total_keys"] == 3
    # kvtag's own counters still rebuild as kvtag's.
    assert type(KvtagConnector.build_kv_connector_stats({"lookups": 2})).__name__ == "KvtagStats"
    # vLLM's KVConnectorLogging, built from the engine's config, logs the peer's figures.
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging

    logging_ = KVConnectorLogging(connector.vc.kv_transfer_config)
    logging_.observe(data)
    logged: list[str] = []
    logging_.log(lambda fmt, *args: logged.append(fmt % args))
    assert any("save_put_total_keys" in line for line in logged), logged


def test_a_companions_prometheus_metrics_are_the_peers(
    build: Callable[..., Any], store: StoreProcess
) -> None:
    """vLLM builds the connector's Prometheus metrics from the engine's config and feeds them the
    stats data: for a companion, the peer's metrics read the peer's data."""
    import prometheus_client

    registry = prometheus_client.CollectorRegistry()

    def on(kind: Any) -> Any:
        return lambda **kwargs: kind(registry=registry, **kwargs)

    connector = build(store.endpoint, eagle=True, engine_id="companion-prom")
    metric_types = {
        prometheus_client.Gauge: on(prometheus_client.Gauge),
        prometheus_client.Counter: on(prometheus_client.Counter),
        prometheus_client.Histogram: on(prometheus_client.Histogram),
    }
    metrics = KvtagConnector.build_prom_metrics(connector.vc, metric_types, ["engine"], {0: ["0"]})
    assert type(metrics).__name__ == "MooncakeStorePromMetrics"
    record = {"duration_seconds": 0.002, "num_keys": 3, "num_bytes": 3 << 20, "num_failed_keys": 0}
    metrics.observe({"save_put": [dict(record, status="ok")]}, 0)
    keys = registry.get_sample_value(
        "vllm:mooncake_store_operation_keys_total", {"engine": "0", "operation": "save_put", "status": "ok"}
    )
    assert keys == 3
