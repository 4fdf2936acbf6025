"""Maps a vLLM request's identity beyond its tokens (LoRA, cache salt, multimodal items) to ExtraKeys.

The request is duck-typed (vllm.v1.request.Request: `lora_request`, `cache_salt`,
`mm_features`, `prompt_embeds`) so this module imports no vLLM and works on any
object of that shape. The mapping is normative; docs/canonical-keys.md, section
"From a vLLM request", states it.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvtag_client.keys import ExtraKeys, UnencodableExtraKeys, check_extra_keys

# How a LoRA request becomes the canonical `lora_name`: its name (default) or a content fingerprint.
LoraIdentity = Callable[[Any], str]


def lora_name_identity(lora_request: Any) -> str:
    """The adapter's name: engines sharing a namespace must give each adapter version its own name."""
    name = getattr(lora_request, "lora_name", None)
    if not isinstance(name, str) or not name:
        raise UnencodableExtraKeys(f"LoRA request has no usable lora_name: {name!r}")
    return name


_fingerprints: dict[tuple[str, tuple[tuple[str, int, int], ...]], str] = {}
_fingerprints_lock = threading.Lock()


def lora_content_identity(lora_request: Any) -> str:
    """`name@sha256:<digest of the adapter files>`: re-pointing a name at new weights changes the keys.

    The digest covers every regular file under `lora_path` (relative path, size and
    bytes, in sorted order) and is cached per (path, file sizes and mtimes), so an
    adapter is read once per process. A path that is not a local directory cannot
    be fingerprinted and makes the request unkeyable.
    """
    name = lora_name_identity(lora_request)
    path = getattr(lora_request, "lora_path", None)
    if not isinstance(path, str) or not path or not os.path.isdir(path):
        raise UnencodableExtraKeys(
            f"LoRA {name!r}: lora_path {path!r} is not a local directory to fingerprint"
        )
    root = Path(path)
    files = sorted(p for p in root.rglob("*") if p.is_file())
    stamp = tuple((str(p.relative_to(root)), p.stat().st_size, p.stat().st_mtime_ns) for p in files)
    cache_key = (str(root.resolve()), stamp)
    with _fingerprints_lock:
        cached = _fingerprints.get(cache_key)
    if cached is not None:
        return f"{name}@{cached}"
    digest = hashlib.sha256(b"kvtag.lora-content.v1\x00")
    for file in files:
        relative = str(file.relative_to(root)).encode("utf-8")
        digest.update(len(relative).to_bytes(4, "big") + relative + file.stat().st_size.to_bytes(8, "big"))
        with file.open("rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
    fingerprint = "sha256:" + digest.hexdigest()
    with _fingerprints_lock:
        _fingerprints[cache_key] = fingerprint
    return f"{name}@{fingerprint}"


def extra_keys_from_request(request: Any, lora_identity: LoraIdentity = lora_name_identity) -> ExtraKeys:
    """The canonical ExtraKeys of a vLLM request; UnencodableExtraKeys when it has no canonical identity.

    - LoRA: `lora_identity(request.lora_request)` when a LoRA is set (default: its name).
    - Cache salt: `request.cache_salt`, with "" treated as no salt, exactly as vLLM does.
    - Multimodal: one `(feature.identifier, mm_position.offset, mm_position.length)` per
      entry of `request.mm_features`, positions absolute in the prompt.
    - Prompt embeddings (`request.prompt_embeds` set, alone or mixed with token ids) have
      no canonical encoding: the token ids are placeholders, so the request is unkeyable.
    """
    if getattr(request, "prompt_embeds", None) is not None:
        raise UnencodableExtraKeys("the request carries prompt embeddings, which have no canonical encoding")
    lora_request = getattr(request, "lora_request", None)
    lora_name = lora_identity(lora_request) if lora_request else None
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
