"""The connector tells its operator when its Lookups meet blocks another mode holds (issue 30,
item 7): an EAGLE producer with lookahead keys fills a namespace and leaves, a consumer with
lookahead off gets only misses, and its log carries one warning naming the producer's mode and the
differing field, once per namespace per window, not once per Lookup."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest

from tests.net import wait_until
from tests.store_process import StoreProcess

from .harness import Engine
from .test_hit_length import B, fresh_prompt


def cross_mode_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "kvtag.connector" and r.levelno == logging.WARNING and "another mode" in r.getMessage()
    ]


def test_a_consumer_missing_a_producers_lookahead_blocks_logs_one_warning_naming_the_mode_and_field(
    make_engine: Callable[..., Engine],
    start_store: Callable[..., StoreProcess],
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = start_store()
    producer = make_engine(store.endpoint, eagle=True, extra={"engine_id": "xm-producer"})
    prompts = [fresh_prompt(3 * B + 5) for _ in range(3)]
    for n, prompt in enumerate(prompts):
        producer.add(f"p{n}", prompt, max_tokens=2)
    producer.run()
    producer.drain_saves()
    producer_mode = producer.connector.client().mode_id
    producer.shutdown()  # the producer has left; only its blocks remain

    with caplog.at_level(logging.WARNING, logger="kvtag"):
        consumer = make_engine(
            store.endpoint, eagle=True, extra={"engine_id": "xm-consumer", "lookahead": "off"}
        )
        warner = consumer.connector._sched().cross_mode
        assert consumer.external_hit("c0", prompts[0]) == 0, "another mode's blocks are never served"
        wait_until(lambda: warner.warnings_logged == 1, 10, "the cross-mode warning")
        assert consumer.external_hit("c1", prompts[1]) == 0
        assert consumer.external_hit("c2", prompts[2]) == 0
        assert consumer.connector.stats.totals["lookups"] >= 3

    warnings = cross_mode_warnings(caplog)
    assert len(warnings) == 1, f"one warning per namespace per window, got {warnings}"
    text = warnings[0]
    consumer_client = consumer.connector.client()
    assert consumer_client.namespace_id in text
    assert f"mode {producer_mode}" in text, f"the warning names the mode holding the blocks: {text}"
    assert "lookahead_tokens 1 (this engine: 0)" in text, f"the warning names the differing field: {text}"
    assert consumer_client.mode_id in text

    # Once the window has passed, the next Lookup that meets the split warns again.
    warner.interval_s = 0.0
    assert consumer.external_hit("c3", prompts[0]) == 0
    wait_until(lambda: warner.warnings_logged == 2, 10, "the warning after the window")


def test_engines_of_one_mode_never_log_the_cross_mode_warning(
    make_engine: Callable[..., Engine],
    start_store: Callable[..., StoreProcess],
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = start_store()
    producer = make_engine(store.endpoint, eagle=True, extra={"engine_id": "same-producer"})
    stored, cold = fresh_prompt(3 * B + 5), fresh_prompt(3 * B + 5)
    producer.add("p", stored, max_tokens=2)
    producer.run()
    producer.drain_saves()
    with caplog.at_level(logging.WARNING, logger="kvtag"):
        consumer = make_engine(store.endpoint, eagle=True, extra={"engine_id": "same-consumer"})
        assert consumer.external_hit("hit", stored) > 0
        assert consumer.external_hit("cold", cold) == 0, "a cold prompt misses"
    assert consumer.connector._sched().cross_mode.warnings_logged == 0
    assert cross_mode_warnings(caplog) == []
