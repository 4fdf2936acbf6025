"""Copying engine KV blocks to host bytes and back, for any per-layer layout with a block dimension."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True, slots=True)
class LayerView:
    """One tensor of one layer (Mamba layers have several), and the dimension that indexes blocks.
    A block's shape and size are worked out once here: the copies run per layer per block."""

    name: str
    tensor: torch.Tensor
    block_dim: int
    block_shape: tuple[int, ...] = field(init=False)
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        shape = list(self.tensor.shape)
        del shape[self.block_dim]
        count = 1
        for size in shape:
            count *= size
        object.__setattr__(self, "block_shape", tuple(shape))
        object.__setattr__(self, "nbytes", count * int(self.tensor.element_size()))


class UnsupportedLayout(ValueError):
    """A registered KV tensor has no dimension of num_blocks entries."""


def _tensors(value: object) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, list | tuple):
        out: list[torch.Tensor] = []
        for item in value:
            out.extend(_tensors(item))
        return out
    raise UnsupportedLayout(f"unexpected KV cache entry of type {type(value).__name__}")


def layer_views(
    kv_caches: Mapping[str, object], group_layers: Sequence[Sequence[str]], num_blocks: int
) -> list[list[LayerView]]:
    """Per KV cache group, the tensors to copy for one block, in the group's layer order.

    The block dimension is the first of size num_blocks; vLLM's layouts put it first (Mamba states,
    cross-layer buffers) or second (attention [2, num_blocks, ...]).
    """
    groups: list[list[LayerView]] = []
    for layers in group_layers:
        views: list[LayerView] = []
        for name in layers:
            if name not in kv_caches:
                continue
            for index, tensor in enumerate(_tensors(kv_caches[name])):
                dims = [d for d, size in enumerate(tensor.shape[:3]) if size == num_blocks]
                if not dims:
                    raise UnsupportedLayout(
                        f"KV cache of layer {name} has shape {tuple(tensor.shape)} with no dimension of "
                        f"{num_blocks} blocks; kvtag cannot address its blocks"
                    )
                views.append(LayerView(f"{name}[{index}]", tensor, dims[0]))
        groups.append(views)
    return groups


def gather(views: Sequence[LayerView], block_id: int) -> bytes:
    """The block's bytes across the group's layers, in layer order (a host copy: safe to keep)."""
    parts = [
        view.tensor.select(view.block_dim, block_id).contiguous().reshape(-1).view(torch.uint8)
        for view in views
    ]
    return torch.cat(parts).cpu().numpy().tobytes() if parts else b""


def gather_into(views: Sequence[LayerView], block_id: int, destination: memoryview) -> None:
    """Copy the block's bytes across the group's layers straight into `destination` (e.g. a store
    arena slot of block_nbytes(views) bytes), in layer order, with no intermediate bytes."""
    if not destination.nbytes:
        return
    out = torch.frombuffer(destination, dtype=torch.uint8)
    layers = _uniform(views, out)
    if layers is not None:
        for view, layer in zip(views, layers, strict=True):
            layer.copy_(view.tensor.select(view.block_dim, block_id))
        return
    offset = 0
    for view in views:
        source = view.tensor.select(view.block_dim, block_id)
        size = view.nbytes
        _typed(out[offset : offset + size], view.tensor.dtype, source.shape).copy_(source)
        offset += size


def scatter_from(views: Sequence[LayerView], block_id: int, source: memoryview) -> bool:
    """scatter() from a buffer (e.g. a pinned store arena slot) without copying it to bytes first."""
    if source.nbytes != block_nbytes(views):
        return False
    if not source.nbytes:
        return True
    data = torch.frombuffer(source, dtype=torch.uint8)
    layers = _uniform(views, data)
    if layers is not None:  # one typed view of the whole block, indexed per layer
        for view, layer in zip(views, layers, strict=True):
            view.tensor.select(view.block_dim, block_id).copy_(layer)
        return True
    offset = 0
    for view in views:
        target = view.tensor.select(view.block_dim, block_id)
        size = view.nbytes
        target.copy_(_typed(data[offset : offset + size], view.tensor.dtype, target.shape))
        offset += size
    return True


def _uniform(views: Sequence[LayerView], data: torch.Tensor) -> torch.Tensor | None:
    """The block's bytes seen as [layers, *block_shape] when every layer has one dtype and block shape
    (the usual attention group), else None: two tensor views per block instead of two per layer."""
    first = views[0]
    dtype, shape = first.tensor.dtype, first.block_shape
    if any(v.tensor.dtype != dtype or v.block_shape != shape for v in views):
        return None
    return _typed(data, dtype, torch.Size((len(views), *shape)))


def _typed(raw: torch.Tensor, dtype: torch.dtype, shape: torch.Size) -> torch.Tensor:
    """A uint8 span seen as `dtype` in `shape`; copied first only if it is misaligned for the dtype."""
    try:
        return raw.view(dtype).view(shape)
    except RuntimeError:
        return raw.clone().view(dtype).view(shape)


def stage_block(views: Sequence[LayerView], block_id: int) -> torch.Tensor:
    """The block's bytes across the group's layers as one contiguous uint8 tensor on the KV's device
    (what gather_into writes to a slot): one stack for the usual attention group, so a device copies
    the block out with one transfer and no per-layer transfers."""
    parts = [view.tensor.select(view.block_dim, block_id) for view in views]
    first = views[0]
    if all(v.tensor.dtype == first.tensor.dtype and v.block_shape == first.block_shape for v in views):
        return torch.stack(parts).reshape(-1).view(torch.uint8)
    return torch.cat([part.contiguous().reshape(-1).view(torch.uint8) for part in parts])


def unstage_block(views: Sequence[LayerView], block_id: int, staged: torch.Tensor) -> None:
    """Write stage_block's bytes (a uint8 tensor on the KV's device) back into the block."""
    layers = _uniform(views, staged)
    if layers is not None:
        for view, layer in zip(views, layers, strict=True):
            view.tensor.select(view.block_dim, block_id).copy_(layer)
        return
    offset = 0
    for view in views:
        target = view.tensor.select(view.block_dim, block_id)
        target.copy_(_typed(staged[offset : offset + view.nbytes], view.tensor.dtype, target.shape))
        offset += view.nbytes


def block_nbytes(views: Sequence[LayerView]) -> int:
    return sum(view.nbytes for view in views)


def scatter(views: Sequence[LayerView], block_id: int, value: bytes | memoryview) -> bool:
    """Write a stored block into block_id; False (nothing written) if its size does not fit this layout."""
    if len(value) != block_nbytes(views):
        return False
    source = torch.frombuffer(bytearray(value), dtype=torch.uint8)
    offset = 0
    for view in views:
        target = view.tensor.select(view.block_dim, block_id)
        size = view.nbytes
        chunk = source[offset : offset + size].clone().view(view.tensor.dtype).reshape(target.shape)
        target.copy_(chunk)
        offset += size
    return True
