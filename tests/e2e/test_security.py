"""Real vLLM CPU engines against a TLS + tokens store: the connector configured with the store's CA and
a token file stores and gets its hits; with a wrong token it logs one clear error per session and
serves every request without the store, token for token the same."""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.certs import Authority
from tests.store_process import StoreProcess

from .harness import EngineRun, kv_transfer_config, prompt, run_engine

pytestmark = pytest.mark.slow

BLOCK = 32
PROMPTS = [prompt(61, 100), prompt(62, 130)]


def new_token() -> str:
    """A token as `python -m kvtag_store.security.tokens new` mints (the service is not in the vLLM venv)."""
    return "kvt_" + secrets.token_urlsafe(32)


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def _job(
    models: dict[str, Path], endpoint: str, engine_id: str, await_store_s: float = 0.0, **security: str
) -> dict[str, Any]:
    return {
        "model": str(models["llama"]),
        "await_store_s": await_store_s,
        "block_size": BLOCK,
        "kv_transfer_config": kv_transfer_config(
            endpoint, engine_id=engine_id, tenant="acme", rpc_timeout_ms=2000, **security
        ),
        "steps": [{"prompts": PROMPTS, "max_tokens": 6}],
    }


def test_connector_with_tls_and_a_token_gets_hits_and_with_a_wrong_token_serves_without_the_store(
    models: dict[str, Path], work_dir: Path, start_store: Callable[..., StoreProcess]
) -> None:
    ca = Authority(work_dir / "pki", "ca")
    server = ca.issue("server", server=True)
    token, wrong = new_token(), new_token()
    tokens = work_dir / "tokens.toml"
    tokens.write_text(
        f'[[tokens]]\nname = "acme-engines"\nsha256 = "{hash_token(token)}"\nrole = "engine"\n'
        'tenants = ["acme"]\n'
    )
    token_file, wrong_file = work_dir / "token", work_dir / "wrong-token"
    token_file.write_text(token + "\n")
    wrong_file.write_text(wrong + "\n")
    store = start_store(
        "--tls-cert", str(server.cert), "--tls-key", str(server.key), "--auth-tokens", str(tokens)
    )  # fmt: skip
    secured = {"tls_ca": str(ca.cert), "token_file": str(token_file)}

    # The wrong-token engine runs beside the producer (two processes, one start-up of wall time).
    refused_run = EngineRun(
        _job(models, store.endpoint, "intruder", tls_ca=str(ca.cert), token_file=str(wrong_file)),
        work_dir,
        "wrong-token",
    ).start()
    try:
        producer = run_engine(
            _job(models, store.endpoint, "producer", await_store_s=30.0, **secured), work_dir, "tls-producer"
        )
        refused = refused_run.result()
    finally:
        refused_run.kill()
    consumer = run_engine(
        _job(models, store.endpoint, "consumer", await_store_s=30.0, **secured), work_dir, "tls-consumer"
    )

    made, served, warm = (result["steps"][0]["requests"] for result in (producer, refused, consumer))
    assert producer["store_ready_s"] is not None and consumer["store_ready_s"] is not None
    # Same host: the granted engines' workers moved their blocks through their tenant's arena.
    assert producer["worker_data_path"] == consumer["worker_data_path"] == "shared_memory"
    for index, request in enumerate(warm):
        assert request["external_hit"] > 0, f"prompt {index}: no hit from the TLS + token store"
        assert request["token_ids"] == made[index]["token_ids"], f"prompt {index}: warm output differs"
    for index, request in enumerate(served):
        assert request["external_hit"] == 0
        assert request["token_ids"] == made[index]["token_ids"], f"prompt {index}: refused engine's output"

    log = refused_run.log_text()
    refusals = [line for line in log.splitlines() if "refused engine" in line]
    # One error per store session (the scheduler's and the worker's), naming the reason, and no more.
    assert 1 <= len(refusals) <= 2 and all("UNAUTHENTICATED" in line for line in refusals), refusals
    assert all("WITHOUT the store" in line for line in refusals)
    every_log = log + (work_dir / "tls-producer.log").read_text(errors="replace") + store.log_tail(200_000)
    assert token not in every_log and wrong not in every_log
