"""data_path "MooncakeStoreConnector": vLLM's own connector moves the bytes, kvtag keeps the modes apart.

kvtag builds vLLM's MooncakeStoreConnector in this process and role, from a copy of the transfer config
whose `cache_prefix` is kvtag's namespace and mode id (after any prefix of the user's, "auto" included),
and hands it every hook. Engines in different modes therefore never address each other's objects, and
that holds while the kvtag store is unreachable too: the prefix is computed here, from the engine's own
config. The store only admits the mode (strict refuses, isolate warns), keeps the census, and shows it.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import logging
import sys
from collections.abc import Callable
from typing import Any

from kvtag_proto import ids
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole, SupportsHMA

from . import compat, conformance, namespace
from .companion_census import CompanionCensus
from .config import KvtagConfig, parse
from .logs import route_through_vllm
from .store_session import open_client, recompute_failed_loads

logger = logging.getLogger("kvtag.connector")

PEER = "MooncakeStoreConnector"
# Hooks kvtag itself implements for the companion; every other instance hook of the base classes that the
# peer has is the peer's own bound method (forward_hooks).
_OWN = frozenset(
    {
        "get_num_new_matched_tokens",
        "shutdown",
        "get_kv_connector_stats",
        "build_connector_meta",
        "request_finished",
        "request_finished_all_groups",
    }
)
# A refused engine's scheduler hooks (where the peer has them): the peer's scheduler never hears of a
# request, so it plans no load and no save; its worker gets valid, empty metadata every step.
_REFUSED: dict[str, Callable[..., Any]] = {
    "update_state_after_alloc": lambda *args, **kwargs: None,
    "request_finished": lambda *args, **kwargs: (False, None),
    "request_finished_all_groups": lambda *args, **kwargs: (False, None),
    "register_finished_partial_tail": lambda *args, **kwargs: False,
    "update_connector_output": lambda *args, **kwargs: None,
    "take_events": lambda *args, **kwargs: iter(()),
    "has_pending_push_work": lambda *args, **kwargs: False,
}


def wanted(kv_transfer_config: Any) -> bool:
    extra = getattr(kv_transfer_config, "kv_connector_extra_config", None) or {}
    return extra.get("data_path") == PEER


def peer_transfer_config(kv_transfer_config: Any, cache_prefix: str | None = None) -> Any:
    """The peer's KVTransferConfig: the user's, naming MooncakeStoreConnector, with `cache_prefix`."""
    extra = dict(kv_transfer_config.kv_connector_extra_config or {})
    if cache_prefix is not None:
        extra["cache_prefix"] = cache_prefix
    return dataclasses.replace(
        kv_transfer_config, kv_connector=PEER, kv_connector_module_path=None, kv_connector_extra_config=extra
    )


def peer_class() -> Any:
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    return KVConnectorFactory.get_connector_class(KVTransferConfig(kv_connector=PEER, kv_role="kv_both"))


def peer_metadata_class() -> Any:
    """The metadata class the peer's worker asserts on (MooncakeStoreConnectorMetadata, 0.32-0.34)."""
    return sys.modules[peer_class().__module__].MooncakeStoreConnectorMetadata


def peer_stats_data(data: dict[str, Any]) -> bool:
    """Whether stats data are the peer's (MooncakeStoreConnectorStats: lists of per-operation records)
    rather than kvtag's own counters (numbers)."""
    return all(isinstance(value, list) for value in data.values())


def peer_answer(hook: str, kv_transfer_config: Any, default: Any) -> Any:
    """A class-level hook of the peer, asked with the peer's config (its answer for this engine)."""
    method = getattr(peer_class(), hook, None)
    if method is None:
        return default
    return method(peer_transfer_config(kv_transfer_config))


def user_prefix(vllm_config: Any) -> str:
    """The cache_prefix the user set, with "auto" resolved as the peer resolves it where it can (0.34)."""
    prefix = str((vllm_config.kv_transfer_config.kv_connector_extra_config or {}).get("cache_prefix", ""))
    if prefix != "auto":
        return prefix
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store import worker
    except ImportError:
        return prefix
    resolve = getattr(worker, "_resolve_cache_prefix", None)
    return str(resolve(vllm_config)) if resolve is not None else prefix


def cache_prefix(user: str, namespace_id: str, mode_id: str) -> str:
    """kvtag's part names the namespace and mode; the peer appends `@model@tp_rank…@group@hash`."""
    own = f"kvtag-{namespace_id}-{mode_id}"
    return f"{user}.{own}" if user else own


class CompanionConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc, unused-ignore]  # Any without vLLM
    """KvtagConnector with data_path MooncakeStoreConnector (KvtagConnector.__new__ builds this)."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        route_through_vllm()
        self.conformance = conformance.checked()
        self.vllm_version = self.conformance.version
        super().__init__(vllm_config, role, kv_cache_config)
        self.config: KvtagConfig = dataclasses.replace(
            parse(self._kv_transfer_config.kv_connector_extra_config), key_scheme="vllm"
        )
        recompute_failed_loads(self.config, self._kv_transfer_config)
        geometry = namespace.resolve_geometry(vllm_config, kv_cache_config)
        self.block_size = geometry.block_size
        # The peer's keys are the core's block hashes: the mode is the core's (L from the core on 0.34+).
        self.lookahead_tokens = compat.core_lookahead_tokens(vllm_config)
        descriptor = namespace.namespace(vllm_config, kv_cache_config, self.config, geometry, 0)
        mode = namespace.hashing_mode(
            vllm_config, self.config, geometry.hash_block_size, self.lookahead_tokens
        )
        self.cache_prefix = cache_prefix(
            user_prefix(vllm_config), ids.namespace_id(descriptor), ids.mode_id(mode)
        )
        peer_config = copy.copy(vllm_config)
        peer_config.kv_transfer_config = peer_transfer_config(
            vllm_config.kv_transfer_config, self.cache_prefix
        )
        self.inner = peer_class()(peer_config, role, kv_cache_config)
        forward_hooks(self, self.inner)
        self.client = None
        self.census: CompanionCensus | None = None
        self.refused = False
        if role == KVConnectorRole.SCHEDULER and self.conformance.ok:
            # Admission before any request, as for the kvtag data path; an unreachable store only logs,
            # and the session is retried in the background while the peer serves.
            self.client = open_client(
                self.config,
                engine_id=namespace.engine_id(self.config, "scheduler"),
                namespace=descriptor,
                mode=mode,
                probe_keys=namespace.probe_keys(
                    vllm_config, self.config, geometry.hash_block_size, self.lookahead_tokens
                ),
                labels={
                    "vllm": self.vllm_version,
                    "role": "scheduler",
                    "connector": "kvtag",
                    "data_path": PEER,
                },
                moves_bytes=False,
            )
            self.census = CompanionCensus(
                self.client.report_usage,
                vllm_config,
                self.block_size,
                geometry.hash_block_size,
                self.lookahead_tokens,
            )
            self.refused = self.client.state.name == "REFUSED"
            if self.refused:
                for name, answer in _REFUSED.items():
                    if hasattr(self.inner, name):
                        setattr(self, name, answer)
                logger.error(
                    "kvtag: the store refused this engine's hashing mode (see the refusal above); it runs "
                    "without external KV: no lookups and no saves through %s",
                    PEER,
                )
        logger.info(
            "kvtag connector (%s): data path %s, cache_prefix %s, lookahead %d",
            role.name,
            PEER,
            self.cache_prefix,
            self.lookahead_tokens,
        )

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        if self.refused:
            return 0, False
        tokens, load_async = self.inner.get_num_new_matched_tokens(request, num_computed_tokens)
        if tokens is not None and self.census is not None:
            self.census.looked_up(request, num_computed_tokens, tokens)
        return tokens, load_async

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        """The peer's metadata, whose save jobs the census counts as stored; a refused engine's is the
        peer's type with nothing in it (the peer's scheduler never heard of a request)."""
        if self.refused:
            return peer_metadata_class()(set(), set())
        metadata = self.inner.build_connector_meta(scheduler_output)
        if self.census is not None:
            for req_id in getattr(scheduler_output, "finished_req_ids", ()):
                self.census.finished(req_id)
            self.census.offered(metadata)
        return metadata

    def request_finished(self, request: Any, block_ids: list[int]) -> Any:
        if self.census is not None:
            self.census.finished(request.request_id)
        return self.inner.request_finished(request, block_ids)

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]) -> Any:
        if self.census is not None:
            self.census.finished(request.request_id)
        return self.inner.request_finished_all_groups(request, block_ids)

    # The abstract hooks, defined so the class can be built; forward_hooks binds the peer's over them.
    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self.inner.update_state_after_alloc(request, blocks, num_external_tokens)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self.inner.start_load_kv(forward_context, **kwargs)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.inner.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        self.inner.save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)

    def wait_for_save(self) -> None:
        self.inner.wait_for_save()

    @property
    def requires_kv_delivery(self) -> bool:
        return bool(self.inner.requires_kv_delivery)

    def get_kv_connector_stats(self) -> Any:
        """The peer's transfer stats (its worker's): KvtagConnector.build_kv_connector_stats rebuilds
        them as the peer's class, so vLLM logs and exports them as for the peer alone."""
        return self.inner.get_kv_connector_stats()

    def shutdown(self) -> None:
        self.inner.shutdown()
        if self.client is not None:
            self.client.close()
            self.client = None


def forward_hooks(outer: Any, inner: Any) -> None:
    """Bind every instance hook of the connector base classes that `inner` has to `outer`, so a hook
    vLLM adds later reaches the peer too. Properties are forwarded by hand (they cannot be shadowed)."""
    for cls in (KVConnectorBase_V1, SupportsHMA):
        for name, member in vars(cls).items():
            if name.startswith("__") or name in _OWN or not inspect.isfunction(member):
                continue
            if hasattr(inner, name):
                setattr(outer, name, getattr(inner, name))
