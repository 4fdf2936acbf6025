"""Block keys (canonical vectors, key_scheme=vllm), extras, unencodable requests."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from kvtag_client.connector import compat
from kvtag_client.connector.namespace import Geometry, vllm_probe_keys
from kvtag_client.connector.tracking import RequestKeys
from kvtag_client.keys import ExtraKeys, block_keys
from vllm import SamplingParams
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, hash_block_tokens
from vllm.v1.request import Request, RequestStatus

from tests.store_process import StoreProcess

from .harness import Engine, assert_scheduler_empty
from .test_hit_length import B, fresh_prompt

VECTORS = json.loads(
    (Path(__file__).resolve().parents[2] / "docs" / "canonical-key-vectors.json").read_text()
)


def vector_request(engine: Engine, vector: dict[str, Any]) -> Any:
    extras = vector["extras"]
    kwargs: dict[str, Any] = {}
    if extras["lora_name"] is not None:
        kwargs["lora_request"] = LoRARequest(extras["lora_name"], 1, "/nonexistent")
    if extras["cache_salt"] is not None:
        kwargs["cache_salt"] = extras["cache_salt"]
    if extras["mm_items"]:
        kwargs["mm_features"] = [
            MultiModalFeatureSpec(
                data=None,
                modality="image",
                identifier=ident,
                mm_position=PlaceholderRange(offset=off, length=n),
            )
            for ident, off, n in extras["mm_items"]
        ]
    return engine.make_request("v", vector["token_ids"], 1, **kwargs)


@pytest.mark.parametrize("vector", VECTORS["vectors"], ids=[v["name"] for v in VECTORS["vectors"]])
def test_connector_keys_match_the_published_canonical_vectors(
    make_engine: Callable[..., Engine], store: StoreProcess, vector: dict[str, Any]
) -> None:
    engine = make_engine(store.endpoint)
    h = vector["hash_block_size"]
    keys = RequestKeys(
        vector_request(engine, vector), Geometry(h, h), vector["lookahead_tokens"], "canonical"
    )
    keys.refresh()
    assert keys.encodable
    got = [keys.key(j).hex() for j in range(keys.num_keyed_blocks())]
    if vector["extras"]["cache_salt"] == "":
        # vLLM treats cache_salt="" as no salt (docs/canonical-keys.md, "From a vLLM request"), so
        # through a request this vector must give the unsalted keys, not its own.
        unsalted = block_keys(vector["token_ids"], h, vector["lookahead_tokens"], ExtraKeys())
        assert got == [k.hex() for k in unsalted] != vector["keys"]
    else:
        assert got == vector["keys"]


def unhashed_request(tokens: list[int]) -> Request:
    return Request(
        request_id="expected",
        prompt_token_ids=list(tokens),
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
    )


def legacy_vllm_hashes(tokens: list[int]) -> list[bytes]:
    """vLLM's legacy (L=0) block hashes of `tokens`."""
    return [bytes(h) for h in get_request_block_hasher(B, _sha256())(unhashed_request(tokens))]


def expected_vllm_scheme_keys(tokens: list[int], lookahead: int) -> list[bytes]:
    """key_scheme=vllm's keys for `tokens`, straight from vLLM: on 0.33+ its own lookahead block
    hashes (kv_cache_utils.get_request_block_hasher with num_hash_lookahead_tokens), on 0.32 its
    legacy hashes followed by the successor token ids."""
    request = unhashed_request(tokens)
    if compat.vllm_has_lookahead_hasher():
        hasher = get_request_block_hasher(B, _sha256(), lookahead)
        return [bytes(h) for h in hasher(request)]
    legacy = get_request_block_hasher(B, _sha256())(request)
    return [
        bytes(h) + b"".join(t.to_bytes(4, "big") for t in tokens[(j + 1) * B : (j + 1) * B + lookahead])
        for j, h in enumerate(legacy)
        if (j + 1) * B + lookahead <= len(tokens)
    ]


def test_vllm_scheme_uses_the_engine_block_hashes(
    make_engine: Callable[..., Engine], store: StoreProcess
) -> None:
    engine = make_engine(store.endpoint, eagle=True, extra={"key_scheme": "vllm", "engine_id": "vllm-scheme"})
    assert engine.connector.lookahead_tokens == 1
    prompt = fresh_prompt(3 * B + 2)
    request = engine.make_request("v", prompt, 1)
    sched = engine.connector._sched()
    keys = RequestKeys(request, Geometry(B, B), 1, "vllm", sched.lookahead_hasher, sched.legacy_hasher)
    keys.refresh()
    assert keys.num_keyed_blocks() == 3
    assert [keys.key(j) for j in range(3)] == expected_vllm_scheme_keys(prompt, 1)
    legacy = legacy_vllm_hashes(prompt)
    if compat.core_decides_lookahead():
        # 0.34+: the core hashes with lookahead itself; its block_hashes are the keys as they are.
        assert [keys.key(j) for j in range(3)] == [bytes(h) for h in request.block_hashes[:3]]
    else:
        assert legacy[:3] == [bytes(h) for h in request.block_hashes[:3]]
    for j in range(3):
        assert keys.base_key(j) == legacy[j], "the base key is the engine's legacy (L=0) hash"
        assert keys.key(j) != keys.base_key(j)
    # The probe keys are the engine's own chain over the probe tokens from its NONE_HASH.
    probe = engine.connector.probe_keys()
    assert probe == vllm_probe_keys(engine.vc, B, 1)
    assert probe == expected_vllm_scheme_keys(_probe_tokens(B, 1), 1)
    assert probe[0] != bytes(hash_block_tokens(_sha256(), None, list(_probe_tokens(B, 1))[:B], None))


def test_vllm_scheme_stores_under_the_vllm_lookahead_hashes_through_the_real_scheduler(
    make_engine: Callable[..., Engine], store: StoreProcess
) -> None:
    """On 0.33+, kvtag's key_scheme=vllm lookahead keys are vLLM's own lookahead block hashes: a save
    through the real Scheduler lands under them, and a second engine hits every block."""
    extra = {"key_scheme": "vllm", "engine_id": "vllm-scheme-store"}
    writer = make_engine(store.endpoint, eagle=True, extra=extra)
    prompt = fresh_prompt(4 * B + 3)
    writer.add("w", prompt, max_tokens=2)
    writer.run()
    writer.drain_saves()
    tokens = prompt + writer.step_log_samples("w")
    expected = expected_vllm_scheme_keys(tokens, 1)
    assert len(expected) == 4
    stored = writer.connector.client().get([(0, key) for key in expected])
    assert all(value is not None for value in stored), (
        f"blocks not stored under vLLM {compat.vllm_version()}'s keys: "
        f"{[i for i, v in enumerate(stored) if v is None]}"
    )
    reader = make_engine(store.endpoint, eagle=True, extra=extra)
    assert reader.external_hit("r", prompt) == 4 * B


def _sha256() -> Any:
    from vllm.utils.hashing import sha256

    return sha256


def _probe_tokens(h: int, la: int) -> list[int]:
    from kvtag_proto.ids import probe_tokens

    return probe_tokens(h, la)


def test_cache_salt_separates_hits(make_engine: Callable[..., Engine], store: StoreProcess) -> None:
    writer = make_engine(store.endpoint)
    prompt = fresh_prompt(2 * B + 3)
    writer.add("salted", prompt, max_tokens=2, cache_salt="tenant-a")
    writer.run()
    writer.drain_saves()
    reader = make_engine(store.endpoint)
    same = reader.connector.get_num_new_matched_tokens(
        reader.make_request("s1", prompt, 1, cache_salt="tenant-a"), 0
    )
    other = reader.connector.get_num_new_matched_tokens(
        reader.make_request("s2", prompt, 1, cache_salt="tenant-b"), 0
    )
    unsalted = reader.external_hit("s3", prompt)
    assert same[0] == 2 * B
    assert other[0] == 0 and unsalted == 0


def test_unencodable_request_is_neither_stored_nor_loaded_and_is_counted(
    make_engine: Callable[..., Engine], store: StoreProcess
) -> None:
    engine = make_engine(store.endpoint)
    # A lone surrogate has no UTF-8 encoding: the canonical scheme cannot key this request.
    request = engine.add("bad", fresh_prompt(3 * B), max_tokens=2, cache_salt="tenant-\udcff")
    engine.run()
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert engine.connector.stats.totals["unencodable_requests"] == 1
    assert engine.connector.stats.totals["lookups"] == 0
    assert not any(job.blocks for entry in engine.step_log for job in entry["meta"].saves)
    assert_scheduler_empty(engine.scheduler)
