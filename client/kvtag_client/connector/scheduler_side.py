"""Scheduler-side connector: external hit lengths and load plans; saves are planned in planning.py."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from kvtag.v1 import store_pb2 as pb

from ..store import LookupResult, PackedKeys, StoreClient
from . import compat
from .config import KvtagConfig
from .cross_mode import CrossModeWarner
from .groups import CacheGroups
from .metadata import BlockTransfer, KvtagConnectorMetadata, LoadJob
from .namespace import Geometry
from .planning import SavePlanner
from .stats import StatsRecorder
from .tracking import Hit, LoadPlan, RequestKeys, RequestState

logger = logging.getLogger("kvtag.connector")

# Lookups in flight at once: one slow Lookup does not queue the next requests' behind it.
_LOOKUP_THREADS = 4


class SchedulerSide:
    def __init__(
        self,
        config: KvtagConfig,
        geometry: Geometry,
        groups: CacheGroups,
        lookahead: int,
        eagle_block_drop: bool,
        client: StoreClient,
        stats: StatsRecorder,
        peers: Sequence[StoreClient] = (),
        lookahead_hasher: compat.LookaheadHasher | None = None,
        legacy_hasher: compat.LookaheadHasher | None = None,
    ) -> None:
        """`client` is a session in TP rank 0's namespace; `peers` one in each further rank's, in
        rank order: every rank stores its own KV shard, so a hit is what every rank holds.
        `lookahead_hasher` / `legacy_hasher`: key_scheme=vllm's hashers (namespace.vllm_hashers)."""
        self.config = config
        self.geometry = geometry
        self.groups = groups
        self.lookahead = lookahead
        self.eagle_block_drop = eagle_block_drop
        self.clients = [client, *peers]
        self.stats = stats
        self.lookahead_hasher = lookahead_hasher
        self.legacy_hasher = legacy_hasher
        self._requests: dict[str, RequestState] = {}
        self.planner = SavePlanner(config, geometry, groups, stats, lambda: client.wants_token_ids)
        self._ready_loads: list[LoadJob] = []
        # req_id -> {engine block id: request block index} of this step's synchronous loads, to map
        # the block ids a worker reports failed back to the blocks to save again.
        self._sync_loads: dict[str, dict[int, int]] = {}
        # Lookups run here, so a slow store holds up only the requests waiting for it.
        self._lookup_threads = ThreadPoolExecutor(_LOOKUP_THREADS, thread_name_prefix="kvtag-lookup")
        self.cross_mode = CrossModeWarner(self._lookup_threads.submit)

    @property
    def async_loads(self) -> bool:
        """Hybrid models load asynchronously: only failed_recving can report a failed load there."""
        return self.groups.hybrid

    # ---- tracking ------------------------------------------------------------------------------

    def track(self, request: Any) -> RequestState:
        tracked = self._requests.get(request.request_id)
        if tracked is None or tracked.keys.request is not request:
            keys = RequestKeys(
                request,
                self.geometry,
                self.lookahead,
                self.config.key_scheme,
                self.lookahead_hasher,
                self.legacy_hasher,
            )
            tracked = RequestState(keys=keys)
            self._requests[request.request_id] = tracked
            if not keys.encodable:
                self.stats.add("unencodable_requests")
                logger.warning(
                    "kvtag: request %s has extra keys with no canonical encoding; it is neither "
                    "stored nor loaded",
                    request.request_id,
                )
        return tracked

    # ---- hits ----------------------------------------------------------------------------------

    def num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> int | None:
        """External hit tokens, or None while the request's Lookup is still running: vLLM then
        schedules other requests and asks again next step."""
        tracked = self.track(request)
        keys = tracked.keys
        if not keys.encodable or tracked.load_failed:
            return 0
        keys.refresh()
        block = self.geometry.block_size
        start = num_computed_tokens // block
        # At least one token must be computed to sample from: cap at num_tokens - 1, like the local cache.
        max_blocks = (request.num_tokens - 1) // block
        end = min(keys.num_keyed_blocks(), max_blocks)
        if end <= start:
            self._drop_plan(tracked)
            return 0
        query = (start, end)
        if tracked.plan is not None and tracked.plan.query == query:
            return tracked.plan.num_blocks * block
        self._drop_plan(tracked)
        hit = self._answer(tracked, keys, query)
        if hit is None:
            return None
        if hit.num_blocks == 0:
            self._release(hit.leases)
            return 0
        tracked.plan = LoadPlan(start, hit.num_blocks, hit.leases, query)
        return hit.num_blocks * block

    def _answer(self, tracked: RequestState, keys: RequestKeys, query: tuple[int, int]) -> Hit | None:
        """The Lookup's hit for `query`, run on the lookup threads: waited for up to lookup_wait_ms
        when it starts, so a store that answers in time costs no step; a slower one (a stalled
        store, a first Lookup of blocks over Mooncake) leaves the step to the other requests, and
        later steps take the answer once it is there."""
        if tracked.pending is not None and tracked.pending[0] != query:
            self._abandon(tracked)
        wait = 0.0
        if tracked.pending is None:
            future = self._lookup_threads.submit(self._lookup, keys, *query)
            tracked.pending = (query, future)
            wait = self.config.lookup_wait_ms / 1000.0
        future = tracked.pending[1]
        try:
            hit = future.result(timeout=wait)
        except TimeoutError:
            self.stats.add("lookups_waited")
            return None
        except Exception:  # a bug, not the store (StoreClient does not raise): recompute
            logger.exception("kvtag: a lookup failed; the request computes its prefix")
            hit = Hit(0, ())
        tracked.pending = None
        return hit

    def _abandon(self, tracked: RequestState) -> None:
        """Forget a running Lookup; its leases are released once it answers."""
        if tracked.pending is None:
            return
        future = tracked.pending[1]
        tracked.pending = None

        def release(done: Future[Hit]) -> None:
            if not done.cancelled() and done.exception() is None:
                self._release(done.result().leases)

        future.add_done_callback(release)

    def _lookup(self, keys: RequestKeys, start: int, end: int) -> Hit:
        """The hit every TP rank can load: rank 0's Lookup over the query, each further rank's over the
        KV prefix the ranks before it hold (one Lookup per rank; a single rank is the common case)."""
        kv_group = self.groups.kv_groups[0] if self.groups.kv_groups else 0
        groups = [kv_group, *self.groups.state_groups]
        self.stats.add("lookups")
        count = end - start
        span = count  # the KV prefix every rank asked so far holds
        answers: list[tuple[int, list[int]]] = []  # per rank asked: (blocks asked, statuses)
        leases: list[tuple[str, ...]] = []
        for client in self.clients:
            if span == 0:
                leases.append(())
                continue
            result = self._lookup_rank(client, keys, groups, start, start + span)
            self.cross_mode.observe(client, result.statuses)
            leases.append(result.leases)
            if len(result.statuses) != len(groups) * span:  # never from StoreClient
                span = 0
                continue
            answers.append((span, result.statuses))
            span = min(result.prefix_length, span)
        kv_hits = span
        if self.lookahead == 0 and self.eagle_block_drop:
            # Legacy keys cannot prove the drafter KV of a hit's last block: drop it, like vLLM does.
            kv_hits = max(0, kv_hits - 1)
        usable = kv_hits
        if self.groups.hybrid:
            # A hybrid hit ends only where every state group of every rank holds the state there.
            states = range(1, len(groups))

            def stored(n: int) -> bool:
                return all(s[asked * i + n - 1] == pb.HIT for asked, s in answers for i in states)

            usable = next((n for n in range(kv_hits, 0, -1) if stored(n)), 0)
        self.stats.add("hit_blocks", usable)
        self.stats.add("miss_blocks", count - usable)
        return Hit(usable, tuple(leases))

    def _lookup_rank(
        self, client: StoreClient, keys: RequestKeys, groups: list[int], start: int, end: int
    ) -> LookupResult:
        """One Lookup of the KV group's keys, then each state group's, in the packed form: this runs
        inside the scheduler's step, so no Python object is built per key."""
        packed = keys.packed(start, end)
        if packed is not None:
            joined, key_length, bases = packed
            runs = [PackedKeys(group, joined, key_length, bases) for group in groups]
            return client.lookup_packed(runs, lease_ms=self.config.lease_ms)
        # keys of several lengths: block by block
        refs = [(group, keys.key(j), keys.base_key(j)) for group in groups for j in range(start, end)]
        return client.lookup(refs, lease_ms=self.config.lease_ms)

    def _release(self, leases: tuple[tuple[str, ...], ...]) -> None:
        for client, rank_leases in zip(self.clients, leases, strict=False):
            if rank_leases:
                client.release(rank_leases)

    def _drop_plan(self, tracked: RequestState) -> None:
        if tracked.plan is not None and not tracked.load_confirmed:
            self._release(tracked.plan.leases)
        tracked.plan = None
        tracked.load_confirmed = False

    def after_alloc(
        self, request: Any, block_ids: tuple[list[int], ...] | None, num_external_tokens: int
    ) -> None:
        tracked = self.track(request)
        if num_external_tokens <= 0 or tracked.plan is None:
            self._drop_plan(tracked)
            computed = request.num_computed_tokens
        else:
            plan = tracked.plan
            usable = num_external_tokens // self.geometry.block_size
            plan.num_blocks = min(plan.num_blocks, usable)
            tracked.load_confirmed = True
            self.stats.add("hit_tokens", num_external_tokens)
            computed = (plan.start_block + plan.num_blocks) * self.geometry.block_size
            if self.async_loads and block_ids is not None:
                # The request waits (WAITING_FOR_REMOTE_KVS) and is not scheduled until the load is
                # reported, so the job goes out with the next metadata, whatever is scheduled.
                job = self._load_job(request.request_id, tracked, block_ids)
                job.asynchronous = True
                self._ready_loads.append(job)
                tracked.plan = None
                tracked.load_confirmed = False
        # Blocks before this point are local or external hits: someone already stored them.
        tracked.next_save_block = max(tracked.next_save_block, computed // self.geometry.block_size)

    def loads_failed(self, req_ids: set[str]) -> None:
        for req_id in req_ids:
            tracked = self._requests.get(req_id)
            if tracked is not None:
                tracked.load_failed = True

    def blocks_failed(self, block_ids: set[int]) -> None:
        """Blocks of this step's synchronous loads that a worker (any TP rank) could not load: vLLM
        recomputes the request from the first of them, so its saves restart there and the rank that
        lacked the blocks stores them (the others' puts answer ALREADY_PRESENT)."""
        for req_id, index in self._sync_loads.items():
            tracked = self._requests.get(req_id)
            failed = [j for block_id, j in index.items() if block_id in block_ids]
            if tracked is not None and failed:
                tracked.next_save_block = min(tracked.next_save_block, min(failed))

    # ---- per-step metadata ---------------------------------------------------------------------

    def build_meta(self, scheduler_output: Any) -> KvtagConnectorMetadata:
        meta = KvtagConnectorMetadata()
        self._sync_loads = {}
        preempted = set(scheduler_output.preempted_req_ids or ())

        for req_id, offloads in compat.boundary_state_offloads(scheduler_output).items():
            tracked = self._requests.get(req_id)
            if tracked is None or not tracked.keys.encodable or req_id in preempted:
                continue
            handoff = self.planner.boundary_save(req_id, tracked, offloads)
            if handoff is not None:
                meta.saves.append(handoff)

        scheduled = list(scheduler_output.num_scheduled_tokens)
        for req_id in scheduled:
            tracked = self._requests.get(req_id)
            if tracked is None:
                continue
            block_ids = compat.scheduled_block_ids(scheduler_output, req_id)
            if block_ids is None:
                continue
            if tracked.load_confirmed and tracked.plan is not None:
                first, group = tracked.plan.start_block, self.groups.kv_groups[0]
                span = range(first, first + tracked.plan.num_blocks)
                self._sync_loads[req_id] = dict(
                    zip(block_ids[group][span.start : span.stop], span, strict=True)
                )
                meta.loads.append(self._load_job(req_id, tracked, block_ids))
                tracked.plan = None
                tracked.load_confirmed = False
            if req_id in preempted:
                continue
            save = self.planner.step_save(req_id, tracked, block_ids)
            if save is not None:
                meta.saves.append(save)

        for req_id in preempted:
            tracked = self._requests.get(req_id)
            if tracked is not None:
                tracked.next_save_block = 0
                tracked.state_stored.clear()

        meta.saves.extend(self.planner.take_finish_jobs())
        meta.loads.extend(self._ready_loads)
        self._ready_loads = []
        return meta

    def _load_job(self, req_id: str, tracked: RequestState, block_ids: tuple[list[int], ...]) -> LoadJob:
        plan = tracked.plan
        assert plan is not None
        keys = tracked.keys
        start, end = plan.start_block, plan.start_block + plan.num_blocks
        hit_keys = keys.keys_of(start, end)
        transfers: list[BlockTransfer] = []
        for group in self.groups.kv_groups:
            transfers.extend(
                [
                    BlockTransfer(group, b, k)
                    for b, k in zip(block_ids[group][start:end], hit_keys, strict=True)
                ]
            )
        last = end - 1
        for group in self.groups.state_groups:
            # The state after the hit's last block goes in the slot for that boundary.
            transfers.append(BlockTransfer(group, block_ids[group][last], keys.key(last)))
        tracked.state_stored.add(last)
        return LoadJob(req_id, transfers, plan.leases)

    # ---- finish --------------------------------------------------------------------------------

    def partial_tail(self, request: Any, offloads: list[tuple[int, int, int]]) -> bool:
        tracked = self._requests.get(request.request_id)
        if tracked is None or _aborted(request):
            return False
        return self.planner.partial_tail(request.request_id, tracked, offloads)

    def finished(self, request: Any, block_ids: tuple[list[int], ...]) -> bool:
        """Register the finish-time job; True means the blocks stay pinned until finished_sending."""
        tracked = self._requests.pop(request.request_id, None)
        if tracked is not None:
            self._abandon(tracked)
            self._drop_plan(tracked)
        return self.planner.finished(request, tracked, block_ids, _aborted(request))

    def close(self) -> None:
        for tracked in self._requests.values():
            self._abandon(tracked)
            self._drop_plan(tracked)
        self._requests.clear()
        self._lookup_threads.shutdown(wait=True)  # each Lookup ends within its deadline


def _aborted(request: Any) -> bool:
    from vllm.v1.request import RequestStatus

    return bool(request.status == RequestStatus.FINISHED_ABORTED)
