"""`kvtag-store diagnose --watch`: frames from a real store, with what changed marked."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from kvtag_store.app import terminal
from kvtag_store.observe import report

from tests.descriptors import mode
from tests.net import free_port

from ..conftest import ServerFactory
from ..helpers import Store

KVTAG_STORE = str(Path(sys.executable).with_name("kvtag-store"))


def _fetcher(store: Store) -> terminal.Watcher:
    return terminal.Watcher(lambda: report.diagnose_table(store.diagnose()), color=False)


def test_second_frame_marks_only_what_changed(store: Store) -> None:
    first_session = store.open("engine-a", labels={"host": "node-1"})
    watcher = _fetcher(store)
    first = watcher.frame()
    assert "engine-a" in first and not any(line.startswith(">") for line in first.splitlines())
    # Unchanged state (only ages may tick): nothing is marked.
    assert not any(line.startswith(">") for line in watcher.frame().splitlines())
    store.open("engine-b", hashing=mode(lookahead=0))
    store.lookup(first_session.session_id, b"k-missing")
    marked = [line[2:] for line in watcher.frame().splitlines() if line.startswith("> ")]
    assert any("engine-b" in line and "live" in line for line in marked), marked
    assert any(line.split()[:3] == [first_session.mode_id, "0", "1"] for line in marked), marked
    assert not any(line.startswith("namespace ") for line in marked), "the namespace line did not change"


def test_color_marks_use_reverse_video(store: Store) -> None:
    store.open("engine-a")
    watcher = terminal.Watcher(lambda: report.diagnose_table(store.diagnose()), color=True)
    watcher.frame()
    store.open("engine-b")
    assert "\x1b[7m> " in watcher.frame()


@pytest.mark.slow
def test_cli_watch_redraws_until_interrupted(make_store: ServerFactory) -> None:
    store = make_store()
    store.open("engine-a")
    clear = terminal.CLEAR.encode()
    opened: list[bool] = []

    def late_engine_marked(output: bytes) -> bool:
        if output.count(clear) >= 2 and not opened:
            store.open("engine-late")
            opened.append(True)
        return b"> " in output.rpartition(clear)[2] and b"engine-late" in output

    code, output, errors = _watch(store.server.address, late_engine_marked)
    assert code == 0, errors
    frames = output.decode().split(terminal.CLEAR)[1:]
    assert len(frames) >= 3
    assert f"kvtag-store diagnose {store.server.address}" in frames[0]
    late = next(f for f in frames if "engine-late" in f)
    assert any(line.startswith("> ") and "engine-late" in line for line in late.splitlines())


def test_cli_watch_refuses_json(store: Store) -> None:
    done = subprocess.run(
        [KVTAG_STORE, "diagnose", "--watch", "--json", "--target", store.server.address],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2 and "drop --json" in done.stderr


def _watch(target: str, until: Callable[[bytes], bool]) -> tuple[int, bytes, bytes]:
    """Run `diagnose --watch` until its output satisfies `until`, then Ctrl-C it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTAG_")}
    process = subprocess.Popen(
        [KVTAG_STORE, "diagnose", "--watch", "--interval", "0.2", "--timeout", "1", "--target", target],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    try:
        assert process.stdout is not None
        output = b""
        deadline = time.monotonic() + 30
        while not until(output) and time.monotonic() < deadline:
            output += os.read(process.stdout.fileno(), 65536)
        process.send_signal(signal.SIGINT)
        rest, errors = process.communicate(timeout=10)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    return process.returncode, output + rest, errors


@pytest.mark.slow
def test_cli_watch_keeps_drawing_while_the_store_is_unreachable() -> None:
    code, output, errors = _watch(f"127.0.0.1:{free_port()}", lambda out: out.count(b"cannot reach") >= 2)
    assert code == 0, errors
    assert output.decode().count("cannot reach the store at") >= 2
