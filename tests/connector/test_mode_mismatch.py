"""Two engine configs on one service, under `strict` and `isolate`, end to end."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from vllm.v1.request import RequestStatus

from tests.store_process import StoreProcess

from .harness import Engine
from .hash_seed_engine import serve_once
from .test_hit_length import B, fresh_prompt

ROOT = Path(__file__).resolve().parents[2]


def test_strict_refuses_the_legacy_engine_with_the_field_diff_and_it_runs_without_the_store(
    make_engine: Callable[..., Engine],
    start_store: Callable[..., StoreProcess],
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = start_store("--policy", "strict")
    first = make_engine(store.endpoint, eagle=True, extra={"engine_id": "strict-la"})
    assert first.connector.client().state.name == "CONNECTED"
    with caplog.at_level(logging.WARNING):
        second = make_engine(
            store.endpoint, eagle=True, extra={"engine_id": "strict-legacy", "lookahead": "off"}
        )
        client = second.connector.client()
    assert client.state.name == "REFUSED"
    assert client.refusal is not None
    diff = {d.field: (d.established, d.requested) for d in client.refusal.diffs}
    assert diff == {"lookahead_tokens": ("1", "0")}
    assert "lookahead_tokens" in caplog.text, "the refusal is logged with the field diff"
    request = second.add("r", fresh_prompt(3 * B), max_tokens=2)
    second.run()
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert second.connector.stats.totals["hit_tokens"] == 0
    second.drain_saves()
    assert second.worker_connector.stats.totals["saved_blocks"] == 0


def test_isolate_never_serves_cross_mode_bytes_and_diagnose_shows_the_split(
    make_engine: Callable[..., Engine], start_store: Callable[..., StoreProcess]
) -> None:
    store = start_store()
    lookahead = make_engine(store.endpoint, eagle=True, extra={"engine_id": "iso-la"})
    prompt = fresh_prompt(3 * B + 5)
    lookahead.add("a", prompt, max_tokens=2)
    lookahead.run()
    lookahead.drain_saves()
    legacy = make_engine(store.endpoint, eagle=True, extra={"engine_id": "iso-legacy", "lookahead": "off"})
    assert legacy.external_hit("b", prompt) == 0, "a block stored in another mode is never served"
    la_mode = lookahead.connector.client().mode_id
    legacy_mode = legacy.connector.client().mode_id
    assert la_mode != legacy_mode
    report = store.cli("diagnose")
    assert la_mode in report and legacy_mode in report
    held = re.search(rf"mode {la_mode} held (\d+)", report)
    assert held is not None and int(held.group(1)) == 3, report


def run_seeded(model_dir: Path, engine_id: str, seed: str, *stores: StoreProcess) -> list[dict[str, Any]]:
    """One key_scheme=vllm engine per store, in a process started with PYTHONHASHSEED=seed."""
    env = {**os.environ, "PYTHONHASHSEED": seed, "HF_HUB_OFFLINE": "1"}
    script = ROOT / "tests" / "connector" / "hash_seed_engine.py"
    done = subprocess.run(
        [sys.executable, str(script), str(model_dir), engine_id, *(s.endpoint for s in stores)],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=ROOT,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return [dict(json.loads(line)) for line in done.stdout.strip().splitlines()[-len(stores) :]]


def test_vllm_scheme_with_different_pythonhashseed_is_refused_under_strict_and_split_under_isolate(
    start_store: Callable[..., StoreProcess], models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """This process hashes with vLLM's default seed; a second process runs with PYTHONHASHSEED=22."""
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    strict = start_store("--policy", "strict")
    isolate = start_store()
    here = [serve_once(models["llama"], store.endpoint, "seed-default") for store in (strict, isolate)]
    assert all(r["state"] == "CONNECTED" and r["saved"] == 3 for r in here), here
    refused, split = run_seeded(models["llama"], "seed-22", "22", strict, isolate)

    assert refused["state"] == "REFUSED"
    assert refused["refused_fields"] == ["seed_fingerprint"]
    assert refused["finished"] and refused["hit"] == 0 and refused["saved"] == 0

    assert split["state"] == "CONNECTED"
    assert split["seed"] != here[1]["seed"] and split["mode_id"] != here[1]["mode_id"]
    assert split["hit"] == 0, "another seed never reads the first seed's bytes"
    again = serve_once(models["llama"], isolate.endpoint, "seed-default-2")
    assert again["hit"] == 3 * B, "same seed, same mode: the store is shared"
    report = isolate.cli("diagnose")
    assert here[1]["mode_id"] in report and split["mode_id"] in report
