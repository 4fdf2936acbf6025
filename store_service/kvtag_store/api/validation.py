"""Input checks of the API layer; each failure raises the ApiError documented in docs/errors.md."""

from __future__ import annotations

from collections.abc import Sequence
from operator import itemgetter

from kvtag.v1 import store_pb2 as pb

from kvtag_store import errors
from kvtag_store.backends.base import BlockAddress
from kvtag_store.config import ServiceLimits

MAX_TEXT = 1024
MAX_LABELS = 64
MAX_LABEL_KEY = 128
MAX_BLOCK_SIZE = 1 << 20
MAX_LOOKAHEAD = 1024
MAX_ID = 256

_REQUIRED_NS = ("model_name", "weights_fingerprint", "kv_dtype", "kv_layout", "parallel_sharding")
_REQUIRED_MODE = ("key_scheme", "scheme_version", "hash_algorithm")
_KEY = itemgetter(1)
_KNOWN_DATA_PATHS = {pb.DATA_PATH_INLINE, pb.DATA_PATH_SHARED_MEMORY}


def session_id(value: str) -> str:
    if not value:
        raise errors.invalid_request("session_id is empty; pass the id OpenSession returned", "session_id")
    return value


def open_session(request: pb.OpenSessionRequest, limits: ServiceLimits) -> None:
    if not request.engine_id or len(request.engine_id) > MAX_ID:
        raise errors.invalid_request(
            f"engine_id must be 1..{MAX_ID} characters (a stable engine name such as host/pid or a pod name)",
            "engine_id",
        )
    violations: list[tuple[str, str]] = []
    if not request.HasField("namespace"):
        violations.append(("namespace", "required"))
    if not request.HasField("mode"):
        violations.append(("mode", "required"))
    ns, mode = request.namespace, request.mode
    if request.HasField("namespace"):
        violations += _text_fields("namespace", ns, _REQUIRED_NS, ("tenant",))
        if not 0 < ns.block_size <= MAX_BLOCK_SIZE:
            violations.append(("namespace.block_size", f"must be 1..{MAX_BLOCK_SIZE}, got {ns.block_size}"))
    if request.HasField("mode"):
        violations += _text_fields("mode", mode, _REQUIRED_MODE, ("seed_fingerprint",))
        if not 0 < mode.hash_block_size <= MAX_BLOCK_SIZE:
            violations.append(
                ("mode.hash_block_size", f"must be 1..{MAX_BLOCK_SIZE}, got {mode.hash_block_size}")
            )
        if mode.lookahead_tokens > MAX_LOOKAHEAD:
            violations.append(
                ("mode.lookahead_tokens", f"must be 0..{MAX_LOOKAHEAD}, got {mode.lookahead_tokens}")
            )
    if violations:
        raise errors.invalid_descriptor(violations)
    if len(request.labels) > MAX_LABELS or any(
        len(k) > MAX_LABEL_KEY or len(v) > MAX_TEXT for k, v in request.labels.items()
    ):
        raise errors.invalid_request(
            f"labels: at most {MAX_LABELS} entries, keys up to {MAX_LABEL_KEY} and values up to {MAX_TEXT} "
            "characters",
            "labels",
        )
    unknown = [p for p in request.data_paths if p not in _KNOWN_DATA_PATHS]
    if unknown:
        raise errors.invalid_request(
            f"data_paths has unknown values {unknown}; use DATA_PATH_INLINE (or leave it empty)", "data_paths"
        )
    probe_keys = request.probe_keys
    if len(probe_keys) != 2:
        raise errors.invalid_probe(f"got {len(probe_keys)} probe keys")
    for i, key in enumerate(probe_keys):
        if not key or len(key) > limits.max_key_bytes:
            raise errors.invalid_probe(
                f"probe_keys[{i}] is {len(key)} bytes (allowed 1..{limits.max_key_bytes})"
            )


def _text_fields(
    prefix: str, message: object, required: Sequence[str], optional: Sequence[str]
) -> list[tuple[str, str]]:
    violations: list[tuple[str, str]] = []
    for name in required:
        value = getattr(message, name)
        if not value:
            violations.append((f"{prefix}.{name}", "required"))
        elif len(value) > MAX_TEXT:
            violations.append((f"{prefix}.{name}", f"longer than {MAX_TEXT} characters"))
    for name in optional:
        if len(getattr(message, name)) > MAX_TEXT:
            violations.append((f"{prefix}.{name}", f"longer than {MAX_TEXT} characters"))
    return violations


def batch_size(field: str, count: int, limits: ServiceLimits) -> None:
    if count > limits.max_batch_items:
        raise errors.batch_too_large(field, count, limits.max_batch_items)


def addresses(
    result: list[BlockAddress], field: str, limits: ServiceLimits, key_length: int = 0
) -> list[BlockAddress]:
    """Check a batch of (group, key): lengths are checked in bulk (C-level map/min/max) and the
    offending item is searched for only on failure. `key_length` > 0 vouches that every key has
    that length (the Lookup fast path proved it while parsing)."""
    batch_size(field, len(result), limits)
    if key_length and key_length <= limits.max_key_bytes:
        return result
    if result:
        lengths = list(map(len, map(_KEY, result)))
        if min(lengths) == 0:
            raise errors.empty_key(f"{field}[{lengths.index(0)}].key")
        longest = max(lengths)
        if longest > limits.max_key_bytes:
            raise errors.key_too_large(
                f"{field}[{lengths.index(longest)}].key", longest, limits.max_key_bytes
            )
    return result


def key(address_key: bytes, field: str, limits: ServiceLimits) -> None:
    if not address_key:
        raise errors.empty_key(field)
    if len(address_key) > limits.max_key_bytes:
        raise errors.key_too_large(field, len(address_key), limits.max_key_bytes)


def packed_blocks(
    request: pb.LookupRequest | pb.GetRequest, limits: ServiceLimits, rpc: str = "Lookup"
) -> None:
    """Check the packed form of a Lookup (or GetReferences): whole keys of an allowed length, whole base
    keys, one form only."""
    if request.blocks:
        raise errors.invalid_request(
            f"a {rpc} carries either blocks or packed_blocks, not both; send all keys in one form",
            "packed_blocks",
        )
    packed_runs(request.packed_blocks, "packed_blocks", limits)


# At most 4,096 token ids a block (BlockRef.token_ids, uint32 each): beyond any block size vLLM uses.
MAX_TOKEN_ID_BYTES = 16 << 10


def token_ids(data: bytes, field: str) -> None:
    if len(data) % 4 or len(data) > MAX_TOKEN_ID_BYTES:
        raise errors.invalid_request(
            f"{field} is {len(data)} bytes: send uint32 token ids, 4 bytes each, at most "
            f"{MAX_TOKEN_ID_BYTES // 4} a block, or leave it empty",
            field,
        )


def packed_runs(runs: Sequence[pb.PackedBlocks], name: str, limits: ServiceLimits) -> int:
    """Check packed runs (whole keys of an allowed length, whole base keys, within the batch limit);
    returns how many keys they hold."""
    total = 0
    for index, run in enumerate(runs):
        field = f"{name}[{index}]"
        key_length, size = run.key_length, len(run.keys)
        if key_length == 0:
            raise errors.empty_key(f"{field}.key_length")
        if key_length > limits.max_key_bytes:
            raise errors.key_too_large(f"{field}.key_length", key_length, limits.max_key_bytes)
        if size % key_length:
            raise errors.invalid_request(
                f"{field}.keys is {size} bytes, not a whole number of {key_length}-byte keys",
                f"{field}.keys",
            )
        count = size // key_length
        base = len(run.base_keys)
        if base and (not count or base % count or base // count > limits.max_key_bytes):
            raise errors.invalid_request(
                f"{field}.base_keys is {base} bytes: leave it empty or send one base key of one length "
                f"(1..{limits.max_key_bytes} bytes) per key ({count} keys)",
                f"{field}.base_keys",
            )
        held = len(run.token_ids)
        if held and (held % count or (held // count) % 4 or held // count > MAX_TOKEN_ID_BYTES):
            raise errors.invalid_request(
                f"{field}.token_ids is {held} bytes: leave it empty or send the same number of uint32 "
                f"token ids (4 bytes each, at most {MAX_TOKEN_ID_BYTES // 4}) for each of the {count} keys",
                f"{field}.token_ids",
            )
        total += count
    batch_size(name, total, limits)
    return total
