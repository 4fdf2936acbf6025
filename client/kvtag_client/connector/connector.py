"""KvtagConnector: the vLLM KV connector class, wiring the scheduler and worker halves to the store."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from . import companion, compat, conformance, lookahead, namespace
from .config import ConnectorConfigError, KvtagConfig, parse
from .groups import classify
from .logs import route_through_vllm
from .metadata import KvtagConnectorMetadata
from .scheduler_side import SchedulerSide
from .stats import KvtagStats, StatsRecorder
from .store_session import open_client, recompute_failed_loads
from .worker_side import WorkerSide

if TYPE_CHECKING:
    from kvtag.v1 import store_pb2 as pb
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from kvtag_client.store import StoreClient

logger = logging.getLogger("kvtag.connector")


class KvtagConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc, unused-ignore]  # Any without vLLM installed
    """Stores and loads KV blocks (and Mamba boundary states) through a kvtag service."""

    def __new__(cls, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> Any:
        """`data_path: MooncakeStoreConnector` builds the companion (companion.py) instead."""
        if cls is KvtagConnector and companion.wanted(vllm_config.kv_transfer_config):
            return companion.CompanionConnector(vllm_config, role, kv_cache_config)
        return super().__new__(cls)

    @classmethod
    def supports_lookahead_block_hashes(cls, kv_transfer_config: Any) -> bool:
        """vLLM 0.34+ asks this while it builds its VllmConfig: kvtag opts into the core's lookahead
        hashing unless `lookahead: off` (in the companion mode, also only if the peer does). It never
        raises there: a config kvtag cannot parse answers False, and the connector's construction
        reports the error."""
        try:
            opted = lookahead.wanted(parse(getattr(kv_transfer_config, "kv_connector_extra_config", None)))
        except ConnectorConfigError:
            return False
        if opted and companion.wanted(kv_transfer_config):
            return bool(companion.peer_answer("supports_lookahead_block_hashes", kv_transfer_config, False))
        return opted

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        route_through_vllm()
        # Probes, not a version list: a failed probe turns the store off (every request a miss), a
        # series older than the tested ones is refused (conformance.py).
        self.conformance = conformance.checked()
        self.vllm_version = self.conformance.version
        super().__init__(vllm_config, role, kv_cache_config)
        self.config: KvtagConfig = parse(self._kv_transfer_config.kv_connector_extra_config)
        self.stats = StatsRecorder()
        self._client: StoreClient | None = None
        # Scheduler only: sessions in TP ranks 1..N-1's namespaces, to look up every rank's shard.
        self._peers: list[StoreClient] = []
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._reported_degraded = 0
        # A failed probe: no session, no keys, no saves; every hook answers "nothing external".
        self.store_off = not self.conformance.ok
        if self.store_off:
            self.lookahead = lookahead.LookaheadDecision(
                0, "the kvtag store is off (a conformance probe failed)"
            )
            return
        self.geometry = namespace.resolve_geometry(vllm_config, kv_cache_config)
        self.groups = classify(kv_cache_config)
        self.eagle_block_drop = compat.eagle_block_drop(vllm_config)
        self._siblings = compat.multi_connector_siblings()
        self.lookahead = lookahead.decide(vllm_config, self.config, self._siblings)
        recompute_failed_loads(self.config, self._kv_transfer_config)
        logger.info(
            "kvtag connector (%s): lookahead %d (%s)", role.name, self.lookahead.tokens, self.lookahead.reason
        )
        if role == KVConnectorRole.WORKER:
            self._worker = WorkerSide(
                kv_cache_config,
                self.client,
                self.stats,
                self.config.max_pending_save_bytes,
                self.config.save_batch_blocks,
                self.config.audit,
                tp_rank=compat.worker_tp_rank(namespace.tp_size(vllm_config)),
            )
        # Open the session at engine start, not at the first request, so a refusal or MODE_SPLIT
        # warning is logged and `diagnose` lists the engine before any traffic. Bounded by
        # rpc_timeout_ms; an unreachable store is logged and the engine starts degraded.
        self.client()
        if role == KVConnectorRole.SCHEDULER:
            self._peer_clients()  # with TP > 1, the other ranks' namespaces too

    # ---- mode ----------------------------------------------------------------------------------

    @property
    def lookahead_tokens(self) -> int:
        return self.lookahead.tokens

    def _reset_session(self) -> None:
        """Release the scheduler's leases, then close the session (its degraded calls counted first)."""
        if self._scheduler is not None:
            self._scheduler.close()
            self._scheduler = None
        self._count_degraded_calls()
        for client in self._clients():
            client.close()
        self._client = None
        self._peers = []
        self._reported_degraded = 0

    def namespace_descriptor(self, tp_rank: int | None = None) -> pb.NamespaceDescriptor:
        """The namespace of `tp_rank`'s KV shard; by default this worker's rank (the scheduler's: 0)."""
        if tp_rank is None:
            worker = self.role == KVConnectorRole.WORKER
            tp_rank = compat.worker_tp_rank(namespace.tp_size(self._vllm_config)) if worker else 0
        return namespace.namespace(
            self._vllm_config, self._kv_cache_config, self.config, self.geometry, tp_rank
        )

    def hashing_mode(self) -> pb.HashingMode:
        return namespace.hashing_mode(
            self._vllm_config, self.config, self.geometry.hash_block_size, self.lookahead.tokens
        )

    def probe_keys(self) -> list[bytes]:
        return namespace.probe_keys(
            self._vllm_config, self.config, self.geometry.hash_block_size, self.lookahead.tokens
        )

    def client(self) -> StoreClient:
        """The store client of this role (opened at construction; again after a session reset)."""
        if self._client is None:
            self._client = open_client(
                self.config,
                engine_id=namespace.engine_id(self.config, self.role.name.lower()),
                namespace=self.namespace_descriptor(),
                mode=self.hashing_mode(),
                probe_keys=self.probe_keys(),
                labels={"vllm": self.vllm_version, "role": self.role.name.lower(), "connector": "kvtag"},
            )
        return self._client

    def _peer_clients(self) -> list[StoreClient]:
        """The scheduler's sessions in TP ranks 1..N-1's namespaces: each rank stores its own shard,
        so the scheduler reports only what every rank's namespace holds."""
        if not self._peers:
            self._peers = [
                open_client(
                    self.config,
                    engine_id=namespace.engine_id(self.config, self.role.name.lower()),
                    namespace=self.namespace_descriptor(rank),
                    mode=self.hashing_mode(),
                    probe_keys=self.probe_keys(),
                    labels={
                        "vllm": self.vllm_version,
                        "role": self.role.name.lower(),
                        "connector": "kvtag",
                        "tp_rank": str(rank),
                    },
                )
                for rank in range(1, namespace.tp_size(self._vllm_config))
            ]
        return self._peers

    def _clients(self) -> list[StoreClient]:
        return [client for client in (self._client, *self._peers) if client is not None]

    def _sched(self) -> SchedulerSide:
        if self._scheduler is None:
            self._scheduler = SchedulerSide(
                self.config,
                self.geometry,
                self.groups,
                self.lookahead.tokens,
                self.eagle_block_drop,
                self.client(),
                self.stats,
                self._peer_clients(),
                *namespace.vllm_hashers(
                    self._vllm_config, self.config, self.geometry.hash_block_size, self.lookahead.tokens
                ),
            )
        return self._scheduler

    # ---- scheduler side ------------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if self.store_off:
            return 0, False
        scheduler = self._sched()
        tokens = scheduler.num_new_matched_tokens(request, num_computed_tokens)
        return tokens, tokens is not None and tokens > 0 and scheduler.async_loads

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if self.store_off:
            return
        block_ids = blocks.get_block_ids() if num_external_tokens > 0 else None
        self._sched().after_alloc(request, block_ids, num_external_tokens)

    def on_new_request(self, request: Request) -> None:
        if not self.store_off:
            self._sched().track(request)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        if self.store_off:
            return KvtagConnectorMetadata()
        return self._sched().build_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (list(block_ids),))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        if self.store_off:
            return False, None
        return self._sched().finished(request, block_ids), None

    def register_finished_partial_tail(
        self,
        request: Request,
        block_ids: tuple[list[int], ...],
        partial_tail_offloads: list[tuple[int, int, int]],
    ) -> bool:
        return not self.store_off and self._sched().partial_tail(request, partial_tail_offloads)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self._scheduler is None:
            return
        if connector_output.failed_recving:
            self._scheduler.loads_failed(set(connector_output.failed_recving))
        if connector_output.invalid_block_ids:
            self._scheduler.blocks_failed(set(connector_output.invalid_block_ids))
        if connector_output.finished_sending:
            self._scheduler.planner.released(set(connector_output.finished_sending))

    def has_pending_block_frees(self) -> bool:
        """Finish jobs free their pinned blocks within a step: wait for them rather than preempt."""
        return self._scheduler is not None and bool(self._scheduler.planner.pinned)

    def may_load_async(self, request: Request) -> bool:
        """0.34+: whether a hit may load asynchronously (as get_num_new_matched_tokens answers): only
        hybrid models load asynchronously. Cheap, as the scheduler asks on every enqueue."""
        return not self.store_off and self.groups.hybrid

    @property
    def requires_kv_delivery(self) -> bool:
        # A best-effort cache: a dropped save is a future cache miss, never a correctness problem.
        return False

    @classmethod
    def kv_cache_access(cls, kv_transfer_config: Any) -> Any:
        """0.34+: the worker copies blocks with torch ops in this process (device_copy), so any
        allocation of the extensible KV cache works; nothing is registered with RDMA or exported. The
        companion answers as the peer does (it registers the KV cache with its transfer engine)."""
        from vllm.config import kv_transfer

        types: Any = kv_transfer  # KVCacheAccess exists from 0.34, the only series that asks
        if companion.wanted(kv_transfer_config):
            return companion.peer_answer(
                "kv_cache_access", kv_transfer_config, types.KVCacheAccess.IN_PROCESS
            )
        return types.KVCacheAccess.IN_PROCESS

    # ---- worker side ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        if self._worker is not None:
            self._worker.register(kv_caches)

    # ---- sleep mode (vLLM 0.33+) ---------------------------------------------------------------

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """True where vLLM calls unregister/restore_kv_caches around sleep (compat.sleep_hooks_called);
        the companion answers as the peer does."""
        if companion.wanted(kv_transfer_config):
            return bool(companion.peer_answer("supports_sleep_mode", kv_transfer_config, False))
        return compat.sleep_hooks_called()

    def unregister_kv_caches(self) -> None:
        """Before sleep: the worker forgets its views of the KV memory sleep is about to free."""
        if self._worker is not None:
            self._worker.unregister()

    def restore_kv_caches(self) -> None:
        """After wake-up: the worker's saves and loads use the runner's (remapped) KV tensors again."""
        if self._worker is not None:
            self._worker.restore()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if self._worker is None or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if isinstance(meta, KvtagConnectorMetadata):
            self._worker.start(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        if self._worker is None or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if isinstance(meta, KvtagConnectorMetadata):
            self._worker.finish_step(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._worker is None:
            return None, None
        sending = self._worker.take_finished_sending()
        recving, failed = self._worker.take_recving()
        return (sending or None), (recving | failed or None)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if self._worker is None:
            return KVConnectorTransferResults()
        recving, failed = self._worker.take_recving()
        return KVConnectorTransferResults(
            finished_sending=self._worker.take_finished_sending(),
            # Failed receives are also finished: the scheduler releases the request and recomputes.
            finished_recving=recving | failed,
            failed_recving=failed,
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self._worker is None:
            return set()
        return self._worker.take_load_errors()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        self._reset_session()

    # ---- stats ---------------------------------------------------------------------------------

    def _count_degraded_calls(self) -> None:
        """Take the client's new degraded calls: the client counts each failed or skipped call once,
        at the call; nothing in the connector counts them again."""
        clients = self._clients()
        if clients:
            degraded = sum(int(client.counters.snapshot()["degraded_calls"]) for client in clients)
            self.stats.add("degraded_calls", degraded - self._reported_degraded)
            self._reported_degraded = degraded

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        self._count_degraded_calls()
        return self.stats.take()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        """kvtag's counters, or, for a companion engine (whose stats are its peer's), the peer's class:
        vLLM passes only the data, so its shape tells them apart (kvtag's values are numbers, the
        peer's are lists of per-operation records)."""
        if data and companion.peer_stats_data(data):
            stats: KVConnectorStats | None = companion.peer_class().build_kv_connector_stats(data)
            return stats
        return KvtagStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> Any:
        """A companion engine's Prometheus metrics are the peer's (they read its stats)."""
        if companion.wanted(vllm_config.kv_transfer_config):
            return companion.peer_class().build_prom_metrics(
                vllm_config, metric_types, labelnames, per_engine_labelvalues
            )
        return super().build_prom_metrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
