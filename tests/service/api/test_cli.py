"""The `kvtag-store` command as operators run it: real subprocesses, real signals."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from kvtag.v1 import store_pb2 as pb
from kvtag.v1 import store_pb2_grpc

from tests.descriptors import PROBE, mode, namespace

KVTAG_STORE = str(Path(sys.executable).with_name("kvtag-store"))


@dataclass
class Served:
    process: subprocess.Popen[str]
    address: str
    log_lines: list[str]


def serve(*args: str, env: dict[str, str] | None = None) -> Served:
    """Start `kvtag-store serve` on a free port and wait for its "serving" log line."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("KVTAG_")} | (env or {})
    process = subprocess.Popen(
        [KVTAG_STORE, "serve", "--listen", "127.0.0.1:0", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=full_env,
    )
    lines: list[str] = []
    deadline = time.monotonic() + 20
    assert process.stdout is not None
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        lines.append(line)
        match = re.search(r"serving on (127\.0\.0\.1:\d+)", line)
        if match:
            return Served(process, match.group(1), lines)
    process.kill()
    raise AssertionError("kvtag-store never logged that it was serving:\n" + "".join(lines))


def stop(served: Served) -> int:
    served.process.send_signal(signal.SIGTERM)
    code = served.process.wait(timeout=15)
    assert served.process.stdout is not None
    served.log_lines += served.process.stdout.readlines()
    return code


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([KVTAG_STORE, *args], capture_output=True, text=True, timeout=30)


@pytest.fixture
def strict_store() -> Iterator[Served]:
    """A store whose policy (strict) and capacity (1 MiB) come from the environment."""
    served = serve("--metrics-listen", "", env={"KVTAG_POLICY": "strict", "KVTAG_CAPACITY": "1MiB"})
    yield served
    if served.process.poll() is None:
        stop(served)


def _open_two_modes(address: str) -> None:
    with grpc.insecure_channel(address) as channel:
        stub = store_pb2_grpc.KvStoreStub(channel)  # type: ignore[no-untyped-call]
        for engine, lookahead in (("engine-a", 1), ("engine-b", 0)):
            request = pb.OpenSessionRequest(
                engine_id=engine, namespace=namespace(), mode=mode(lookahead=lookahead), probe_keys=PROBE
            )
            try:
                stub.OpenSession(request, timeout=5)
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_sigterm_stops_the_server_cleanly_with_exit_code_zero(strict_store: Served) -> None:
    assert stop(strict_store) == 0
    assert any("stopped cleanly" in line for line in strict_store.log_lines)


def test_health_exits_zero_when_serving_and_nonzero_when_unreachable(strict_store: Served) -> None:
    ok = cli("health", "--target", strict_store.address)
    assert ok.returncode == 0 and "SERVING" in ok.stdout
    stop(strict_store)
    down = cli("health", "--target", strict_store.address, "--timeout", "1")
    assert down.returncode == 1
    assert "not healthy" in down.stderr


def test_diagnose_prints_policy_modes_engines_and_the_refusal_diff(strict_store: Served) -> None:
    _open_two_modes(strict_store.address)
    result = cli("diagnose", "--target", strict_store.address)
    assert result.returncode == 0, result.stderr
    table = result.stdout
    assert "policy strict" in table
    assert "engine-a" in table and "live" in table
    assert "refused sessions" in table
    assert re.search(r"lookahead_tokens\s+1\s+0", table), table
    assert "cross-mode" in table


def test_diagnose_json_is_machine_readable(strict_store: Served) -> None:
    _open_two_modes(strict_store.address)
    result = cli("diagnose", "--target", strict_store.address, "--json")
    report = json.loads(result.stdout)
    [ns] = report["namespaces"]
    assert ns["policy"] == "POLICY_STRICT"
    [refused] = ns["refused"]
    assert refused["engine_id"] == "engine-b"
    assert refused["refusal"]["diffs"] == [
        {"field": "lookahead_tokens", "established": "1", "requested": "0"}
    ]


def test_stats_shows_the_capacity_from_the_environment(strict_store: Served) -> None:
    table = cli("stats", "--target", strict_store.address)
    assert table.returncode == 0
    assert "1.0 MiB (1048576 bytes)" in table.stdout
    as_json = json.loads(cli("stats", "--target", strict_store.address, "--json").stdout)
    assert (as_json["backend"], as_json["capacity_bytes"]) == ("memory", "1048576")


def test_flags_win_over_environment_and_json_logs_are_one_object_per_line() -> None:
    served = serve(
        "--policy",
        "isolate",
        "--metrics-listen",
        "",
        env={"KVTAG_POLICY": "strict", "KVTAG_LOG_FORMAT": "json"},
    )
    try:
        with grpc.insecure_channel(served.address) as channel:
            stub = store_pb2_grpc.KvStoreStub(channel)  # type: ignore[no-untyped-call]
            for lookahead in (1, 0):  # two modes: only possible under isolate
                stub.OpenSession(
                    pb.OpenSessionRequest(
                        engine_id=f"e{lookahead}",
                        namespace=namespace(),
                        mode=mode(lookahead=lookahead),
                        probe_keys=PROBE,
                    ),
                    timeout=5,
                )
    finally:
        assert stop(served) == 0
    records = [json.loads(line) for line in served.log_lines if line.strip()]
    serving = next(r for r in records if "serving" in r["msg"])
    assert serving["policy"] == "isolate"
    assert {"ts", "level", "logger", "msg"} <= set(serving)


def test_metrics_endpoint_serves_prometheus_text() -> None:
    served = serve("--metrics-listen", "127.0.0.1:0")
    try:
        metrics = re.search(r"metrics=(127\.0\.0\.1:\d+)", "".join(served.log_lines))
        assert metrics, served.log_lines
        with urllib.request.urlopen(f"http://{metrics.group(1)}/metrics", timeout=5) as response:
            text = response.read().decode()
        assert "kvtag_capacity_bytes 1.073741824e+09" in text
    finally:
        assert stop(served) == 0


def test_bad_flag_values_are_refused_with_a_usage_error() -> None:
    result = cli("serve", "--capacity", "lots")
    assert result.returncode == 2
    assert "not a size" in result.stderr


def test_serving_line_is_logged_even_at_warning_level() -> None:
    served = serve("--metrics-listen", "", "--log-level", "warning")
    assert stop(served) == 0
    assert any("stopped cleanly" in line for line in served.log_lines)


def _bad_put_streams(address: str, count: int) -> list[grpc.Future]:
    """PutStreams whose second message does not parse and that never half-close."""
    channel = grpc.insecure_channel(address)
    call = channel.stream_unary("/kvtag.v1.KvStore/PutStream")
    good = pb.PutRequest(items=[pb.PutItem(block=pb.BlockRef(key=b"k"), value=b"v")]).SerializeToString()

    def messages() -> Iterator[bytes]:
        yield good
        yield b"\x0a\x64ab"
        time.sleep(60)  # keep the stream open past the shutdown

    return [call.future(messages(), timeout=60) for _ in range(count)]


def test_sigterm_after_streams_with_a_bad_message_still_exits_zero_within_the_grace() -> None:
    served = serve("--metrics-listen", "")
    calls = _bad_put_streams(served.address, 20)
    for future in calls:  # every stream is answered, none is left hanging in the server
        assert future.exception(timeout=30) is not None
    started = time.monotonic()
    assert stop(served) == 0
    # Documented bound: 5 s grace + 2 s hard deadline (docs/operations.md); 15 s leaves room for a loaded
    # machine and still catches the old hang (which never exited).
    assert time.monotonic() - started < 15
    assert not any("Traceback" in line for line in served.log_lines)


def test_sigterm_with_calls_that_never_finish_exits_zero() -> None:
    served = serve("--metrics-listen", "")
    channel = grpc.insecure_channel(served.address)
    stub = store_pb2_grpc.KvStoreStub(channel)  # type: ignore[no-untyped-call]
    session = stub.OpenSession(
        pb.OpenSessionRequest(engine_id="e", namespace=namespace(), mode=mode(), probe_keys=PROBE), timeout=5
    ).session_id
    call = channel.stream_unary("/kvtag.v1.KvStore/PutStream")

    def endless() -> Iterator[bytes]:
        """Valid messages forever: the handler stays inside the call until shutdown cancels it."""
        while True:
            yield pb.PutRequest(session_id=session).SerializeToString()
            time.sleep(0.05)

    futures = [call.future(endless(), timeout=60) for _ in range(5)]
    time.sleep(0.5)
    assert not any(f.done() for f in futures)
    assert stop(served) == 0
    for future in futures:
        future.cancel()
    channel.close()


def test_client_commands_exit_quietly_when_the_reader_closes_the_pipe(strict_store: Served) -> None:
    read_end, write_end = os.pipe()
    os.close(read_end)  # like `| head` that has already exited
    try:
        for command in (["diagnose"], ["stats", "--json"], ["health"]):
            done = subprocess.run(
                [KVTAG_STORE, *command, "--target", strict_store.address],
                stdout=write_end,
                stderr=subprocess.PIPE,
                text=True,
                timeout=30,
            )
            assert done.returncode == 0, done.stderr
            assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr
    finally:
        os.close(write_end)
