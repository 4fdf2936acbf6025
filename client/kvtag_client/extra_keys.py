"""Maps a vLLM request's identity beyond its tokens (LoRA, cache salt, multimodal items) to ExtraKeys.

The request is duck-typed (vllm.v1.request.Request: `lora_request`, `cache_salt`,
`mm_features`, `prompt_embeds`) so this module imports no vLLM and works on any
object of that shape. The mapping is normative; docs/canonical-keys.md, section
"From a vLLM request", states it.
"""

from __future__ import annotations

from typing import Any

from kvtag_client.keys import ExtraKeys, UnencodableExtraKeys, check_extra_keys


def _lora_name(lora_request: Any) -> str:
    """The adapter's name: engines sharing a namespace must give each adapter version its own name."""
    name = getattr(lora_request, "lora_name", None)
    if not isinstance(name, str) or not name:
        raise UnencodableExtraKeys(f"LoRA request has no usable lora_name: {name!r}")
    return name


def extra_keys_from_request(request: Any) -> ExtraKeys:
    """The canonical ExtraKeys of a vLLM request; UnencodableExtraKeys when it has no canonical identity.

    - LoRA: `request.lora_request.lora_name` when a LoRA is set.
    - Cache salt: `request.cache_salt`, with "" treated as no salt, exactly as vLLM does.
    - Multimodal: one `(feature.identifier, mm_position.offset, mm_position.length)` per
      entry of `request.mm_features`, positions absolute in the prompt.
    - Prompt embeddings (`request.prompt_embeds` set, alone or mixed with token ids) have
      no canonical encoding: the token ids are placeholders, so the request is unkeyable.
    """
    if getattr(request, "prompt_embeds", None) is not None:
        raise UnencodableExtraKeys("the request carries prompt embeddings, which have no canonical encoding")
    lora_request = getattr(request, "lora_request", None)
    lora_name = _lora_name(lora_request) if lora_request else None
    salt = getattr(request, "cache_salt", None)
    if salt is not None and not isinstance(salt, str):
        raise UnencodableExtraKeys(f"cache_salt must be a str, got {type(salt).__name__}")
    items: list[tuple[Any, Any, Any]] = []
    for n, feature in enumerate(getattr(request, "mm_features", None) or ()):
        identifier = getattr(feature, "identifier", None)
        position = getattr(feature, "mm_position", None)
        if position is None:
            raise UnencodableExtraKeys(f"mm_features[{n}] has no mm_position")
        # Types are checked by check_extra_keys below, with the rules key derivation applies.
        items.append((identifier, getattr(position, "offset", None), getattr(position, "length", None)))
    extras = ExtraKeys(lora_name=lora_name, cache_salt=salt or None, mm_items=tuple(items))
    check_extra_keys(extras)
    return extras
