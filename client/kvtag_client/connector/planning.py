"""Save planning: which blocks each step saves, the finish-time job, and Mamba hand-offs to store.

Saves use only keyed blocks (max_save_tokens = keyed blocks x block size) and read a block one step
after the step that completed it, when the drafter has written its KV for the block's last position.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

from . import mamba
from .config import KvtagConfig
from .groups import CacheGroups
from .metadata import BlockTransfer, SaveJob
from .namespace import Geometry
from .stats import StatsRecorder
from .tracking import RequestState


class SavePlanner:
    def __init__(
        self,
        config: KvtagConfig,
        geometry: Geometry,
        groups: CacheGroups,
        stats: StatsRecorder,
        wants_tokens: Callable[[], bool] = lambda: False,
    ) -> None:
        """`wants_tokens`: whether the store asks for the token ids of saved blocks (its KV events)."""
        self.config = config
        self.wants_tokens = wants_tokens
        self.geometry = geometry
        self.groups = groups
        self.stats = stats
        self._finish_jobs: dict[str, SaveJob] = {}
        self._ready_finish_jobs: list[SaveJob] = []
        # Requests whose blocks a finish job pins until the worker reports finished_sending.
        self.pinned: set[str] = set()

    def _save_transfers(
        self, tracked: RequestState, block_ids: tuple[list[int], ...] | list[list[int]], num_computed: int
    ) -> list[BlockTransfer]:
        """KV blocks complete before this step and keyed: max_save_tokens = keyed blocks * block size."""
        keys = tracked.keys
        if not keys.encodable:
            return []
        keys.refresh()
        upto = min(num_computed // self.geometry.block_size, keys.num_keyed_blocks())
        transfers: list[BlockTransfer] = []
        size = self.geometry.block_size
        tokens = keys.request.all_token_ids if self.wants_tokens() else None
        for j in range(tracked.next_save_block, upto):
            packed = (
                struct.pack(f"<{size}I", *tokens[j * size : (j + 1) * size]) if tokens is not None else b""
            )
            for group in self.groups.kv_groups:
                if j < len(block_ids[group]) and block_ids[group][j] != 0:
                    transfers.append(
                        BlockTransfer(group, block_ids[group][j], keys.key(j), keys.base_key(j), packed)
                    )
        tracked.next_save_block = max(tracked.next_save_block, upto)
        if self.config.audit:
            tracked.saved.extend(transfers)
        return transfers

    def step_save(
        self, req_id: str, tracked: RequestState, block_ids: tuple[list[int], ...]
    ) -> SaveJob | None:
        # num_computed_tokens is read before the scheduler advances it for this step, so these blocks
        # were completed (target and drafter KV) in an earlier step: the one-step-later emission.
        transfers = self._save_transfers(tracked, block_ids, tracked.keys.request.num_computed_tokens)
        return SaveJob(req_id, transfers) if transfers else None

    def boundary_save(
        self, req_id: str, tracked: RequestState, offloads: list[tuple[int, int, int]]
    ) -> SaveJob | None:
        """Mamba states handed off this step, copied after the forward that writes them."""
        if not tracked.keys.encodable:
            return None
        transfers = mamba.boundary_transfers(
            tracked.keys, offloads, self.groups.state_groups, self.geometry.block_size, tracked.state_stored
        )
        return SaveJob(req_id, transfers, after_forward=True) if transfers else None

    def partial_tail(self, req_id: str, tracked: RequestState, offloads: list[tuple[int, int, int]]) -> bool:
        if not tracked.keys.encodable:
            return False
        transfers = mamba.boundary_transfers(
            tracked.keys, offloads, self.groups.state_groups, self.geometry.block_size, tracked.state_stored
        )
        if not transfers:
            return False
        job = self._finish_jobs.setdefault(req_id, SaveJob(req_id, [], finish=True))
        job.blocks.extend(transfers)
        return True

    def finished(
        self, request: Any, tracked: RequestState | None, block_ids: tuple[list[int], ...], aborted: bool
    ) -> bool:
        """The finish-time job: keyed blocks not yet saved, plus the final Mamba state at the boundary."""
        req_id = request.request_id
        job = self._finish_jobs.pop(req_id, None)
        if tracked is None or aborted or not tracked.keys.encodable:
            if job is not None:
                # The core already kept the blocks for a partial tail: release them at once.
                self.stats.add("cancelled_jobs")
                job.blocks.clear()
                self._ready_finish_jobs.append(job)
                self.pinned.add(req_id)
                return True
            return False
        job = job or SaveJob(req_id, [], finish=True)
        computed = request.num_computed_tokens
        job.blocks.extend(self._save_transfers(tracked, block_ids, computed))
        if self.groups.hybrid:
            job.blocks.extend(
                mamba.final_state_transfers(
                    tracked.keys,
                    block_ids,
                    self.groups.state_groups,
                    computed,
                    self.geometry.block_size,
                    tracked.state_stored,
                )
            )
        if self.config.audit:
            # Audit reads the request's saved blocks once final; delay_free keeps them from reuse.
            job.audit = list(tracked.saved)
        if not job.blocks and not job.audit:
            return False
        self.stats.add("finish_jobs")
        self._ready_finish_jobs.append(job)
        self.pinned.add(req_id)
        return True

    def released(self, req_ids: set[str]) -> None:
        """The worker reported these finish jobs done: vLLM frees their blocks now."""
        self.pinned -= req_ids

    def take_finish_jobs(self) -> list[SaveJob]:
        """Finish jobs registered since the last step: they go out in this step's metadata."""
        jobs, self._ready_finish_jobs = self._ready_finish_jobs, []
        return jobs
