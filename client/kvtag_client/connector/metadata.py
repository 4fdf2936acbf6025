"""What the scheduler-side connector sends the worker each step (plain values: it is pickled)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


class BlockTransfer(NamedTuple):
    """One store block <-> one engine block: `group` is the KV cache group (the store's BlockRef.group).
    A NamedTuple, not a frozen dataclass: a 64k-token hit builds 4,096 of them inside the scheduler's
    step, and a tuple is built in less than half the time."""

    group: int
    block_id: int
    key: bytes
    base_key: bytes = b""
    # The block's token ids (uint32 little-endian) when the store asks for them (KV events), else empty.
    tokens: bytes = b""


@dataclass(slots=True)
class LoadJob:
    """Blocks to read into the request's freshly allocated blocks before this step's forward."""

    req_id: str
    blocks: list[BlockTransfer]
    # Per TP rank, the read leases its lookup took in that rank's namespace: each worker passes
    # its own rank's to its Get (a lease is released only by a session of its namespace).
    leases: tuple[tuple[str, ...], ...] = ()
    # Asynchronous load (hybrid models): the worker reports the request in finished_recving, or in
    # failed_recving when a block could not be loaded, because vLLM cannot map per-block load errors
    # back to requests when there are several KV cache groups.
    asynchronous: bool = False

    def leases_of(self, tp_rank: int) -> tuple[str, ...]:
        return self.leases[tp_rank] if tp_rank < len(self.leases) else ()


@dataclass(slots=True)
class SaveJob:
    """Blocks to copy to host bytes and store.

    `after_forward`: the bytes are written by this very step (Mamba boundary states handed off in the
    step that computes them), so the worker copies them in wait_for_save, after the forward. Other
    saves are emitted one step after their block was completed and are copied before the forward,
    when the drafter's KV for the block's last position is already written.
    `finish`: a finish-time job (possibly with no blocks left to copy) whose blocks stay pinned
    (delay_free) until the worker reports the request in get_finished -> finished_sending.
    """

    req_id: str
    blocks: list[BlockTransfer]
    finish: bool = False
    after_forward: bool = False
    # audit: blocks this request saved earlier, read now (pinned, final) and compared with the store.
    audit: list[BlockTransfer] = field(default_factory=list)


@dataclass
class KvtagConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc, unused-ignore]  # Any without vLLM installed
    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)

    def is_empty(self) -> bool:
        return not (self.loads or self.saves)
