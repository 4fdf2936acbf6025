"""Mamba boundary states: which hand-offs to store, and the final state a finish-time job must carry.

A hybrid hit at boundary b needs the attention KV of [0, b) and the Mamba state after exactly b
tokens. The store keeps that state under the key of the block ending at b, in the Mamba group.

Where the states come from (vLLM 0.32/0.33, Mamba cache mode "align"):
- `kv_connector_block_state.boundary_state_offloads`: (group, block_id, boundary_tokens) offered in
  the step whose forward writes them; copied after that forward (SaveJob.after_forward).
- `register_finished_partial_tail`: states at a sub-block tail boundary of a request that ends
  there with nothing in flight.
- The finish boundary. Under EAGLE the core backs the prefill off one block, so the last prompt
  boundary gets no hand-off. But a finished request's Mamba state is its state after all of its
  computed tokens: in align mode slot p of the request's Mamba block table holds the state after
  (p + 1) * block_size tokens (see the invariant stated in Scheduler._mamba_block_aligned_split),
  and decode advances the last prompt slot to the boundary. An aligned prompt of N blocks with
  max_tokens=1 finishes with num_computed_tokens == N * block_size (the one sampled token is never
  fed back), so slot N - 1 holds exactly the state after the prompt. The finish job stores it under
  the lookahead key of block N - 1, which only now exists, while delay_free pins the block.
"""

from __future__ import annotations

from collections.abc import Sequence

from .metadata import BlockTransfer
from .tracking import RequestKeys


def boundary_transfers(
    keys: RequestKeys,
    offloads: Sequence[tuple[int, int, int]],
    state_groups: Sequence[int],
    block_size: int,
    already_stored: set[int],
) -> list[BlockTransfer]:
    """Transfers for hand-offs that fall on a store-block boundary whose key exists.

    Sub-block boundaries cannot be served by a block-granular store and are skipped.
    """
    transfers: list[BlockTransfer] = []
    keys.refresh()
    keyed = keys.num_keyed_blocks()
    for group, block_id, boundary in offloads:
        if group not in state_groups or boundary <= 0 or boundary % block_size:
            continue
        block = boundary // block_size - 1
        if block >= keyed or block in already_stored:
            continue
        transfers.append(BlockTransfer(group, block_id, keys.key(block), keys.base_key(block)))
        already_stored.add(block)
    return transfers


def final_state_slot(num_computed_tokens: int, block_size: int) -> int | None:
    """Slot of the Mamba block table holding the state after all computed tokens, if block-aligned."""
    if num_computed_tokens <= 0 or num_computed_tokens % block_size:
        return None
    return num_computed_tokens // block_size - 1


def final_state_transfers(
    keys: RequestKeys,
    block_ids: Sequence[Sequence[int]],
    state_groups: Sequence[int],
    num_computed_tokens: int,
    block_size: int,
    already_stored: set[int],
) -> list[BlockTransfer]:
    """The finish boundary's Mamba state, when the request ends on a keyed block boundary."""
    slot = final_state_slot(num_computed_tokens, block_size)
    if slot is None or slot >= keys.num_keyed_blocks() or slot in already_stored:
        return []
    transfers = []
    for group in state_groups:
        table = block_ids[group]
        if slot >= len(table) or table[slot] == 0:  # block 0 is vLLM's null block: no state there
            continue
        transfers.append(BlockTransfer(group, table[slot], keys.key(slot), keys.base_key(slot)))
    if transfers:
        already_stored.add(slot)
    return transfers
