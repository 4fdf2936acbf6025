"""The one place that knows how the hooks of vLLM versions differ (which versions run: conformance.py)."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("kvtag.connector")


def vllm_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def parse_series(version: str) -> tuple[int, int] | None:
    """(major, minor) of a version string such as "0.32.0" or "0.33.1rc1+cpu"; None if unparsable."""
    parts = version.split(".")
    if len(parts) < 2:
        return None
    try:
        return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or "x")
    except ValueError:
        return None


def series() -> tuple[int, int]:
    """The running vLLM's (major, minor); (0, 0) when its version does not parse."""
    return parse_series(vllm_version()) or (0, 0)


def register_connector(name: str, module_path: str, class_name: str) -> None:
    """Register a connector class with vLLM's factory by name, once per process: 0.32's
    register_connector raises for a known name and only its private `_registry` tells."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if name in KVConnectorFactory._registry:
        return
    KVConnectorFactory.register_connector(name, module_path, class_name)


def worker_tp_rank(tp_size: int) -> int:
    """This worker process's tensor-parallel rank, from vLLM's parallel groups. Without them (a
    connector built outside an engine, as in the connector suite) it is 0, and says so: right for one
    rank, while with several every worker would use rank 0's namespace."""
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception as exc:
        logger.log(
            logging.WARNING if tp_size > 1 else logging.INFO,
            "kvtag: this worker's tensor-parallel rank is unknown (%s: %s); using rank 0 of %d",
            type(exc).__name__,
            exc,
            tp_size,
        )
        return 0


def sleep_hooks_called() -> bool:
    """Whether this vLLM's GPU worker calls unregister_kv_caches before sleep and restore_kv_caches
    after wake-up (0.33+, where the base class declares them). 0.32 has no such hooks: a connector there
    cannot follow sleep's remap."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    return hasattr(KVConnectorBase_V1, "unregister_kv_caches")


def boundary_state_offloads(scheduler_output: Any) -> dict[str, list[tuple[int, int, int]]]:
    """Mamba align-mode boundary states the core hands off this step (read inside build_connector_meta).

    0.32/0.33 put them on `scheduler_output.kv_connector_block_state` and clear it right after
    build_connector_meta, so this must be read there and nowhere else.
    """
    state = getattr(scheduler_output, "kv_connector_block_state", None)
    if state is None:
        return {}
    return dict(getattr(state, "boundary_state_offloads", {}) or {})


def scheduled_block_ids(scheduler_output: Any, req_id: str) -> tuple[list[int], ...] | None:
    """Block table (one list per KV cache group) of a request scheduled this step."""
    state = getattr(scheduler_output, "kv_connector_block_state", None)
    if state is None:
        return None
    result = state.get_block_ids(req_id)
    return None if result is None else tuple(list(ids) for ids in result)


def eagle_block_drop(vllm_config: Any) -> bool:
    """Whether the core drops a hit's trailing block for the drafter (vLLM's own rule, per version).

    0.33 narrows the rule to drafters whose KV reads the next token (not DFlash/DSpark) and turns
    the drop off when the core hashes with lookahead itself: on 0.33 never with a KV connector, on
    0.34+ whenever the connector opted in (num_hash_lookahead_tokens > 0), as its Scheduler does.
    """
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None or not spec.use_eagle_block_drop():
        return False
    return core_lookahead_tokens(vllm_config) == 0


def core_decides_lookahead() -> bool:
    """Whether vLLM asks connectors to opt into its lookahead hashing (0.34+): the base class's
    `supports_lookahead_block_hashes` is then a classmethod the VllmConfig calls with the
    KVTransferConfig, and `num_hash_lookahead_tokens` is what the core hashes with."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    hook = inspect.getattr_static(KVConnectorBase_V1, "supports_lookahead_block_hashes", None)
    return isinstance(hook, classmethod)


def core_lookahead_tokens(vllm_config: Any) -> int:
    """The lookahead L the core hashes request.block_hashes with (0 on 0.32/0.33 with a connector)."""
    return int(getattr(vllm_config, "num_hash_lookahead_tokens", 0) or 0)


def vllm_has_lookahead_hasher() -> bool:
    """Whether vLLM's get_request_block_hasher takes a lookahead (0.33+)."""
    from vllm.v1.core import kv_cache_utils

    return (
        "num_hash_lookahead_tokens" in inspect.signature(kv_cache_utils.get_request_block_hasher).parameters
    )


def prefill_lookahead_tokens(vllm_config: Any) -> int:
    return int(getattr(vllm_config, "num_prefill_lookahead_tokens", 0))


def core_lookahead_disabled(vllm_config: Any) -> bool:
    """True when the operator turned lookahead block hashes off in vLLM itself (0.33+ option)."""
    for cfg in (getattr(vllm_config, "cache_config", None), getattr(vllm_config, "speculative_config", None)):
        if cfg is not None and bool(getattr(cfg, "disable_lookahead_block_hashes", False)):
            return True
    return False


# One key_scheme=vllm lookahead key per hash block of a request, given the keys derived so far.
LookaheadHasher = Callable[[Any, list[bytes]], list[bytes]]


def vllm_lookahead_hasher(hash_fn: Any, hash_block_size: int, lookahead: int) -> LookaheadHasher | None:
    """key_scheme=vllm keys with `lookahead` tokens, where vLLM defines them itself, else None.

    0.33's kv_cache_utils hashes with lookahead (get_request_block_hasher's num_hash_lookahead_tokens):
    each block's hash covers the L tokens after it as extra keys, chained from the previous lookahead
    hash. On 0.33 kvtag's lookahead keys are those very hashes (what a 0.33 engine hashes, and
    publishes in its KV events, with lookahead on). 0.32 has no lookahead hash: None, and the key is
    the legacy hash followed by the L successor token ids (namespace.vllm_lookahead_key).
    """
    if lookahead <= 0 or not vllm_has_lookahead_hasher():
        return None
    from vllm.v1.core import kv_cache_utils

    # Any: 0.32's signature (checked by typecheck-vllm) has no lookahead argument.
    make_hasher: Any = kv_cache_utils.get_request_block_hasher
    hasher = make_hasher(hash_block_size, hash_fn, lookahead)

    return _over_chain(hasher)


def vllm_legacy_hasher(hash_fn: Any, hash_block_size: int) -> LookaheadHasher:
    """vLLM's legacy (L=0) block hashes of a request, chained from `chain`: on 0.34+ with lookahead the
    request's own block_hashes are lookahead hashes, and these are the base keys of cross-mode accounting."""
    from vllm.v1.core import kv_cache_utils

    return _over_chain(kv_cache_utils.get_request_block_hasher(hash_block_size, hash_fn))


def _over_chain(hasher: Any) -> LookaheadHasher:
    def new_keys(request: Any, chain: list[bytes]) -> list[bytes]:
        return [bytes(h) for h in hasher(_ChainRequest(request, chain))]

    return new_keys


class _ChainRequest:
    """A request as vLLM's hasher reads it, with a chain of kvtag's as its block_hashes (the request's
    own are the core's: legacy on 0.32/0.33 with a connector, lookahead on 0.34+ when opted in)."""

    __slots__ = ("_request", "block_hashes")

    def __init__(self, request: Any, chain: list[bytes]) -> None:
        self._request = request
        self.block_hashes = chain

    def __getattr__(self, name: str) -> Any:
        return getattr(self._request, name)


def multi_connector_siblings(max_depth: int = 12) -> list[dict[str, Any]] | None:
    """Child configs of the MultiConnector constructing us, or None when we are not a child.

    vLLM 0.32/0.33's MultiConnector gives each child a config copy without its siblings and never
    asks children about lookahead, so the only way to honour "lookahead only when every child supports
    it" there is to read the parent's config from the constructing frame. (0.34's MultiConnector asks
    every child's classmethod itself; the child's num_hash_lookahead_tokens is then already the answer.)
    """
    frame = inspect.currentframe()
    try:
        depth = 0
        current = frame.f_back if frame is not None else None
        while current is not None and depth < max_depth:
            owner = current.f_locals.get("self")
            if type(owner).__name__ == "MultiConnector" or (
                owner is not None and any(k.__name__ == "MultiConnector" for k in type(owner).__mro__)
            ):
                parent = current.f_locals.get("vllm_config")
                ktc = getattr(parent, "kv_transfer_config", None)
                extra = getattr(ktc, "kv_connector_extra_config", None) or {}
                return list(extra.get("connectors", []))
            current = current.f_back
            depth += 1
        return None
    finally:
        del frame


def connector_supports_lookahead(child_config: dict[str, Any]) -> bool:
    """Whether the connector a MultiConnector child config names declares lookahead support: a
    classmethod (0.34+, every connector has one, default False) is asked with the child's config; a plain
    attribute (kvtag's own on 0.32/0.33) is read."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        config = KVTransferConfig(**child_config)
        cls = KVConnectorFactory.get_connector_class(config)
        hook = getattr(cls, "supports_lookahead_block_hashes", False)
        return bool(hook(config) if callable(hook) else hook)
    except Exception:
        return False


class PlainRequest:
    """Token ids as a request with no extras (no LoRA, salt, multimodal or embeds), chained from
    `block_hashes`, for vLLM's own hasher: the probe keys and the conformance vectors."""

    def __init__(self, tokens: list[int], block_hashes: list[bytes] | None = None) -> None:
        self.all_token_ids = tokens
        self._all_token_ids = tokens  # what 0.34's hasher slices
        self.num_tokens = len(tokens)
        self.block_hashes: list[bytes] = list(block_hashes or [])
        self.mm_features: list[Any] = []
        self.lora_request = None
        self.cache_salt = None
        self.prompt_embeds = None
