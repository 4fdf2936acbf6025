"""docs/identifiers.md vectors hold for kvtag_proto.ids and for an independent encoder."""

from __future__ import annotations

import hashlib
import json
import re
import struct
from pathlib import Path
from typing import Any

import pytest
from kvtag.v1 import store_pb2 as pb
from kvtag_proto import ids
from kvtag_store.policy.mode_diff import decode_mode

DOC = Path(__file__).resolve().parents[3] / "docs" / "identifiers.md"


def _vectors(section: str) -> list[dict[str, Any]]:
    text = DOC.read_text(encoding="utf-8")
    match = re.search(rf"### {section}\n\n```json\n(.*?)\n```", text, re.DOTALL)
    assert match, f"docs/identifiers.md has no '### {section}' JSON block"
    vectors: list[dict[str, Any]] = json.loads(match.group(1))
    assert vectors
    return vectors


def _independent_encoding(domain: bytes, values: list[str | int]) -> bytes:
    """Written from the text of store.proto, not from kvtag_proto.ids."""
    out = domain
    for value in values:
        if isinstance(value, int):
            out += struct.pack(">I", value)
        else:
            raw = value.encode("utf-8")
            out += struct.pack(">I", len(raw)) + raw
    return out


MODE_FIELDS = ["key_scheme", "scheme_version", "hash_algorithm", "hash_block_size", "lookahead_tokens"]
NS_FIELDS = [
    "model_name",
    "weights_fingerprint",
    "kv_dtype",
    "kv_layout",
    "block_size",
    "parallel_sharding",
    "tenant",
]


@pytest.mark.parametrize("vector", _vectors("Modes"), ids=lambda v: v["mode_id"])
def test_mode_vectors_match_the_implementation_and_the_spec(vector: dict[str, Any]) -> None:
    mode = pb.HashingMode(**{k: vector[k] for k in [*MODE_FIELDS, "seed_fingerprint"]})
    encoding = bytes.fromhex(vector["encoding_hex"])
    spec = _independent_encoding(
        b"kvtag.mode.v1\x00", [vector[f] for f in [*MODE_FIELDS, "seed_fingerprint"]]
    )
    assert spec == encoding
    assert ids.mode_encoding(mode) == encoding
    assert ids.mode_id(mode) == vector["mode_id"] == "m-" + hashlib.sha256(encoding).hexdigest()[:16]
    assert decode_mode(encoding) == mode


@pytest.mark.parametrize("vector", _vectors("Namespaces"), ids=lambda v: v["namespace_id"])
def test_namespace_vectors_match_the_implementation_and_the_spec(vector: dict[str, Any]) -> None:
    ns = pb.NamespaceDescriptor(**{k: vector[k] for k in NS_FIELDS})
    encoding = bytes.fromhex(vector["encoding_hex"])
    assert _independent_encoding(b"kvtag.namespace.v1\x00", [vector[f] for f in NS_FIELDS]) == encoding
    assert ids.namespace_encoding(ns) == encoding
    assert ids.namespace_id(ns) == vector["namespace_id"] == "ns-" + hashlib.sha256(encoding).hexdigest()[:16]


@pytest.mark.parametrize("vector", _vectors("Probe tokens"), ids=lambda v: f"H{v['hash_block_size']}")
def test_probe_token_vectors(vector: dict[str, Any]) -> None:
    h, lookahead = vector["hash_block_size"], vector["lookahead_tokens"]
    assert ids.probe_tokens(h, lookahead) == vector["tokens"]
    assert vector["tokens"] == [(i * 7919 + 13) % 32000 for i in range(2 * h + lookahead)]


def test_every_descriptor_field_changes_the_identifier() -> None:
    base = _vectors("Modes")[1]
    mode = pb.HashingMode(**{k: base[k] for k in [*MODE_FIELDS, "seed_fingerprint"]})
    seen = {ids.mode_id(mode)}
    for field in [*MODE_FIELDS, "seed_fingerprint"]:
        changed = pb.HashingMode()
        changed.CopyFrom(mode)
        value = getattr(mode, field)
        setattr(changed, field, value + 1 if isinstance(value, int) else value + "x")
        seen.add(ids.mode_id(changed))
    assert len(seen) == 1 + len(MODE_FIELDS) + 1
