"""Mamba boundary states, and the finish-time job's state at the prompt boundary.

Regression for the upstream bug: with a hybrid model, EAGLE and lookahead keys, an aligned prompt
with max_tokens=1 makes its last block's lookahead key known only at finish. Under EAGLE the core
hands off no Mamba state at that boundary (its legacy back-off cuts the prefill one block earlier),
so a finish job without the Mamba state would shorten every later hybrid hit by a block.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from kvtag_client.connector import KvtagConnector
from vllm.v1.request import RequestStatus

from tests.store_process import StoreProcess

from .harness import MAMBA_STATE, Engine, assert_scheduler_empty, state_value
from .test_hit_length import fresh_prompt

H = 64  # block size of the hybrid recipe (hash blocks of 16 tokens inside)


def state_bytes(tokens: list[int], upto: int) -> bytes:
    return bytes(torch.full(MAMBA_STATE, state_value(tokens, upto)).numpy().tobytes())


def test_follow_up_gets_the_full_hybrid_hit_at_the_prompt_boundary(
    make_engine: Callable[..., Engine], store: StoreProcess
) -> None:
    writer = make_engine(store.endpoint, hybrid=True, eagle=True, extra={"engine_id": "hybrid-w"})
    assert writer.connector.lookahead_tokens == 1 and writer.connector.groups.state_groups == (1,)
    prompt = fresh_prompt(2 * H)  # aligned
    writer.add("a", prompt, max_tokens=1)
    handed_off: list[tuple[int, int, int]] = []
    while not writer.requests["a"].is_finished():
        writer.step()
        handed_off.extend(
            (t.group, t.block_id, 0)
            for job in writer.step_log[-1]["meta"].saves
            if job.after_forward
            for t in job.blocks
        )
    request = writer.requests["a"]
    # The state at finish is the state after the prompt: nothing past the prompt was computed...
    assert request.num_computed_tokens == len(prompt)
    # ...and align mode keeps the state after (p + 1) * block_size tokens in slot p of the table.
    final_state_block = writer.scheduler.kv_cache_manager.get_block_ids("a")[1][len(prompt) // H - 1]
    assert final_state_block != 0
    assert len(handed_off) == 1, "under EAGLE the core hands off only the first boundary's state"
    writer.step()  # the finish job goes out and is reported finished_sending
    job = next(job for job in writer.step_log[-1]["meta"].saves if job.finish)
    state_transfers = [t for t in job.blocks if t.group == 1]
    assert [t.block_id for t in state_transfers] == [final_state_block], "the job carries the final state"
    writer.run()
    writer.drain_saves()
    sampled = writer.step_log_samples("a")
    stored = writer.connector.client().get([(1, state_transfers[0].key)])[0]
    assert stored == state_bytes(prompt, len(prompt)), "stored state is the state after exactly the prompt"

    reader = make_engine(store.endpoint, hybrid=True, eagle=True, extra={"engine_id": "hybrid-r"})
    follow_up = [*prompt, *sampled, *fresh_prompt(20)]
    req = reader.add("b", follow_up, max_tokens=1)
    hit, is_async = reader.connector.get_num_new_matched_tokens(req, 0)
    assert hit == 2 * H, f"expected the full hybrid hit at the prompt boundary (128), got {hit}"
    assert is_async, "hybrid loads are asynchronous: a failure is reported per request (failed_recving)"
    reader.step()  # the scheduler allocates, the worker loads and reports finished_recving
    load = reader.step_log[-1]["meta"].loads[0]
    assert load.req_id == "b" and load.asynchronous
    assert reader.finished_recving_log[-1] == {"b"}
    out = reader.step()
    # The real scheduler takes the hit: it computes from the prompt boundary on (0.34 may cut this
    # chunk at a hash block, so the count scheduled is not asserted, only where it starts).
    assert req.num_computed_tokens - out.num_scheduled_tokens["b"] == 2 * H, (
        "the real scheduler takes the hit"
    )
    (state_load,) = [t for t in load.blocks if t.group == 1]
    assert reader.state[state_load.block_id].numpy().tobytes() == state_bytes(prompt, len(prompt))


def test_no_hybrid_hit_at_a_boundary_without_its_mamba_state(
    make_engine: Callable[..., Engine], store: StoreProcess
) -> None:
    engine = make_engine(store.endpoint, hybrid=True, eagle=True, extra={"engine_id": "hybrid-partial"})
    prompt = fresh_prompt(3 * H + 5)
    request = engine.add("x", prompt, max_tokens=1)
    keys = engine.connector._sched().track(request).keys
    keys.refresh()
    assert keys.num_keyed_blocks() == 3
    client = engine.connector.client()
    value = b"\0" * 64
    # Attention KV for blocks 0..2, but the Mamba state only at the end of block 0.
    client.put([(0, keys.key(j), value, b"") for j in range(3)] + [(1, keys.key(0), value, b"")])
    hit, _ = engine.connector.get_num_new_matched_tokens(request, 0)
    assert hit == H, f"the hit must stop at the last boundary with a stored state, got {hit}"


def test_abort_at_a_tail_boundary_does_not_pin_the_handed_off_tail(
    make_engine: Callable[..., Engine], store: StoreProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM hands a request that ends at a tail boundary to register_finished_partial_tail (seen on
    abort). An abort cancels: kvtag declines the tail, so its blocks are freed at once."""
    offered: list[tuple[list[tuple[int, int, int]], bool]] = []
    original = KvtagConnector.register_finished_partial_tail

    def recording(self: KvtagConnector, request: Any, block_ids: Any, offloads: Any) -> bool:
        accepted = bool(original(self, request, block_ids, offloads))
        offered.append((list(offloads), accepted))
        return accepted

    monkeypatch.setattr(KvtagConnector, "register_finished_partial_tail", recording)
    engine = make_engine(store.endpoint, hybrid=True, eagle=True, extra={"engine_id": "hybrid-tail"})
    request = engine.add("t", fresh_prompt(100), max_tokens=4)
    # Prefill up to a tail checkpoint (a hash block inside a block): 0.32/0.33 cut the first chunk
    # there under EAGLE (80); 0.34, hashing with lookahead itself, reaches one a chunk later (96).
    engine.step()
    if request.num_computed_tokens % H == 0:
        engine.step()
    tail = request.num_computed_tokens
    assert tail % 16 == 0 and tail % H != 0 and tail < 100, f"not at a tail checkpoint: {tail}"
    engine.scheduler.finish_requests("t", RequestStatus.FINISHED_ABORTED)
    assert offered == [([(1, offered[0][0][0][1], tail)], False)], offered
    assert "t" not in engine.scheduler.requests, "an aborted request's tail is not pinned"
    engine.run()
    assert not any(job.finish for entry in engine.step_log for job in entry["meta"].saves)
    assert_scheduler_empty(engine.scheduler)
