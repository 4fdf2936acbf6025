"""The master breaker: open from a call that found the master down until one background probe finds it
answering. The probe is injected (the fault it reports is the only thing faked); the real failover is
measured by test_mooncake_ha.py."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
from kvtag_store.backends.base import BackendUnavailable
from kvtag_store.backends.mooncake import census as census_module
from kvtag_store.backends.mooncake import health
from kvtag_store.backends.mooncake.census import MooncakeCensus
from kvtag_store.backends.mooncake.client import MooncakeClient
from kvtag_store.backends.mooncake.errors import ErrorCounters, MooncakeCode
from kvtag_store.backends.mooncake.health import MasterBreaker

from tests.net import wait_until

from .mooncake_cluster import MooncakeCluster


def probers() -> int:
    return sum(1 for t in threading.enumerate() if t.name == "kvtag-master-probe" and t.is_alive())


class Probe:
    """A master that does not answer until `up` is set; each probe blocks a little, as Mooncake's
    retries do, and the most probes running at once is recorded."""

    def __init__(self, each_s: float = 0.02) -> None:
        self.up = threading.Event()
        self.calls = 0
        self._each_s = each_s
        self._running = 0
        self.most_at_once = 0
        self._lock = threading.Lock()

    def __call__(self) -> bool:
        with self._lock:
            self.calls += 1
            self._running += 1
            self.most_at_once = max(self.most_at_once, self._running)
        try:
            time.sleep(self._each_s)
            return self.up.is_set()
        finally:
            with self._lock:
                self._running -= 1


@pytest.fixture
def probe() -> Probe:
    return Probe()


@pytest.fixture
def breaker(probe: Probe) -> Iterator[MasterBreaker]:
    b = MasterBreaker("127.0.0.1:50051", ErrorCounters(), probe)
    yield b
    b.close()
    assert probers() == 0


def open_it(b: MasterBreaker, code: int = MooncakeCode.RPC_FAIL) -> BackendUnavailable:
    with pytest.raises(BackendUnavailable, match=r"Mooncake master 127\.0\.0\.1:50051 unreachable") as raised:
        b.screen([0, code], "reading blocks")
    return raised.value


def test_open_answers_at_once_until_a_probe_finds_the_master_then_the_prober_ends(
    breaker: MasterBreaker, probe: Probe
) -> None:
    open_it(breaker)
    started = time.monotonic()
    for _ in range(100):
        with pytest.raises(BackendUnavailable, match="not reading until it does"):
            breaker.check("reading")
    assert time.monotonic() - started < 0.1  # no caller waits on the master
    wait_until(lambda: probe.calls >= 3, 5, "the prober to probe repeatedly")
    assert breaker.is_open and probers() == 1
    probe.up.set()
    wait_until(lambda: not breaker.is_open, 5, "a successful probe to close the breaker")
    breaker.check("reading")
    wait_until(lambda: probers() == 0, 5, "the prober to end")
    calls = probe.calls
    time.sleep(0.2)
    assert probe.calls == calls  # nothing probes a master that answers


def test_failures_while_open_are_counted_and_share_one_prober(probe: Probe) -> None:
    errors = ErrorCounters()
    b = MasterBreaker("127.0.0.1:50051", errors, probe)
    try:
        for _ in range(20):
            open_it(b)
        assert errors.snapshot() == {"master_rpc": 20}
        wait_until(lambda: probe.calls >= 3, 5, "probes")
        assert probers() == 1 and probe.most_at_once == 1
        probe.up.set()
        wait_until(lambda: not b.is_open, 5, "the breaker to close")
        # A later failure opens it again with a new prober.
        probe.up.clear()
        open_it(b)
        assert b.is_open
        wait_until(lambda: probers() == 1, 5, "a new prober")
        probe.up.set()
        wait_until(lambda: not b.is_open and probers() == 0, 5, "the breaker to close again")
    finally:
        b.close()


def test_a_master_timeout_opens_it_and_other_codes_are_counted_only(breaker: MasterBreaker) -> None:
    assert "RPC_TIMEOUT (-901)" in str(open_it(breaker, MooncakeCode.RPC_TIMEOUT))
    errors = ErrorCounters()
    quiet = MasterBreaker("m", errors, lambda: True)
    quiet.screen([MooncakeCode.TRANSFER_FAIL, 0], "storing blocks", counted_unless={0})
    quiet.check("storing")
    assert not quiet.is_open
    assert errors.snapshot() == {"transfer": 1}
    # batch_is_exist's -1 opens it where the caller names it, reported as RPC_FAIL.
    with pytest.raises(BackendUnavailable, match=r"RPC_FAIL \(-900\)"):
        quiet.screen([1, -1], "looking blocks up", master_down=(MooncakeCode.RPC_FAIL, -1))
    quiet.close()


def test_close_stops_a_prober_that_never_succeeds_and_a_later_failure_starts_none(
    breaker: MasterBreaker, probe: Probe
) -> None:
    open_it(breaker)
    wait_until(lambda: probe.calls >= 2, 5, "probes")
    breaker.close()
    assert probers() == 0
    open_it(breaker)
    time.sleep(0.1)
    assert probers() == 0


def test_a_prober_stuck_in_one_call_lets_calls_through_once_its_evidence_is_old(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(health, "EVIDENCE_S", 0.3)
    release = threading.Event()

    def stuck() -> bool:
        release.wait(10)
        return True

    b = MasterBreaker("m", ErrorCounters(), stuck)
    try:
        with pytest.raises(BackendUnavailable):
            b.screen([MooncakeCode.RPC_FAIL], "storing a block")
        with pytest.raises(BackendUnavailable):
            b.check("storing")
        time.sleep(0.4)
        b.check("storing")  # the prober has said nothing for EVIDENCE_S: calls find out for themselves
        assert b.is_open
        release.set()
        wait_until(lambda: not b.is_open, 5, "the stuck probe's success to close the breaker")
    finally:
        release.set()
        b.close()
    assert probers() == 0


def test_a_probe_that_raises_is_retried() -> None:
    calls: list[int] = []

    def flaky() -> bool:
        calls.append(1)
        if len(calls) < 3:
            raise RuntimeError("boom")
        return True

    b = MasterBreaker("m", ErrorCounters(), flaky)
    try:
        with pytest.raises(BackendUnavailable):
            b.screen([MooncakeCode.RPC_FAIL], "storing a block")
        wait_until(lambda: not b.is_open, 5, "the third probe to close the breaker")
    finally:
        b.close()


def test_the_census_shares_the_breaker_answering_at_once_then_fails_closed_until_records_are_back(
    cluster: MooncakeCluster, raw_client: MooncakeClient, probe: Probe, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An OpenSession of a strict namespace while the master is down costs no Mooncake call (each
    would wait out seconds of retries): answered from the record this replica knows, or
    UNAVAILABLE for a namespace it does not; and a new mode is refused for a while after the master is
    back, while replicas restore the records they know. The cluster here is up: only the breaker
    says it is down, so an answer at once proves the census did not ask Mooncake."""
    monkeypatch.setattr(census_module, "_WATCH_S", 0.05)
    monkeypatch.setattr(census_module, "_RECOVERY_S", 1.0)
    monkeypatch.setattr(census_module, "_SETTLE_S", 0.2)
    breaker = MasterBreaker(cluster.master_address, ErrorCounters(), probe)
    census = MooncakeCensus(raw_client, breaker)
    namespace_id = "ns-breaker-" + str(time.monotonic_ns())
    known_id = namespace_id + "-known"
    try:
        assert census.establish_mode(known_id, b"mode-k") == b"mode-k"
        with pytest.raises(BackendUnavailable):
            breaker.screen([MooncakeCode.RPC_FAIL], "reading blocks")
        started = time.monotonic()
        for _ in range(20):
            with pytest.raises(BackendUnavailable, match="not recording the census until it does"):
                census.establish_mode(namespace_id, b"mode-a")
            # A record this replica knows answers at once, whichever mode asks: strict stays strict.
            assert census.establish_mode(known_id, b"mode-other") == b"mode-k"
        assert time.monotonic() - started < 0.2
        time.sleep(0.2)  # keeper rounds see the breaker open: records may be going with the master
        probe.up.set()
        wait_until(lambda: not breaker.is_open, 5, "the probe to close the breaker")
        with pytest.raises(BackendUnavailable, match="new modes are refused"):
            census.establish_mode(namespace_id, b"mode-a")
        wait_until(lambda: _established(census, namespace_id) == b"mode-a", 5, "the recovery window to pass")
        assert census.establish_mode(namespace_id, b"mode-b") == b"mode-a"  # first writer still wins
    finally:
        census.close()
        breaker.close()


def _established(census: MooncakeCensus, namespace_id: str) -> bytes | None:
    try:
        return census.establish_mode(namespace_id, b"mode-a")
    except BackendUnavailable:
        return None
