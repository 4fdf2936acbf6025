"""Namespace and hashing-mode descriptors, and the known-answer probe keys, derived from the vLLM config.

The namespace says what the stored bytes mean (model, weights, dtype, KV layout, block size, sharding,
tenant); the mode says how the keys were derived. Both go to the service at session open.
"""

from __future__ import annotations

import hashlib
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtag.v1 import store_pb2 as pb
from kvtag_proto.ids import probe_tokens

from kvtag_client import keys as canonical_keys

from . import compat
from .config import KvtagConfig

# Files whose bytes identify a checkpoint without reading the weights themselves.
_FINGERPRINT_FILES = ("config.json", "model.safetensors.index.json", "generation_config.json")


@dataclass(frozen=True, slots=True)
class Geometry:
    """Token geometry of the store: blocks of `block_size` tokens keyed at `hash_block_size`."""

    block_size: int
    hash_block_size: int

    @property
    def hashes_per_block(self) -> int:
        return self.block_size // self.hash_block_size


def resolve_geometry(vllm_config: Any, kv_cache_config: Any) -> Geometry:
    """(scheduler block size, hash block size) exactly as EngineCore resolves them."""
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

    block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    # EngineCore stores its resolution on the config the connector gets: prefer it when set.
    hash_block_size = kv_cache_config.hash_block_size or hash_block_size
    return Geometry(block_size=int(block_size), hash_block_size=int(hash_block_size))


def weights_fingerprint(model: str, revision: str | None) -> str:
    """A digest of a local checkpoint's config/index files and weight file sizes, or the revision."""
    path = Path(model)
    if not path.is_dir():
        return f"rev:{revision or 'unknown'}"
    digest = hashlib.sha256()
    for name in _FINGERPRINT_FILES:
        candidate = path / name
        if candidate.is_file():
            digest.update(name.encode() + b"\x00" + candidate.read_bytes())
    for weight in sorted(path.glob("*.safetensors")) + sorted(path.glob("*.bin")):
        digest.update(weight.name.encode() + struct.pack(">Q", weight.stat().st_size))
    return "sha256:" + digest.hexdigest()[:32]


def kv_layout(kv_cache_config: Any) -> str:
    """Readable fingerprint of the cache groups: kind, block size, per-block bytes, layer count."""
    parts = []
    for index, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        mode = getattr(spec, "mamba_cache_mode", None)
        parts.append(
            f"g{index}:{type(spec).__name__}"
            + (f"[{mode}]" if mode else "")
            + f":bs{spec.block_size}:page{spec.page_size_bytes}:layers{len(group.layer_names)}"
        )
    return ";".join(parts)


def kv_dtype(vllm_config: Any) -> str:
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    if cache_dtype != "auto":
        return cache_dtype
    return str(vllm_config.model_config.dtype).removeprefix("torch.")


def tp_size(vllm_config: Any) -> int:
    return int(vllm_config.parallel_config.tensor_parallel_size)


def parallel_sharding(vllm_config: Any, tp_rank: int, pp_rank: int) -> str:
    parallel = vllm_config.parallel_config
    return (
        f"tp={parallel.tensor_parallel_size}/rank={tp_rank},"
        f"pp={parallel.pipeline_parallel_size}/rank={pp_rank},"
        f"dcp={parallel.decode_context_parallel_size}"
    )


def namespace(
    vllm_config: Any, kv_cache_config: Any, config: KvtagConfig, geometry: Geometry, tp_rank: int = 0
) -> pb.NamespaceDescriptor:
    model_config = vllm_config.model_config
    model = str(model_config.model)
    return pb.NamespaceDescriptor(
        model_name=config.model_name or str(model_config.served_model_name or model),
        weights_fingerprint=config.weights_fingerprint or weights_fingerprint(model, model_config.revision),
        kv_dtype=kv_dtype(vllm_config),
        kv_layout=kv_layout(kv_cache_config),
        block_size=geometry.block_size,
        parallel_sharding=parallel_sharding(vllm_config, tp_rank, 0),
        tenant=config.tenant,
    )


# ---- key_scheme "vllm": the engine's own block hashes -------------------------------------------


def vllm_hash_fn(vllm_config: Any) -> Any:
    from vllm.utils.hashing import get_hash_fn_by_name

    return get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)


def vllm_none_hash(vllm_config: Any) -> bytes:
    """The engine's NONE_HASH (the chain's seed), initialising it the way EngineCore does if needed."""
    from vllm.v1.core import kv_cache_utils

    if getattr(kv_cache_utils, "NONE_HASH", None) is None:
        kv_cache_utils.init_none_hash(vllm_hash_fn(vllm_config))
    return bytes(kv_cache_utils.NONE_HASH)


def vllm_lookahead_key(block_hash: bytes, lookahead: list[int]) -> bytes:
    """key_scheme=vllm with L>0: the engine's legacy hash followed by the L successor token ids."""
    if not lookahead:
        return bytes(block_hash)
    return bytes(block_hash) + struct.pack(f">{len(lookahead)}I", *lookahead)


def vllm_hashers(
    vllm_config: Any, config: KvtagConfig, hash_block_size: int, lookahead: int
) -> tuple[compat.LookaheadHasher | None, compat.LookaheadHasher | None]:
    """key_scheme=vllm's (lookahead hasher, legacy hasher); see tracking._VllmChain.

    Where the core hashes with this lookahead itself (0.34+ opted in), request.block_hashes are the
    keys and only the legacy base keys are computed; otherwise kvtag derives the lookahead keys."""
    if config.key_scheme != "vllm":
        return None, None
    hash_fn = vllm_hash_fn(vllm_config)
    if lookahead > 0 and compat.core_lookahead_tokens(vllm_config) == lookahead:
        return None, compat.vllm_legacy_hasher(hash_fn, hash_block_size)
    return compat.vllm_lookahead_hasher(hash_fn, hash_block_size, lookahead), None


def vllm_probe_keys(vllm_config: Any, hash_block_size: int, lookahead_tokens: int) -> list[bytes]:
    from vllm.v1.core.kv_cache_utils import hash_block_tokens

    vllm_none_hash(vllm_config)
    hash_fn = vllm_hash_fn(vllm_config)
    tokens = probe_tokens(hash_block_size, lookahead_tokens)
    hasher = compat.vllm_lookahead_hasher(hash_fn, hash_block_size, lookahead_tokens)
    if hasher is not None:
        return hasher(compat.PlainRequest(tokens), [])[:2]
    result: list[bytes] = []
    parent = None
    for index in range(2):
        start, end = index * hash_block_size, (index + 1) * hash_block_size
        parent = hash_block_tokens(hash_fn, parent, tokens[start:end], None)
        result.append(vllm_lookahead_key(bytes(parent), tokens[end : end + lookahead_tokens]))
    return result


def hashing_mode(
    vllm_config: Any, config: KvtagConfig, hash_block_size: int, lookahead: int
) -> pb.HashingMode:
    if config.key_scheme == "canonical":
        return canonical_keys.mode(hash_block_size, lookahead)
    return pb.HashingMode(
        key_scheme="vllm",
        scheme_version=compat.vllm_version(),
        hash_algorithm=str(vllm_config.cache_config.prefix_caching_hash_algo),
        hash_block_size=hash_block_size,
        lookahead_tokens=lookahead,
        seed_fingerprint="sha256:" + hashlib.sha256(vllm_none_hash(vllm_config)).hexdigest()[:32],
    )


def probe_keys(vllm_config: Any, config: KvtagConfig, hash_block_size: int, lookahead: int) -> list[bytes]:
    if config.key_scheme == "canonical":
        return canonical_keys.probe_keys(hash_block_size, lookahead)
    return vllm_probe_keys(vllm_config, hash_block_size, lookahead)


def engine_id(config: KvtagConfig, role: str) -> str:
    if config.engine_id:
        return f"{config.engine_id}/{role}"
    return f"{os.uname().nodename}/pid{os.getpid()}/{role}"
