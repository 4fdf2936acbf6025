"""py-spy profile of a server subprocess while a workload runs, with busy samples ranked by cost
bucket (bench_service.py --profile)."""

from __future__ import annotations

import collections
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench_processes import Server


def find_py_spy(explicit: str | None) -> str | None:
    if explicit:
        return explicit
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else shutil.which("py-spy")


def profile_server(
    py_spy: str, server: Server, work: Callable[[], None], seconds: float, raw: Path
) -> dict[str, Any]:
    """Sample every server thread (Python and native frames) while `work` runs; rank busy time."""
    sampler = subprocess.Popen(
        [py_spy, "record", "--pid", str(server.proc.pid), "--native", "--rate", "200", "--format", "raw",
         "--duration", str(max(1, round(seconds))), "--output", str(raw)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    time.sleep(0.5)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and sampler.poll() is None:
        work()
    _, err = sampler.communicate(timeout=60)
    if not raw.exists():
        return {"error": err.decode(errors="replace")[-2000:]}
    return summarize_stacks(raw.read_text().splitlines())


# Stacks whose thread is waiting, not working: pool workers waiting for a call or for the request bytes,
# the main thread, the session reaper, the completion-queue poller when it sleeps.
IDLE_MARKERS = (
    "_queue_SimpleQueue_get",
    "Event.wait",
    "Condition.wait",
    "epoll_wait",
    "_reap_forever",
    "pthread_cond_timedwait",
)
# The first named frame from the leaf decides the cost bucket (unnamed libc addresses are memcpy,
# malloc or a page fault inside them, attributed to whoever called them).
BUCKETS = (
    (("upb_Encode", "upb_Encoder", "encode_scalar", "encode_message", "encode_array", "encode_growbuffer"),
     "protobuf serialize"),
    (("upb_BackAlloc", "SerializeInternal"), "protobuf serialize"),
    (("upb_Decode", "_upb_Decoder", "PyUpb_Message_MergeFromString"), "protobuf parse"),
    (("PyUpb", "upb_"), "protobuf message build / field access"),
    (("crc32", "libz.so"), "checksum (zlib.crc32)"),
    (("cygrpc", "libgrpc"), "gRPC core + Cython binding"),
    (("libpython", "python3", "Py", "_Py"), "CPython interpreter"),
)  # fmt: skip


def frame_name(frame: str) -> str:
    """ "func (file:line)" -> "func"; an unsymbolized "0x7f.. (lib.so)" -> "lib.so"."""
    name, _, where = frame.partition(" (")
    return where.rstrip(")").rsplit("/", 1)[-1] if name.startswith("0x") else name


def deciding_frame(stack: Sequence[str]) -> str:
    """The innermost frame that says whose cost a sample is. Unsymbolized libc frames (memcpy, malloc,
    and the page faults inside them) are charged to their caller; other unsymbolized frames are charged
    to their library (gRPC's Cython module ships without symbols)."""
    for frame in reversed(stack):
        if frame.startswith("0x") and "(libc.so" in frame:
            continue
        return frame
    return stack[-1] if stack else "?"


def classify(stack: Sequence[str]) -> str:
    """A cost bucket for one busy py-spy --native stack (leaf last)."""
    frame = deciding_frame(stack)
    if ".py:" in frame:
        if "kvtag_store/" in frame:
            return "kvtag_store Python code"
        return "grpc Python server code" if "grpc/" in frame else "other Python: " + frame_name(frame)
    for markers, bucket in BUCKETS:
        if any(m in frame for m in markers):
            return bucket
    return "other: " + frame_name(frame)


def summarize_stacks(lines: Sequence[str]) -> dict[str, Any]:
    buckets: collections.Counter[str] = collections.Counter()
    paths: collections.Counter[str] = collections.Counter()
    total = busy = 0
    for line in lines:
        stack_text, _, count_text = line.rpartition(" ")
        if not stack_text or not count_text.isdigit():
            continue
        count = int(count_text)
        stack = stack_text.split(";")
        total += count
        if any(marker in frame for frame in stack for marker in IDLE_MARKERS):
            continue
        busy += count
        buckets[classify(stack)] += count
        # The innermost Python frame and the innermost named native frame: "who asked, what ran".
        python = next((f for f in reversed(stack) if ".py:" in f), "?")
        decider = deciding_frame(stack)
        paths[f"{python.split(' (')[0]} ({python.rsplit('/', 1)[-1]} -> {frame_name(decider)}"] += count
    if not busy:
        return {"samples": total, "busy_samples": 0}

    def pct(n: int) -> float:
        return round(100 * n / busy, 1)

    return {
        "samples": total,
        "busy_samples": busy,
        "note": "percent of busy samples (threads not waiting); unsymbolized libc frames (memcpy, malloc, "
        "page faults in them) count toward their caller; py-spy cannot see gRPC's C-core threads",
        "busy_by_bucket_pct": {k: pct(v) for k, v in buckets.most_common()},
        "top_paths_pct": {k: pct(v) for k, v in paths.most_common(15)},
    }
