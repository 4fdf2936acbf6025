"""Worker-side connector: copies blocks between the engine's KV tensors and the store.

Order within a step (vLLM 0.32/0.33 model runner): bind metadata, start_load_kv (before the forward
when the step has synchronous loads, otherwise after it), forward, drafter, wait_for_save,
get_finished. Blocks a job reads are never written by this step: saves read blocks completed in an
earlier step (or pinned finished requests), and loads write blocks freshly allocated for them.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from kvtag_client.items import PutItem, SizedItem

from .blocks import LayerView, block_nbytes, gather, gather_into, layer_views, scatter, scatter_from
from .device_copy import CudaCopier, copier_for
from .metadata import BlockTransfer, KvtagConnectorMetadata, SaveJob
from .saver import PendingPut, Saver
from .stats import StatsRecorder

if TYPE_CHECKING:
    from kvtag_client.store import StoreClient

logger = logging.getLogger("kvtag.connector")


class WorkerSide:
    def __init__(
        self,
        kv_cache_config: Any,
        client_getter: Callable[[], StoreClient],
        stats: StatsRecorder,
        max_pending_save_bytes: int,
        save_batch_blocks: int,
        audit: bool = False,
        tp_rank: int = 0,
    ) -> None:
        """`tp_rank`: this worker's tensor-parallel rank; its client is a session in that rank's namespace."""
        self._kv_cache_config = kv_cache_config
        self._tp_rank = tp_rank
        self._client = client_getter
        self._stats = stats
        self._views: list[list[LayerView]] = []
        # Sleep mode: while unregistered, weak references to the registered tensors (the runner keeps
        # them; cuMem remaps their memory at wake-up) and no view of them.
        self._asleep: dict[str, Any] | None = None
        # KV caches on a CUDA device: copies on a side stream into pinned arena slots.
        self.copier: CudaCopier | None = None
        self.saver = Saver(client_getter, stats, max_pending_save_bytes, save_batch_blocks, audit)
        self._lock = threading.Lock()
        self._finished_sending: set[str] = set()
        self._load_errors: set[int] = set()
        self._finished_recving: set[str] = set()
        self._failed_recving: set[str] = set()
        self._started: KvtagConnectorMetadata | None = None

    def register(self, kv_caches: Mapping[str, Any]) -> None:
        group_layers = [list(group.layer_names) for group in self._kv_cache_config.kv_cache_groups]
        self._views = layer_views(kv_caches, group_layers, int(self._kv_cache_config.num_blocks))
        self._asleep = None
        if self.copier is None:
            self.copier = copier_for(self._views)

    # ---- sleep mode ----------------------------------------------------------------------------

    @property
    def registered(self) -> bool:
        return bool(self._views)

    def unregister(self) -> None:
        """Before sleep frees the KV memory: forget every view of it (idempotent). Jobs already with the
        saver hold host copies, not KV memory, so they are committed as usual."""
        if self._asleep is not None or not self._views:
            return
        if self.copier is not None:
            self.copier.drain()  # no copy still reads or writes the memory sleep frees
        self._asleep = {view.name: weakref.ref(view.tensor) for views in self._views for view in views}
        self._views = []
        self._started = None

    def restore(self) -> bool:
        """After wake-up: views over the runner's KV tensors again (idempotent). False, and the worker
        stays unregistered (saves dropped, loads failed: recomputed), if the runner let them go."""
        if self._asleep is None:
            return True
        tensors = {name: ref() for name, ref in self._asleep.items()}
        missing = sorted(name for name, tensor in tensors.items() if tensor is None)
        if missing:
            logger.error(
                "kvtag: the KV caches registered before sleep are gone (%s...); this worker neither "
                "saves nor loads until register_kv_caches is called again",
                missing[0],
            )
            return False
        caches = _regroup(tensors)
        group_layers = [list(group.layer_names) for group in self._kv_cache_config.kv_cache_groups]
        self._views = layer_views(caches, group_layers, int(self._kv_cache_config.num_blocks))
        self._asleep = None
        return True

    # ---- per step ------------------------------------------------------------------------------

    def start(self, meta: KvtagConnectorMetadata) -> None:
        """Copy out this step's pre-forward saves, then load, so a load never clobbers a save's source."""
        if self._started is meta:
            return
        self._started = meta
        if self.copier is not None:
            self.copier.begin()
        for job in meta.saves:
            if not job.after_forward:
                self._save(job)
        for load in meta.loads:
            failed = self._load(load.req_id, load.blocks, load.leases_of(self._tp_rank))
            with self._lock:
                if load.asynchronous:
                    (self._failed_recving if failed else self._finished_recving).add(load.req_id)
                elif failed:
                    self._load_errors |= failed
        if self.copier is not None and meta.loads:
            self.copier.end_loads()

    def finish_step(self, meta: KvtagConnectorMetadata) -> None:
        """After the forward: copy the Mamba states this step wrote and handed off."""
        self.start(meta)  # a step whose start_load_kv was skipped still runs its saves
        if self.copier is not None and any(job.after_forward for job in meta.saves):
            self.copier.begin()  # after the forward that wrote the handed-off states
        for job in meta.saves:
            if job.after_forward:
                self._save(job)

    def _save(self, job: SaveJob) -> None:
        transfers = [t for t in job.blocks if t.group < len(self._views) and self._views[t.group]]
        if self._asleep is not None and job.blocks:
            self._stats.add("dropped_saves", len(job.blocks))  # asleep: no KV memory to read
        client = self._client()
        # The blocks' token ids, when the store asked for them (its KV events); none otherwise.
        tokens = [t.tokens for t in transfers] if any(t.tokens for t in transfers) else []
        if transfers and client.data_path == "shared_memory":
            self._save_shared(job.req_id, transfers, tokens, client)
        elif transfers:
            items = [
                PutItem(t.group, t.key, gather(self._views[t.group], t.block_id), t.base_key)
                for t in transfers
            ]
            self.saver.submit(PendingPut(job.req_id, items, token_ids=tokens))
        if job.audit:
            engine = [
                (t.group, t.key, gather(self._views[t.group], t.block_id))
                for t in job.audit
                if t.group < len(self._views) and self._views[t.group]
            ]
            self.saver.submit_audit(job.req_id, engine)
        if job.finish:
            # The bytes are on the host now: the pinned blocks can be freed.
            with self._lock:
                self._finished_sending.add(job.req_id)

    def _save_shared(
        self, req_id: str, transfers: list[BlockTransfer], tokens: list[bytes], client: StoreClient
    ) -> None:
        """Gather the blocks straight into store slots now (the blocks may be reused after this step);
        the saver commits them in the background."""
        sized = [SizedItem(t.group, t.key, block_nbytes(self._views[t.group]), t.base_key) for t in transfers]
        nbytes = sum(item.length for item in sized)
        if not self.saver.admit(nbytes, len(sized)):
            return
        reservation = client.reserve(sized, tokens)
        if reservation is None:
            self.saver.withdraw(nbytes)
            self._stats.add("dropped_saves", len(sized))
            return

        copier = self.copier

        def fill(index: int, slot: memoryview) -> None:
            transfer = transfers[index]
            if copier is not None:
                copier.save_block(self._views[transfer.group], transfer.block_id, slot)
            else:
                gather_into(self._views[transfer.group], transfer.block_id, slot)

        client.write_slots(reservation, fill)
        self.saver.enqueue(PendingPut(req_id, [], reservation), nbytes)

    def _load(self, req_id: str, transfers: list[BlockTransfer], leases: tuple[str, ...]) -> set[int]:
        """Scatter stored blocks into their engine blocks; returns the block ids that failed."""
        client = self._client()
        blocks = [(t.group, t.key) for t in transfers]
        loaded = [False] * len(transfers)
        if client.data_path == "shared_memory":
            copier = self.copier

            def sink(index: int, source: memoryview) -> bool:
                transfer = transfers[index]
                views = self._views[transfer.group] if transfer.group < len(self._views) else []
                if not views:
                    return False
                if copier is not None:
                    return copier.load_block(views, transfer.block_id, source)
                return scatter_from(views, transfer.block_id, source)

            loaded = client.get_into(blocks, leases, sink)
        else:
            values = client.get(blocks, leases)
            for index, transfer in enumerate(transfers):
                value = values[index] if index < len(values) else None
                views = self._views[transfer.group] if transfer.group < len(self._views) else []
                loaded[index] = value is not None and bool(views) and scatter(views, transfer.block_id, value)
        failed: set[int] = set()
        loaded_bytes = 0
        for index, transfer in enumerate(transfers):
            if not loaded[index]:
                failed.add(transfer.block_id)
                continue
            loaded_bytes += block_nbytes(self._views[transfer.group])
        self._stats.add("loaded_blocks", len(transfers) - len(failed))
        self._stats.add("loaded_bytes", loaded_bytes)
        if failed:
            self._stats.add("load_errors", len(failed))
            logger.warning(
                "kvtag: %d block(s) of request %s failed to load; vLLM recomputes them", len(failed), req_id
            )
        return failed

    # ---- reports -------------------------------------------------------------------------------

    def take_finished_sending(self) -> set[str]:
        with self._lock:
            done, self._finished_sending = self._finished_sending, set()
        return done

    def take_recving(self) -> tuple[set[str], set[str]]:
        """(loaded, failed) asynchronous loads since the last call."""
        with self._lock:
            done, failed = self._finished_recving, self._failed_recving
            self._finished_recving, self._failed_recving = set(), set()
        return done, failed

    def take_load_errors(self) -> set[int]:
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def close(self) -> None:
        self.saver.close()
        if self.copier is not None:
            self.copier.close()


def _regroup(tensors: Mapping[str, Any]) -> dict[str, list[Any]]:
    """{"layer[i]": tensor} (LayerView names) back to {"layer": [tensors in index order]}."""
    caches: dict[str, list[Any]] = {}
    for name in sorted(tensors, key=lambda n: (n.rsplit("[", 1)[0], int(n.rsplit("[", 1)[1][:-1]))):
        caches.setdefault(name.rsplit("[", 1)[0], []).append(tensors[name])
    return caches
