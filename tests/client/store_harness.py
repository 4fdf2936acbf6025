"""The namespace every client test opens its sessions in (the store process itself: tests.store_process)."""

from __future__ import annotations

from kvtag.v1 import store_pb2 as pb


def namespace(tenant: str = "") -> pb.NamespaceDescriptor:
    return pb.NamespaceDescriptor(
        model_name="test/tiny-llama",
        weights_fingerprint="sha256:0123",
        kv_dtype="float32",
        kv_layout="attn:1x4096",
        block_size=16,
        parallel_sharding="tp=1/rank=0",
        tenant=tenant,
    )
