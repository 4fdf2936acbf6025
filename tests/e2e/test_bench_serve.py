"""`make bench-serve --quick`'s plumbing at two requests: real Mooncake processes, kvtag stores and
`vllm serve` processes in one private network namespace, driven by `vllm bench serve`.

Every system (none, kvtag memory, kvtag over Mooncake, vLLM's MooncakeStoreConnector, and the peer as
kvtag's companion) must produce a consumer run with vLLM's counters and outputs equal to the cold run's
(the `none` server); each kvtag consumer, the companion included, must hit and complete every
request. No timing is asserted: the machine is shared.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.store_process import REPO

# Seven server starts on a shared 2-core machine: minutes each under load.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]

SYSTEMS = ("none", "kvtag-mem", "kvtag-mc", "peer", "peer+kvtag")
REQUESTS = 2


def test_quick_bench_serve_runs_every_system_with_counters_and_cold_outputs(tmp_path: Path) -> None:
    if importlib.util.find_spec("mooncake") is None:
        pytest.fail("the Mooncake wheel is not in the vLLM env: make .stamps/bench-serve")
    if not (REPO / ".venv" / "bin" / "mooncake_master").exists():
        pytest.fail("the Mooncake wheel is not installed in .venv: run scripts/install_mooncake.sh")
    out = tmp_path / "serve.json"
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "bench_serve.py"),
            "--quick",
            f"--requests={REQUESTS}",
            f"--out={out}",
            f"--workdir={tmp_path / 'work'}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=3000,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    document = json.loads(out.read_text())
    consumers = {r["system"]: r for r in document["records"] if r["phase"] == "consumer"}
    producers = {r["system"]: r for r in document["records"] if r["phase"] == "producer"}
    assert sorted(consumers) == sorted(SYSTEMS)
    assert sorted(producers) == sorted(s for s in SYSTEMS if s != "none")
    cold = consumers["none"]["samples"]["generated_texts"]
    assert len(cold) == REQUESTS and all(cold)
    for system, r in consumers.items():
        counters = r["counters"]
        assert counters["prompt_tokens_total"] > 0, (system, counters)
        assert "external_prefix_cache_queries_total" in counters, system
        if system == "none":
            assert counters["external_prefix_cache_queries_total"] == 0, counters
            continue
        texts = r["samples"]["generated_texts"]
        if system == "peer":
            # The peer keeps vLLM's kv_load_failure_policy "fail": a load that outlives its Mooncake lease on
            # a starved machine fails that request (reported by the benchmark, not a plumbing fault).
            assert all(t == c for t, c in zip(texts, cold, strict=True) if t), (texts, cold)
            assert counters["request_success_total"] >= 1, counters
            continue
        # kvtag never fails a request because of the store; a fresh consumer's hits came from the store.
        assert r["completed"] == REQUESTS, (system, r["samples"]["errors"])
        assert r["external_hit_tokens"] > 0, (system, counters)
        assert r["outputs_vs_cold"] == {
            "compared": REQUESTS,
            "differ": 0,
            "differing_indexes": [],
            "failed": 0,
        }
    # The companion moves bytes on the peer's own path: it hits what the bare peer hits.
    peer, companion = consumers["peer"], consumers["peer+kvtag"]
    if peer["completed"] == REQUESTS:
        assert companion["external_hit_tokens"] == peer["external_hit_tokens"], (companion, peer)
