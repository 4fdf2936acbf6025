"""Conformance probes instead of a version list: a tested series runs quietly, an untested newer one with
one warning, a failed probe turns the store off (the engine still serves), an older series is refused."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import pytest
from kvtag_client.connector import conformance

from tests.store_process import StoreProcess

from .harness import Engine, assert_scheduler_empty
from .test_hit_length import B, fresh_prompt


@pytest.fixture(autouse=True)
def fresh_probes() -> Iterator[None]:
    """The probes run once per process (conformance.checked); each test here runs them again."""
    conformance.checked.cache_clear()
    yield
    conformance.checked.cache_clear()


def kvtag_records(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith("kvtag") and r.levelno == level]


def test_the_running_vllm_is_a_tested_series_and_passes_every_probe() -> None:
    result = conformance.run()
    assert result.tested, result.report()
    assert result.ok, result.report()
    assert [r.name for r in result.results] == list(conformance.PROBES)


def test_a_tested_series_runs_quietly(
    make_engine: Callable[..., Engine], store: StoreProcess, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="kvtag"):
        engine = make_engine(store.endpoint, eagle=True, extra={"engine_id": "probe-quiet"})
    assert not engine.connector.store_off
    assert not [m for m in kvtag_records(caplog, logging.WARNING) if "conformance" in m]
    assert not kvtag_records(caplog, logging.ERROR)


def test_an_untested_newer_series_runs_with_one_warning_naming_it(
    make_engine: Callable[..., Engine],
    store: StoreProcess,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.99.0")  # the fault: a release no suite has run on
    with caplog.at_level(logging.WARNING, logger="kvtag"):
        writer = make_engine(store.endpoint, eagle=True, extra={"engine_id": "probe-new-w"})
        reader = make_engine(store.endpoint, eagle=True, extra={"engine_id": "probe-new-r"})
    warnings = [m for m in kvtag_records(caplog, logging.WARNING) if "0.99.0" in m]
    assert len(warnings) == 1, warnings  # one per process, not one per connector
    assert "has not been tested" in warnings[0] and "every conformance probe passed" in warnings[0]
    # It runs as a tested one does: saves, then a full-length lookahead hit.
    prompt = fresh_prompt(3 * B + 2)
    writer.add("a", prompt, max_tokens=2)
    writer.run()
    writer.drain_saves()
    assert reader.external_hit("b", prompt) == 3 * B


def test_a_failed_probe_turns_the_store_off_and_the_engine_still_serves(
    make_engine: Callable[..., Engine],
    store: StoreProcess,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The fault: a Request field kvtag reads is gone in this "release".
    monkeypatch.setattr(conformance, "REQUEST_FIELDS", (*conformance.REQUEST_FIELDS, "kvtag_gone_field"))
    with caplog.at_level(logging.WARNING, logger="kvtag"):
        engine = make_engine(store.endpoint, eagle=True, extra={"engine_id": "probe-failed"})
    errors = kvtag_records(caplog, logging.ERROR)
    assert len(errors) == 1, errors
    assert "'request_fields'" in errors[0] and "kvtag_gone_field" in errors[0] and "store is off" in errors[0]
    assert engine.connector.store_off and engine.worker_connector.store_off
    # The VllmConfig built (EAGLE included), and every request is computed: no hit, no save, no leak.
    prompt = fresh_prompt(3 * B + 2)
    engine.add("a", prompt, max_tokens=3)
    engine.add("b", prompt, max_tokens=3)
    engine.run()
    assert all(r.is_finished() for r in engine.requests.values())
    assert engine.external_hit("c", prompt) == 0
    assert not any(entry["meta"].saves or entry["meta"].loads for entry in engine.step_log)
    assert_scheduler_empty(engine.scheduler)
    assert "probe-failed" not in store.cli("diagnose"), (
        "no session is opened for an engine whose store is off"
    )


def test_a_series_older_than_the_tested_ones_is_refused_saying_why(
    make_engine: Callable[..., Engine], store: StoreProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.31.2")
    with pytest.raises(conformance.UnsupportedVllmVersion, match=r"vLLM 0\.31\.2 is older than 0\.32"):
        make_engine(store.endpoint, extra={"engine_id": "probe-old"})


def test_the_probe_report_names_each_probe_and_what_differed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(conformance, "SCHEDULER_OUTPUT_FIELDS", ("num_scheduled_tokens", "kvtag_gone"))
    result = conformance.run()
    (failed,) = result.failed
    assert failed.name == "output_fields" and "SchedulerOutput has no kvtag_gone" in failed.detail
    report = result.report()
    assert all(name in report for name in conformance.PROBES)
    assert "FAIL output_fields" in report
