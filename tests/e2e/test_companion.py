"""The companion mode (data_path MooncakeStoreConnector) on real vLLM CPU engines over a real Mooncake
cluster (master + storage process) and real kvtag-store processes (issue 39).

vLLM's own MooncakeStoreConnector moves the bytes under kvtag's `cache_prefix` (namespace and mode id);
the kvtag store admits modes and keeps the census. Everything runs in one private network namespace
(netns.py): Mooncake's transfer engine listens on every interface. One cluster and one isolate store
serve the module; strict admission and the outage get a store of their own. All hit figures are vLLM's
own counters (engine_runner.py); every engine's greedy tokens are compared with a cold run's.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.net import free_port, wait_until
from tests.store_process import REPO, StoreProcess

from .harness import EngineRun, prompt
from .netns import private_netns

# The serving benchmark's Mooncake cluster (master + storage process, and the peer's MOONCAKE_CONFIG_PATH),
# imported as bench_serve.py imports it.
sys.path.insert(0, str(REPO / "benchmarks"))
from serve.cluster import Cluster, _master_metrics

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

BLOCK = 32
MAX_TOKENS = 8
PROMPTS = [prompt(71, 3 * BLOCK), prompt(72, 4 * BLOCK + 9), prompt(73, 2 * BLOCK + 20)]
# Test 4's own prompts (every other test's engines of the default mode store PROMPTS in the cluster,
# whichever kvtag store they report to), and those its first engine runs after the store was killed.
OUTAGE_PROMPTS = [prompt(75, 3 * BLOCK + 1), prompt(76, 4 * BLOCK + 30)]
AFTER_KILL = [prompt(74, 3 * BLOCK + 5)]
# Test 3's own prompts, for the same reason.
STRICT_PROMPTS = [prompt(77, 3 * BLOCK + 3), prompt(78, 2 * BLOCK + 7)]
SEGMENT_BYTES = 128 << 20
PEER = "MooncakeStoreConnector"
# The default hash (sha256) seeds its chain with a fixed value unless PYTHONHASHSEED is set: "0" and "1"
# give two hashing modes that differ in the seed fingerprint alone.
SEED, OTHER_SEED = "0", "1"


def asked_blocks(prompt_ids: list[int]) -> int:
    """Full blocks a fresh engine looks up for a prompt (the last token is always computed)."""
    return (len(prompt_ids) - 1) // BLOCK


@dataclass
class Site:
    """The module's cluster, its isolate store, and the engines it has run (by name)."""

    work: Path
    cluster: Cluster
    store: StoreProcess
    models: dict[str, Path]
    cold: dict[str, Any] = field(default_factory=dict)
    cache: dict[str, Any] = field(default_factory=dict)
    lookup_port: int = 21000

    def job(
        self, endpoint: str | None, engine_id: str, steps: list[dict[str, Any]], *, eagle: bool = False
    ) -> dict[str, Any]:
        job: dict[str, Any] = {"model": str(self.models["llama"]), "block_size": BLOCK, "steps": steps}
        if endpoint is not None:
            self.lookup_port += 1
            job["kv_transfer_config"] = {
                "kv_connector": "KvtagConnector",
                "kv_connector_module_path": "kvtag_client.connector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {
                    "data_path": PEER,
                    "lookup_rpc_port": self.lookup_port,
                    "endpoint": endpoint,
                    "engine_id": engine_id,
                    "reconnect_interval_ms": 500,
                },
            }
        if eagle:
            job["speculative_config"] = {
                "method": "eagle",
                "model": str(self.models["eagle"]),
                "num_speculative_tokens": 2,
            }
        return job

    def bare_peer_job(self, steps: list[dict[str, Any]], *, eagle: bool = False) -> dict[str, Any]:
        """The same engine with vLLM's MooncakeStoreConnector alone (its default cache_prefix)."""
        job = self.job("unused", "unused", steps, eagle=eagle)
        job["kv_transfer_config"] = {
            "kv_connector": PEER,
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"lookup_rpc_port": self.lookup_port},
        }
        return job

    def engine(self, name: str, job: dict[str, Any], seed: str = SEED) -> EngineRun:
        config = self.cluster.peer_config(self.work / f"mooncake-{name}.json")
        env = {
            "MOONCAKE_CONFIG_PATH": str(config),
            "PYTHONHASHSEED": seed,
            "VLLM_HOST_IP": "127.0.0.1",  # loopback is the namespace's only interface
            "GLOG_minloglevel": "2",
        }
        return EngineRun(job, self.work, name, env=env).start()

    def barrier(self, name: str) -> str:
        return str(self.work / f"{name}.barrier")


def release(barrier: str) -> None:
    Path(barrier).write_text("go")


def finish(run: EngineRun) -> dict[str, Any]:
    try:
        result = run.result()
    finally:
        run.kill()
    result["log"] = run.log_text()
    return result


def requests(result: dict[str, Any], step: int = 0) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = result["steps"][step]["requests"]
    return out


def assert_served_like_cold(result: dict[str, Any], cold: list[dict[str, Any]], step: int = 0) -> None:
    """Every request finished normally with the cold run's greedy tokens."""
    for index, (c, r) in enumerate(zip(cold, requests(result, step), strict=True)):
        assert r["finish_reason"] == "length" and len(r["token_ids"]) == MAX_TOKENS, (index, r)
        assert r["token_ids"] == c["token_ids"], f"prompt {index}: greedy output changed: {c} {r}"


def census_mode(store: StoreProcess, engine_id: str) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """(namespace, mode) of the diagnose report where an engine with this engine_id has a session."""
    for ns in store.diagnose()["namespaces"]:
        for mode in ns["modes"]:
            if any(e.get("engine_id", "").startswith(engine_id + "/") for e in mode.get("engines", [])):
                return ns, mode
    return None


def mode_of(store: StoreProcess, mode_id: str) -> dict[str, Any] | None:
    for ns in store.diagnose()["namespaces"]:
        for mode in ns["modes"]:
            if mode["mode_id"] == mode_id:
                return dict(mode)
    return None


def counters(mode: dict[str, Any] | None) -> dict[str, int]:
    raw = (mode or {}).get("counters", {})
    return {key: int(value) for key, value in raw.items()}


def prefix_ids(log: str) -> tuple[str, str]:
    """(namespace_id, mode_id) from the connector's `cache_prefix kvtag-<namespace>-<mode>` line."""
    found = re.search(r"cache_prefix kvtag-(ns-[0-9a-f]+)-(m-[0-9a-f]+), lookahead", log)
    assert found, "the companion did not log its cache_prefix"
    return found.group(1), found.group(2)


@pytest.fixture(scope="module")
def site(models: dict[str, Path], work_dir: Path) -> Iterator[Site]:
    if importlib.util.find_spec("mooncake") is None:
        pytest.fail(
            "the Mooncake wheel is not in the vLLM env (the peer imports it): make .stamps/bench-serve"
        )
    if not (REPO / ".venv" / "bin" / "mooncake_master").exists():
        pytest.fail("the Mooncake wheel is not installed in .venv: run scripts/install_mooncake.sh")
    with private_netns():
        cluster = Cluster(work_dir, SEGMENT_BYTES)
        store = StoreProcess(work_dir / "store-isolate.log", process_group=True)
        try:
            cluster.start()
            store.start()
            s = Site(work_dir, cluster, store, models)
            # The cold run: the same model and prompts, no connector.
            cold = finish(
                s.engine(
                    "cold",
                    s.job(
                        None, "cold", [{"prompts": PROMPTS + STRICT_PROMPTS + OUTAGE_PROMPTS + AFTER_KILL}]
                    ),
                )
            )
            s.cold = {"requests": requests(cold)}
            yield s
        finally:
            store.stop()
            cluster.stop()


def cold_requests(site: Site, prompts: list[list[int]]) -> list[dict[str, Any]]:
    every = PROMPTS + STRICT_PROMPTS + OUTAGE_PROMPTS + AFTER_KILL
    return [site.cold["requests"][every.index(p)] for p in prompts]


def isolate_runs(site: Site) -> dict[str, Any]:
    """Tests 1 and 2 on the isolate store: an EAGLE producer, a spec-off consumer of its mode (held open
    after its requests), then a spec-off engine whose PYTHONHASHSEED differs, while the consumer is live."""
    if "isolate" in site.cache:
        return dict(site.cache["isolate"])
    endpoint = site.store.endpoint
    keys_before = _keys(site)
    producer = finish(
        site.engine("producer", site.job(endpoint, "producer", [{"prompts": PROMPTS}], eagle=True))
    )
    keys_after_producer = _keys(site)
    held = site.barrier("consumer-held")
    consumer_run = site.engine(
        "consumer",
        site.job(endpoint, "consumer", [{"prompts": PROMPTS}, {"prompts": [], "wait_for": held}]),
    )
    try:
        consumer_run.wait_ready(held)
        other = finish(
            site.engine(
                "other-seed", site.job(endpoint, "other-seed", [{"prompts": PROMPTS}]), seed=OTHER_SEED
            )
        )
        release(held)
        consumer = finish(consumer_run)
    finally:
        consumer_run.kill()
    site.cache["isolate"] = {
        "producer": producer,
        "consumer": consumer,
        "other": other,
        "keys": (keys_before, keys_after_producer),
        "diagnose": site.store.diagnose(),
    }
    return dict(site.cache["isolate"])


def _keys(site: Site) -> int:
    """Objects the Mooncake master holds."""
    return int(_master_metrics(site.cluster.metrics).get("master_key_count", 0))


# -- 1. An EAGLE producer and a spec-off consumer ---------------------------------------------------


def test_a_spec_off_consumer_of_an_eagle_producer_never_reads_its_blocks_and_its_misses_are_counted(
    site: Site,
) -> None:
    runs = isolate_runs(site)
    producer, consumer = runs["producer"], runs["consumer"]
    before, after = runs["keys"]
    assert after > before, f"the EAGLE producer stored no object in the cluster ({before} -> {after})"
    for r in requests(producer):
        assert r["finish_reason"] == "length" and len(r["token_ids"]) == MAX_TOKENS, r
    # The bare peer fails every request here ("Buffer too small": an EAGLE block also holds the
    # drafter's layer); the companion's consumer addresses its own layout's objects only.
    assert "Buffer too small" not in consumer["log"]
    assert consumer["counters"]["external_hit"] == 0, consumer["counters"]
    assert consumer["counters"]["external_queries"] > 0, "the consumer never asked the peer"
    assert_served_like_cold(consumer, cold_requests(site, PROMPTS))
    # Two namespaces (the drafter's layer is in the producer's KV layout), each with its own prefix.
    assert prefix_ids(producer["log"])[0] != prefix_ids(consumer["log"])[0]
    # The consumer's misses, in the census of its own namespace and mode.
    _, mode_id = prefix_ids(consumer["log"])
    mode = next(
        (m for ns in runs["diagnose"]["namespaces"] for m in ns["modes"] if m["mode_id"] == mode_id), None
    )
    assert mode is not None, runs["diagnose"]
    got = counters(mode)
    expected = sum(asked_blocks(p) for p in PROMPTS)
    assert (got.get("hits", 0), got.get("misses", 0)) == (0, expected), mode
    engines = [e for e in mode.get("engines", []) if e["engine_id"].startswith("consumer/")]
    assert engines and all(e["labels"].get("data_path") == PEER for e in engines), mode


def test_control_the_bare_peer_fails_that_consumer(site: Site) -> None:
    """Without kvtag the same two engines share one prefix: the spec-off consumer reads the EAGLE
    producer's blocks, which are larger than its own (the drafter's layer), and its loads fail."""
    finish(site.engine("bare-producer", site.bare_peer_job([{"prompts": PROMPTS}], eagle=True)))
    consumer = finish(site.engine("bare-consumer", site.bare_peer_job([{"prompts": PROMPTS}])))
    assert "Buffer too small" in consumer["log"]
    assert [r["finish_reason"] for r in requests(consumer)] == ["error"] * len(PROMPTS), requests(consumer)


def test_a_spec_off_consumer_is_told_the_eagle_producers_layout_and_the_field_that_differs(
    site: Site,
) -> None:
    runs = isolate_runs(site)
    producer_ns, _ = prefix_ids(runs["producer"]["log"])
    warnings = [
        line
        for line in runs["consumer"]["log"].splitlines()
        if "LAYOUT_SPLIT" in line or "MODE_SPLIT" in line
    ]
    assert any(producer_ns in line and "kv_layout" in line for line in warnings), warnings


# -- 2. A PYTHONHASHSEED mismatch ------------------------------------------------------------------


def test_engines_whose_hash_seed_differs_are_separated_and_the_second_is_told(site: Site) -> None:
    runs = isolate_runs(site)
    consumer, other = runs["consumer"], runs["other"]
    consumer_ns, consumer_mode = prefix_ids(consumer["log"])
    other_ns, other_mode = prefix_ids(other["log"])
    assert (other_ns, other_mode != consumer_mode) == (consumer_ns, True), "one namespace, two modes"
    assert other["counters"]["external_hit"] == 0, other["counters"]
    assert other["counters"]["external_queries"] > 0
    assert_served_like_cold(other, cold_requests(site, PROMPTS))
    # Told at start-up: the consumer was live in the other mode when this engine opened its session.
    split = [line for line in other["log"].splitlines() if "census warning MODE_SPLIT" in line]
    assert any(consumer_mode in line and "seed_fingerprint" in line for line in split), split
    modes = next(ns["modes"] for ns in runs["diagnose"]["namespaces"] if ns["namespace_id"] == consumer_ns)
    assert {consumer_mode, other_mode} <= {m["mode_id"] for m in modes}, modes
    expected = sum(asked_blocks(p) for p in PROMPTS)
    assert counters(next(m for m in modes if m["mode_id"] == other_mode)).get("misses") == expected, modes


# -- 3. strict -----------------------------------------------------------------------------------


def test_strict_refuses_the_second_mode_before_any_request_and_the_engine_still_serves(site: Site) -> None:
    store = StoreProcess(site.work / "store-strict.log", "--policy", "strict", process_group=True)
    store.start()
    try:
        first = finish(
            site.engine(
                "strict-first", site.job(store.endpoint, "strict-first", [{"prompts": STRICT_PROMPTS}])
            )
        )
        held = site.barrier("strict-second-built")
        second_run = site.engine(
            "strict-second",
            site.job(
                store.endpoint,
                "strict-second",
                [{"prompts": [], "wait_for": held}, {"prompts": STRICT_PROMPTS}],
            ),
            seed=OTHER_SEED,
        )
        try:
            second_run.wait_ready(held)
            # The engine is built and has served nothing yet: the refusal is already in its log.
            before_any_request = second_run.log_text()
            release(held)
            second = finish(second_run)
        finally:
            second_run.kill()
        report = store.diagnose()
    finally:
        store.stop()
    refusals = [line for line in before_any_request.splitlines() if "strict on mode" in line]
    first_mode = prefix_ids(first["log"])[1]
    assert any(first_mode in line and "seed_fingerprint" in line for line in refusals), refusals
    assert before_any_request.count("runs without external KV") == 1
    assert second["counters"]["external_hit"] == 0, second["counters"]
    assert_served_like_cold(second, cold_requests(site, STRICT_PROMPTS), step=1)
    namespace = next(ns for ns in report["namespaces"] if ns["namespace_id"] == prefix_ids(first["log"])[0])
    refused = [r["engine_id"] for r in namespace.get("refused", [])]
    assert any(e.startswith("strict-second/") for e in refused), namespace


# -- 4. The kvtag store down at start, then killed mid-run ---------------------------------------------


def test_the_peer_serves_while_the_store_is_down_or_killed_and_the_census_catches_up(site: Site) -> None:
    store = StoreProcess(site.work / "store-outage.log", port=free_port(), process_group=True)
    expected_hits = [asked_blocks(p) * BLOCK for p in OUTAGE_PROMPTS]
    try:
        # The first engine starts with the store down and stores through the peer.
        came_back = site.barrier("outage-first-store-back")
        first_run = site.engine(
            "outage-first",
            site.job(
                store.endpoint,
                "outage-first",
                [{"prompts": OUTAGE_PROMPTS}, {"prompts": AFTER_KILL, "wait_for": came_back}],
            ),
        )
        try:
            first_run.wait_ready(came_back)
            # The store returns: the session reopens and the counts taken while it was down arrive.
            store.start()
            wait_until(
                lambda: (
                    counters(census_mode_or_none(store, "outage-first")).get("misses", 0)
                    == sum(asked_blocks(p) for p in OUTAGE_PROMPTS)
                ),
                30,
                "the first engine's misses in the census once the store is back",
                interval_s=1.0,
            )
            # Killed mid-run: the engine notices (its next heartbeat fails), and its next requests go
            # through the peer alone.
            store.kill()
            wait_until(
                lambda: first_run.log_text().count("is not answering") == 2,
                30,
                "the first engine to notice the store was killed",
                interval_s=0.5,
            )
            release(came_back)
            first = finish(first_run)
        finally:
            first_run.kill()
        assert_served_like_cold(first, cold_requests(site, OUTAGE_PROMPTS))
        assert_served_like_cold(first, cold_requests(site, AFTER_KILL), step=1)

        # A second engine of the same mode, the store down again: it hits what the first stored.
        back_again = site.barrier("outage-second-store-back")
        second_run = site.engine(
            "outage-second",
            site.job(
                store.endpoint,
                "outage-second",
                [{"prompts": OUTAGE_PROMPTS}, {"prompts": [], "wait_for": back_again}],
            ),
        )
        try:
            second_run.wait_ready(back_again)
            assert prefix_ids(second_run.log_text()) == prefix_ids(first["log"]), "one mode, one prefix"
            store.start()
            wait_until(
                lambda: (
                    counters(census_mode_or_none(store, "outage-second")).get("hits", 0)
                    == sum(expected_hits) // BLOCK
                ),
                30,
                "the second engine's hits in the census after the restart",
                interval_s=1.0,
            )
            report = census_mode_or_none(store, "outage-second")
            release(back_again)
            second = finish(second_run)
        finally:
            second_run.kill()
    finally:
        store.stop()
    assert [r["external_hit"] for r in requests(second)] == expected_hits, requests(second)
    assert_served_like_cold(second, cold_requests(site, OUTAGE_PROMPTS))
    assert "is not answering" in second["log"], "the outage was not logged"
    got = counters(report)
    assert (got.get("hits"), got.get("misses")) == (sum(expected_hits) // BLOCK, 0), report


def census_mode_or_none(store: StoreProcess, engine_id: str) -> dict[str, Any] | None:
    found = census_mode(store, engine_id)
    return found[1] if found is not None else None
