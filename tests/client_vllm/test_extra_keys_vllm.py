"""extra_keys_from_request on a real vllm.v1.request.Request, cross-checked against vLLM's own extra keys."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm")

from kvtag_client.extra_keys import extra_keys_from_request
from kvtag_client.keys import ExtraKeys, block_keys
from vllm import SamplingParams
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys
from vllm.v1.request import Request

BLOCK = 4


def _request(**kwargs: Any) -> Request:
    return Request(
        request_id="r-1",
        prompt_token_ids=[11, 12, 0, 0, 0, 0, 0, 0, 0, 13, 14, 15, 16, 17],
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        **kwargs,
    )


def _features() -> list[MultiModalFeatureSpec]:
    return [
        MultiModalFeatureSpec(
            data=None, modality="image", identifier="img-a", mm_position=PlaceholderRange(2, 3)
        ),
        MultiModalFeatureSpec(
            data=None, modality="image", identifier="img-b", mm_position=PlaceholderRange(5, 4)
        ),
    ]


def test_real_vllm_request_maps_lora_salt_and_multimodal_items() -> None:
    request = _request(
        mm_features=_features(),
        lora_request=LoRARequest(lora_name="sql-adapter", lora_int_id=1, lora_path="/adapters/sql"),
        cache_salt="tenant-7",
    )
    extras = extra_keys_from_request(request)
    assert extras == ExtraKeys(
        lora_name="sql-adapter", cache_salt="tenant-7", mm_items=(("img-a", 2, 3), ("img-b", 5, 4))
    )
    assert len(block_keys(request.all_token_ids, BLOCK, 1, extras)) == 3


def test_blocks_see_the_same_multimodal_items_as_vllms_own_extra_keys() -> None:
    """Our overlap rule picks, per block, exactly the items vLLM puts in that block's extra keys."""
    request = _request(mm_features=_features())
    extras = extra_keys_from_request(request)
    mm_index = 0
    for start in range(0, request.num_tokens - BLOCK + 1, BLOCK):
        end = start + BLOCK
        vllm_keys, mm_index = generate_block_hash_extra_keys(request, start, end, mm_index)
        vllm_ids = [key[1] for key in (vllm_keys or ()) if key[0] == "mm"]
        ours = [
            ident for ident, offset, length in extras.mm_items if offset < end and offset + length > start
        ]
        assert ours == vllm_ids, f"block [{start}, {end})"


def test_plain_vllm_request_has_no_extra_keys_and_empty_salt_is_none() -> None:
    assert extra_keys_from_request(_request()) == ExtraKeys()
    assert extra_keys_from_request(_request(cache_salt="")) == ExtraKeys()
