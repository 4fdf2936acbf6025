"""The namespace and hashing-mode descriptors that tests and benchmarks open sessions with.

Every field the service requires is filled in. A caller names only what its behaviour depends on:
a second model for a second namespace, another lookahead or seed for a second mode.
"""

from __future__ import annotations

from kvtag.v1 import store_pb2 as pb

PROBE = [b"probe-key-0", b"probe-key-1"]


def namespace(model: str = "llama-8b", tenant: str = "") -> pb.NamespaceDescriptor:
    return pb.NamespaceDescriptor(
        model_name=model,
        weights_fingerprint="sha256:abc",
        kv_dtype="bfloat16",
        kv_layout="attn:1x65536",
        block_size=16,
        parallel_sharding="tp=1/rank=0",
        tenant=tenant,
    )


def mode(
    lookahead: int = 1, algorithm: str = "sha256", seed: str = "", scheme: str = "canonical"
) -> pb.HashingMode:
    return pb.HashingMode(
        key_scheme=scheme,
        scheme_version="1",
        hash_algorithm=algorithm,
        hash_block_size=16,
        lookahead_tokens=lookahead,
        seed_fingerprint=seed,
    )
