"""Block copies between KV caches on a CUDA device and store arena slots (pinned host memory).

The copies run on a side stream, ordered against the forward pass by events: the side stream waits
for everything the compute stream queued before a step's saves and loads (so a save never reads a
block a queued kernel still writes, and a load never overwrites a block a queued kernel still
reads), and the compute stream waits for the loads before the forward reads them. Each slot copy is
also waited for on the host before it returns: the client digests a filled slot right after the
fill, and a slot it serves is valid only during the sink call. On CPU the worker copies directly
(blocks.gather_into / scatter_from) and none of this runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .blocks import LayerView, block_nbytes, stage_block, unstage_block
from .pinning import ArenaPins

# torch.cuda's runtime bindings, streams and events carry no annotations.
_cuda: Any = torch.cuda

# cudaErrorHostMemoryAlreadyRegistered: the range is registered already (by this process).
_ALREADY_REGISTERED = 712


def cuda_host_register(address: int, length: int) -> bool:
    result = int(_cuda.cudart().cudaHostRegister(address, length, 0))
    return result in (0, _ALREADY_REGISTERED)


def cuda_host_unregister(address: int) -> None:
    _cuda.cudart().cudaHostUnregister(address)


class CudaCopier:
    """Save and load of single blocks for KV caches on one CUDA device."""

    def __init__(self, device: torch.device, pins: ArenaPins | None = None) -> None:
        self.device = device
        self.stream = _cuda.Stream(device)
        self.pins = pins if pins is not None else ArenaPins(cuda_host_register, cuda_host_unregister)

    def begin(self) -> None:
        """Before a step's copies: the side stream waits for the work queued on the compute stream."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def end_loads(self) -> None:
        """After a step's loads: the compute stream waits for them before the forward reads the blocks."""
        torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def drain(self) -> None:
        """Wait for every copy issued (before sleep frees the KV memory)."""
        self.stream.synchronize()

    def save_block(self, views: Sequence[LayerView], block_id: int, slot: memoryview) -> None:
        """The block's bytes into `slot`, complete when this returns."""
        out = torch.frombuffer(slot, dtype=torch.uint8)
        pinned = self.pins.ensure(out.data_ptr(), out.numel())
        with torch.cuda.stream(self.stream):
            staged = stage_block(views, block_id)
            out.copy_(staged, non_blocking=pinned)
            copied = _cuda.Event()
            copied.record(self.stream)
        copied.synchronize()

    def load_block(self, views: Sequence[LayerView], block_id: int, source: memoryview) -> bool:
        """`source` into the block: the host copy is complete when this returns, the writes into the
        KV cache are queued on the side stream (end_loads orders the forward after them)."""
        if source.nbytes != block_nbytes(views):
            return False
        if not source.nbytes:
            return True
        host = torch.frombuffer(source, dtype=torch.uint8)
        pinned = self.pins.ensure(host.data_ptr(), host.numel())
        with torch.cuda.stream(self.stream):
            staged = torch.empty(host.numel(), dtype=torch.uint8, device=self.device)
            staged.copy_(host, non_blocking=pinned)
            copied = _cuda.Event()
            copied.record(self.stream)
            unstage_block(views, block_id, staged)
        copied.synchronize()
        return True

    def close(self) -> None:
        self.drain()
        self.pins.release()


def copier_for(views: Sequence[Sequence[LayerView]]) -> CudaCopier | None:
    """A CudaCopier when the registered KV caches live on a CUDA device, else None (CPU: direct copies)."""
    for group in views:
        for view in group:
            if view.tensor.device.type == "cuda":
                return CudaCopier(view.tensor.device)
            return None
    return None
