"""extra_keys_from_request on objects shaped like vllm.v1.request.Request (no vLLM needed)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
from kvtag_client.extra_keys import extra_keys_from_request
from kvtag_client.keys import ExtraKeys, UnencodableExtraKeys, block_keys


@dataclass
class Position:
    offset: Any
    length: Any


@dataclass
class Feature:
    identifier: Any
    mm_position: Position | None
    modality: str = "image"


@dataclass
class Lora:
    lora_name: Any
    lora_int_id: int = 1
    lora_path: str = ""


@dataclass
class RequestShape:
    lora_request: Lora | None = None
    cache_salt: Any = None
    mm_features: list[Feature] = field(default_factory=list)
    prompt_embeds: object | None = None


def test_plain_request_has_no_extra_keys() -> None:
    assert extra_keys_from_request(RequestShape()) == ExtraKeys()


def test_lora_salt_and_mm_features_map_to_extra_keys() -> None:
    request = RequestShape(
        lora_request=Lora("sql-adapter"),
        cache_salt="tenant-7",
        mm_features=[Feature("img-a", Position(3, 10)), Feature("img-b", Position(20, 4))],
    )
    assert extra_keys_from_request(request) == ExtraKeys(
        lora_name="sql-adapter", cache_salt="tenant-7", mm_items=(("img-a", 3, 10), ("img-b", 20, 4))
    )


def test_empty_cache_salt_is_no_salt_as_in_vllm() -> None:
    assert extra_keys_from_request(RequestShape(cache_salt="")).cache_salt is None


def test_request_without_attributes_maps_to_no_extras() -> None:
    assert extra_keys_from_request(object()) == ExtraKeys()


@pytest.mark.parametrize(
    "request_shape",
    [
        RequestShape(prompt_embeds=object()),
        RequestShape(mm_features=[Feature(None, Position(0, 4))]),
        RequestShape(mm_features=[Feature("", Position(0, 4))]),
        RequestShape(mm_features=[Feature("img", None)]),
        RequestShape(mm_features=[Feature("img", Position(-1, 4))]),
        RequestShape(mm_features=[Feature("img", Position(0, 0))]),
        RequestShape(lora_request=Lora("")),
        RequestShape(lora_request=Lora(None)),
        RequestShape(cache_salt=b"salt"),
        RequestShape(cache_salt="\udcff"),
    ],
    ids=repr,
)
def test_requests_without_canonical_identity_are_unkeyable(request_shape: RequestShape) -> None:
    with pytest.raises(UnencodableExtraKeys):
        extra_keys_from_request(request_shape)


def test_same_tokens_different_image_get_different_keys() -> None:
    tokens = [7] * 32  # identical placeholder tokens
    a = extra_keys_from_request(RequestShape(mm_features=[Feature("img-a", Position(16, 8))]))
    b = extra_keys_from_request(RequestShape(mm_features=[Feature("img-b", Position(16, 8))]))
    keys_a, keys_b = block_keys(tokens, 16, 0, a), block_keys(tokens, 16, 0, b)
    assert keys_a[0] == keys_b[0]  # the image starts in block 1
    assert keys_a[1] != keys_b[1]
