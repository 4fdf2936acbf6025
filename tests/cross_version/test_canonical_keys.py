"""Canonical keys do not depend on the vLLM version: a 0.33 producer and a 0.34 consumer (each its own
vLLM's real Scheduler, same model, same tokens, lookahead on) share their lookahead keys, and the
consumer loads the producer's blocks in full."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from kvtag_client.connector import compat

from tests.connector.harness import Setup, llama_dir
from tests.connector.test_hit_length import B, fresh_prompt
from tests.store_process import REPO, StoreProcess

PRODUCER_PYTHON = os.environ.get("KVTAG_PRODUCER_PYTHON", str(REPO / ".venv-vllm033" / "bin" / "python"))


def test_a_033_producers_canonical_lookahead_keys_are_a_034_consumers(tmp_path: Path) -> None:
    producer_version = subprocess.run(
        [PRODUCER_PYTHON, "-c", "import vllm; print(vllm.__version__)"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert compat.parse_series(producer_version) != compat.series(), "the pair must be two vLLM series"
    model = llama_dir(tmp_path)
    prompt = fresh_prompt(4 * B + 3)
    with StoreProcess(tmp_path / "store.log") as store:
        done = subprocess.run(
            [
                PRODUCER_PYTHON,
                "-m",
                "tests.cross_version.producer",
                "--endpoint",
                store.endpoint,
                "--model-dir",
                str(model),
                "--prompt",
                json.dumps(prompt),
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )
        assert done.returncode == 0, done.stderr[-3000:]
        produced = json.loads(done.stdout.strip().splitlines()[-1])
        assert produced["lookahead"] == 1 and produced["saved_blocks"] == 4, produced

        consumer = Setup(
            model, store.endpoint, eagle_dir=model, extra={"engine_id": "cross-version-consumer"}
        ).build()
        try:
            assert consumer.connector.lookahead_tokens == 1
            keys = consumer.connector._sched().track(consumer.make_request("k", prompt, 1)).keys
            keys.refresh()
            assert [keys.key(j).hex() for j in range(keys.num_keyed_blocks())] == produced["keys"]
            assert consumer.connector.client().mode_id == produced["mode_id"]
            assert consumer.connector.client().namespace_id == produced["namespace_id"], (
                f"vLLM {producer_version} and {compat.vllm_version()} describe the same KV differently"
            )
            # The producer's blocks load in full: every keyed block is a hit (no EAGLE drop on top).
            assert consumer.external_hit("c", prompt) == 4 * B
        finally:
            consumer.shutdown()


@pytest.fixture(autouse=True)
def _offline() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
