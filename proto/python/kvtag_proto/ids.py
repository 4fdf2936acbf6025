"""Derivation of mode_id, namespace_id and the known-answer probe tokens.

Normative text lives in proto/kvtag/v1/store.proto; test vectors in
docs/identifiers.md. Service and client both import this module so the two
sides can never derive identifiers differently.
"""

from __future__ import annotations

import hashlib
import struct

from kvtag.v1 import store_pb2 as pb

MODE_DOMAIN = b"kvtag.mode.v1\x00"
NAMESPACE_DOMAIN = b"kvtag.namespace.v1\x00"
PROBE_KEY_COUNT = 2


def _str(value: str) -> bytes:
    raw = value.encode("utf-8")
    return struct.pack(">I", len(raw)) + raw


def _u32(value: int) -> bytes:
    return struct.pack(">I", value)


def mode_encoding(mode: pb.HashingMode) -> bytes:
    """Canonical bytes of a hashing mode; the digest input of mode_id."""
    return (
        MODE_DOMAIN
        + _str(mode.key_scheme)
        + _str(mode.scheme_version)
        + _str(mode.hash_algorithm)
        + _u32(mode.hash_block_size)
        + _u32(mode.lookahead_tokens)
        + _str(mode.seed_fingerprint)
    )


def mode_id(mode: pb.HashingMode) -> str:
    return "m-" + hashlib.sha256(mode_encoding(mode)).hexdigest()[:16]


def namespace_encoding(ns: pb.NamespaceDescriptor) -> bytes:
    """Canonical bytes of a namespace descriptor; the digest input of namespace_id."""
    return (
        NAMESPACE_DOMAIN
        + _str(ns.model_name)
        + _str(ns.weights_fingerprint)
        + _str(ns.kv_dtype)
        + _str(ns.kv_layout)
        + _u32(ns.block_size)
        + _str(ns.parallel_sharding)
        + _str(ns.tenant)
    )


def namespace_id(ns: pb.NamespaceDescriptor) -> str:
    return "ns-" + hashlib.sha256(namespace_encoding(ns)).hexdigest()[:16]


def probe_tokens(hash_block_size: int, lookahead_tokens: int) -> list[int]:
    """The fixed token sequence whose keys every session sends at OpenSession."""
    count = PROBE_KEY_COUNT * hash_block_size + lookahead_tokens
    return [(i * 7919 + 13) % 32000 for i in range(count)]
