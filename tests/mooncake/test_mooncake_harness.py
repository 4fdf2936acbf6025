"""The cluster harness's retry of a storage node that never mounts (seen in about one start in 25:
it loops on "Client not available"). The fault is injected in what the harness sees: the master's
capacity does not grow for the first process, which must be killed and replaced on a fresh port."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .mooncake_cluster import MooncakeCluster


@pytest.fixture
def own_cluster(tmp_path: Path) -> Iterator[MooncakeCluster]:
    c = MooncakeCluster(tmp_path)
    c.start_master()
    yield c
    c.stop()


def test_a_storage_node_that_never_mounts_is_killed_and_replaced_on_a_fresh_port(
    own_cluster: MooncakeCluster, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    started: list[tuple[list[str], subprocess.Popen[bytes]]] = []
    real_popen = subprocess.Popen
    real_capacity = MooncakeCluster.capacity

    def popen(args: list[str], *rest: Any, **kwargs: Any) -> subprocess.Popen[bytes]:
        proc: subprocess.Popen[bytes] = real_popen(args, *rest, **kwargs)
        if args[0].endswith("mooncake_client"):
            started.append((args, proc))
        return proc

    monkeypatch.setattr(subprocess, "Popen", popen)
    # The first storage process's segment stays invisible: to the harness it never mounts.
    monkeypatch.setattr(
        MooncakeCluster, "capacity", lambda self: real_capacity(self) if len(started) > 1 else 0
    )
    proc = own_cluster.start_storage(16 << 20, mount_timeout_s=2)
    assert [p for _, p in started] == [started[0][1], proc]
    assert started[0][1].poll() is not None, "the node that never mounted is still running"
    ports = [next(a for a in args if a.startswith("--port=")) for args, _ in started]
    assert ports[0] != ports[1]
    assert own_cluster.storage == [proc]
    assert real_capacity(own_cluster) == 16 << 20
    assert "storage node never mounted (attempt 1" in capsys.readouterr().err
