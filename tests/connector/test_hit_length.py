"""External hit lengths per mode, and saves capped at the keyed blocks."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest
from kvtag_client import keys as keys_mod

from tests.store_process import StoreProcess

from .harness import Engine

B = 16
_prompt_ids = itertools.count(1)


def fresh_prompt(length: int) -> list[int]:
    """Token ids no other test uses, so every test starts from an empty prefix in the shared store."""
    base = 3000 + 1000 * next(_prompt_ids)
    return [base + i for i in range(length)]


def external_hit(
    make_engine: Callable[..., Engine], store: StoreProcess, prompt: list[int], **mode: object
) -> int:
    """Store `prompt` (+2 generated tokens) from one engine, then ask a second one for the same prompt."""
    writer = make_engine(store.endpoint, **mode)
    writer.add("w", prompt, max_tokens=3)
    writer.run()
    writer.drain_saves()
    reader = make_engine(store.endpoint, **mode)
    request = reader.add("r", prompt, max_tokens=1)
    hit, is_async = reader.connector.get_num_new_matched_tokens(request, 0)
    assert is_async is False
    assert hit is not None
    return hit


MODES: dict[str, dict[str, Any]] = {
    "spec_off": {"extra": {"engine_id": "spec-off"}},
    "eagle_lookahead": {"eagle": True, "extra": {"engine_id": "eagle-la"}},
    "eagle_legacy": {"eagle": True, "extra": {"engine_id": "eagle-legacy", "lookahead": "off"}},
}


@pytest.mark.parametrize(("num_blocks", "tail"), [(4, 0), (4, 5)], ids=["aligned", "unaligned"])
def test_lookahead_hit_matches_spec_off_and_legacy_is_one_block_shorter(
    make_engine: Callable[..., Engine], store: StoreProcess, num_blocks: int, tail: int
) -> None:
    hits = {}
    for name, mode in MODES.items():
        hits[name] = external_hit(make_engine, store, fresh_prompt(num_blocks * B + tail), **mode)
    # vLLM never hits the whole prompt (one token must be computed): an aligned prompt of N blocks
    # hits N-1 of them with spec decode off, an unaligned one N.
    expected_off = (num_blocks - 1 if tail == 0 else num_blocks) * B
    assert hits["spec_off"] == expected_off, hits
    assert hits["eagle_lookahead"] == hits["spec_off"], f"lookahead must not lose a block: {hits}"
    assert hits["eagle_legacy"] == hits["spec_off"] - B, f"legacy EAGLE drops one block: {hits}"


def test_reported_hit_is_what_the_real_scheduler_schedules(
    make_engine: Callable[..., Engine], store: StoreProcess
) -> None:
    prompt = fresh_prompt(3 * B + 7)
    writer = make_engine(store.endpoint, eagle=True)
    writer.add("w", prompt, max_tokens=2)
    writer.run()
    writer.drain_saves()
    reader = make_engine(store.endpoint, eagle=True)
    request = reader.add("r", [*prompt, 7, 8, 9], max_tokens=1)
    out = reader.step()
    assert out.num_scheduled_tokens["r"] == len(prompt) + 3 - 3 * B
    assert request.num_computed_tokens == len(prompt) + 3
    assert reader.step_log[-1]["meta"].loads[0].req_id == "r"
    load = reader.step_log[-1]["meta"].loads[0]
    assert len(load.blocks) == 3  # one store value per block: target and drafter layers together
    assert load.leases, "the lookup lease travels with the load"


def saved_block_indices(engine: Engine, req_id: str, finish: bool | None = None) -> list[int]:
    """Indices (in the request's block table) of the KV blocks the connector emitted saves for."""
    out: list[int] = []
    for entry in engine.step_log:
        for job in entry["meta"].saves:
            if job.req_id == req_id and (finish is None or job.finish == finish):
                out.extend(engine.block_index[req_id][t.block_id] for t in job.blocks if t.group == 0)
    return out


def test_saves_never_exceed_keyed_blocks_and_tail_is_not_excluded_twice(
    make_engine: Callable[..., Engine], store: StoreProcess
) -> None:
    engine = make_engine(store.endpoint, eagle=True)
    prompt = fresh_prompt(4 * B)  # aligned: block 3 is keyed only once the first token is sampled
    engine.add("a", prompt, max_tokens=1)
    engine.track_blocks("a")
    engine.run()
    during_prefill = saved_block_indices(engine, "a", finish=False)
    at_finish = saved_block_indices(engine, "a", finish=True)
    # While only the prompt exists, 3 blocks have lookahead keys: max_save_tokens = 3 * B.
    assert sorted(during_prefill) == sorted(set(during_prefill))
    assert set(during_prefill) <= {0, 1, 2}, "a save beyond max_save_tokens"
    # The sampled token keys block 3; the finish-time job saves it (the EAGLE tail exclusion is not
    # applied on top of lookahead keys, which would silently lose this block).
    assert 3 in at_finish
    assert sorted(during_prefill + at_finish) == [0, 1, 2, 3]
    engine.drain_saves()
    tokens = prompt + engine.step_log_samples("a")
    expected = keys_mod.block_keys(tokens, B, 1)
    assert len(expected) == 4
    stored = engine.connector.client().get([(0, key) for key in expected])
    assert all(value is not None for value in stored), "each keyed block is stored under its canonical key"
