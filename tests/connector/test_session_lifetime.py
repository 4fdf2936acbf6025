"""A connector's store sessions live as long as its engine: each role opens its session when the engine
starts, so refusals and mode splits show before any request (a store that is down or stalled never
fails or holds up the start), and a process that exits without shutting its connectors down still
ends its sessions."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from vllm.v1.request import RequestStatus

from tests.net import free_port
from tests.store_process import StoreProcess

from .harness import Engine
from .test_hit_length import B, fresh_prompt

FAST = {"rpc_timeout_ms": 300, "reconnect_interval_ms": 200}
ROOT = Path(__file__).resolve().parents[2]


def sessions(store: StoreProcess, engine: str) -> dict[str, list[dict[str, Any]]]:
    """diagnose's view of one engine's sessions: {"live": [...], "refused": [...]} by engine id."""
    found: dict[str, list[dict[str, Any]]] = {"live": [], "refused": []}
    for namespace in store.diagnose().get("namespaces", []):
        for mode in namespace.get("modes", []):
            found["live"] += [e for e in mode.get("engines", []) if e["engine_id"].startswith(engine + "/")]
        found["refused"] += [
            r for r in namespace.get("refused", []) if r["engine_id"].startswith(engine + "/")
        ]
    return found


def assert_no_request_seen(engine: Engine) -> None:
    assert not engine.scheduler.requests
    assert engine.connector.stats.totals["lookups"] == 0


def test_strict_refusal_is_logged_and_diagnosed_when_the_engine_starts(
    make_engine: Callable[..., Engine],
    start_store: Callable[..., StoreProcess],
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = start_store("--policy", "strict")
    make_engine(store.endpoint, eagle=True, extra={"engine_id": "start-la"})
    with caplog.at_level(logging.WARNING):
        late = make_engine(
            store.endpoint, eagle=True, extra={"engine_id": "start-legacy", "lookahead": "off"}
        )
    assert_no_request_seen(late)
    refusals = [r.getMessage() for r in caplog.records if "refused engine 'start-legacy/" in r.getMessage()]
    assert len(refusals) == 2, f"one refusal per role, logged at start: {caplog.text}"
    assert all("lookahead_tokens: store has '1', this engine has '0'" in text for text in refusals)

    seen = sessions(store, "start-legacy")
    assert sorted(r["engine_id"] for r in seen["refused"]) == [
        "start-legacy/scheduler",
        "start-legacy/worker",
    ]
    assert seen["live"] == []
    diffs = {d["field"] for r in seen["refused"] for d in r.get("refusal", {}).get("diffs", [])}
    assert diffs == {"lookahead_tokens"}
    # Refused at start, it still serves: every lookup misses, nothing is saved.
    request = late.add("r", fresh_prompt(3 * B), max_tokens=2)
    late.run()
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert late.connector.stats.totals["hit_tokens"] == 0


def test_isolate_mode_split_is_warned_and_both_roles_are_listed_when_the_engine_starts(
    make_engine: Callable[..., Engine],
    start_store: Callable[..., StoreProcess],
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = start_store()
    make_engine(store.endpoint, eagle=True, extra={"engine_id": "split-la"})
    with caplog.at_level(logging.WARNING):
        late = make_engine(
            store.endpoint, eagle=True, extra={"engine_id": "split-legacy", "lookahead": "off"}
        )
    assert_no_request_seen(late)
    warnings = [r.getMessage() for r in caplog.records if "census warning MODE_SPLIT" in r.getMessage()]
    assert warnings, f"no MODE_SPLIT warning at start: {caplog.text}"
    seen = sessions(store, "split-legacy")
    assert sorted((e["engine_id"], e["live"]) for e in seen["live"]) == [
        ("split-legacy/scheduler", True),
        ("split-legacy/worker", True),
    ]
    assert seen["refused"] == []


def test_an_unreachable_store_is_logged_and_the_engine_starts_degraded_and_serves(
    make_engine: Callable[..., Engine], caplog: pytest.LogCaptureFixture
) -> None:
    endpoint = f"127.0.0.1:{free_port()}"  # nothing listens there
    with caplog.at_level(logging.WARNING):
        engine = make_engine(endpoint, extra={**FAST, "engine_id": "start-nostore"})
    assert engine.connector.client().state.name == "DEGRADED"
    assert engine.worker_connector.client().state.name == "DEGRADED"
    assert f"kvtag store {endpoint} is not answering" in caplog.text
    request = engine.add("r", fresh_prompt(2 * B + 1), max_tokens=2)
    engine.run()
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_a_stalled_store_holds_each_role_up_for_at_most_its_rpc_timeout_then_reconnects(
    make_engine: Callable[..., Engine], start_store: Callable[..., StoreProcess]
) -> None:
    store = start_store()
    store.pause()  # SIGSTOP: connections are accepted by the kernel, nothing answers
    try:
        started = time.monotonic()
        engine = make_engine(store.endpoint, extra={**FAST, "engine_id": "start-stalled"})
        took = time.monotonic() - started
        assert engine.connector.client().state.name == "DEGRADED"
        assert engine.worker_connector.client().state.name == "DEGRADED"
        # Two roles, each waiting at most rpc_timeout_ms (0.3 s) for its session, plus the build.
        assert took < 3.0, f"engine start against a stalled store took {took:.2f} s"
    finally:
        store.resume()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and sessions(store, "start-stalled")["live"] == []:
        time.sleep(0.2)
    assert sorted(e["engine_id"] for e in sessions(store, "start-stalled")["live"]) == [
        "start-stalled/scheduler",
        "start-stalled/worker",
    ], "both roles open their sessions in the background once the store answers"


def test_a_process_that_exits_without_shutting_its_engine_down_ends_both_sessions(
    models: dict[str, Path], start_store: Callable[..., StoreProcess]
) -> None:
    """Like an offline `LLM` script that ends without shutting vLLM down: nothing calls shutdown()."""
    store = start_store()
    script = (
        "import sys\n"
        "from pathlib import Path\n"
        "from tests.connector.harness import Setup\n"
        "engine = Setup(Path(sys.argv[1]), sys.argv[2], extra={'engine_id': 'exit-engine'}).build()\n"
        "print(engine.connector.client().state.name, engine.worker_connector.client().state.name)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(models["llama"]), store.endpoint],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["CONNECTED", "CONNECTED"]
    seen = sessions(store, "exit-engine")["live"]
    assert sorted((e["engine_id"], e["live"]) for e in seen) == [
        ("exit-engine/scheduler", False),
        ("exit-engine/worker", False),
    ], "the sessions end with the process, not after the store's session TTL"
