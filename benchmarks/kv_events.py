"""KV events' targets (issue 40), ratios from one run, through StoreClient against a real store process.

- put throughput of 1 MiB and 64 KiB blocks with KV events on and a live subscriber keeping up, against
  events off (target >= 0.95x), interleaved runs;
- the same with a stalled subscriber (connected, subscribed, never reading): puts unaffected, the
  batches it missed counted, the store's RSS within its bound;
- stored blocks seen by the subscriber keeping up, of 10,000 puts (target 100%).

The store runs as `kvtag-store serve` (the service venv's), so client, subscriber and server do not
share a GIL.

    .venv/bin/python benchmarks/kv_events.py [--quick] [--out benchmarks/results/kv_events.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from provenance import git_describe

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the repository, for tests.*

from kvtag_client.store import StoreClient  # noqa: E402
from kvtag_store.events import wire  # noqa: E402
from kvtag_store.events.subscriber import Subscriber  # noqa: E402

from tests.descriptors import PROBE, mode, namespace  # noqa: E402
from tests.net import free_port  # noqa: E402
from tests.store_process import StoreProcess  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20
PER_CALL = 16  # blocks per put, as a connector batches a request's blocks
CAPACITY = "512MiB"


@contextmanager
def store(root: Path, events: bool) -> Iterator[tuple[StoreProcess, str]]:
    metrics = free_port()
    args = ["--capacity", CAPACITY, "--metrics-listen", f"127.0.0.1:{metrics}"]
    if events:
        args += [
            "--kv-events-listen",
            f"127.0.0.1:{free_port()}",
            "--kv-events-replay-listen",
            f"127.0.0.1:{free_port()}",
        ]
    proc = StoreProcess(root / f"store-{time.monotonic_ns()}.log", *args)
    with proc:
        yield proc, f"http://127.0.0.1:{metrics}"


def sources(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{url}/kv_event_sources", timeout=5) as answer:
        doc: dict[str, Any] = json.load(answer)
    return doc


def metric(url: str, name: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as answer:
        for line in answer.read().decode().splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.split()[-1])
    return 0.0


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


class Keeper(threading.Thread):
    """A subscriber keeping up: every BlockStored key it sees, gaps filled by replay."""

    def __init__(self, endpoint: str, replay: str) -> None:
        super().__init__(daemon=True)
        self.subscriber = Subscriber(endpoint, replay)
        self.seen: set[bytes] = set()
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            for received in self.subscriber.batches(0.2):
                for event in received.batch.events:
                    if isinstance(event, wire.BlockStored):
                        self.seen.update(event.block_hashes)
        self.subscriber.close()


def put_run(address: str, size: int, blocks: int) -> tuple[float, list[bytes]]:
    """Seconds to put `blocks` distinct blocks of `size` bytes, PER_CALL per put, and their keys."""
    client = StoreClient(address, engine_id="bench", namespace=namespace(), mode=mode(), probe_keys=PROBE)
    try:
        assert client.open(), "the store did not answer"
        value = os.urandom(size)
        keys = [os.urandom(32) for _ in range(blocks)]
        calls = [keys[i : i + PER_CALL] for i in range(0, blocks, PER_CALL)]
        client.put([(0, os.urandom(32), value, b"")])  # warm: session, arena mapping
        start = time.perf_counter()
        for call in calls:
            results = client.put([(0, k, value, b"") for k in call])
            assert results is not None and set(results) == {1}, results
        return time.perf_counter() - start, keys
    finally:
        client.close()


def one(root: Path, case: str, size: int, blocks: int) -> dict[str, Any]:
    """One run of `case` (off, live, stalled): throughput and what the events side saw."""
    with store(root, case != "off") as (proc, url):
        keeper: Keeper | None = None
        stalled: Subscriber | None = None
        if case != "off":
            publisher = sources(url)["publisher"]
            if case == "live":
                keeper = Keeper(publisher["endpoint"], publisher["replay_endpoint"])
                keeper.start()
            else:
                stalled = Subscriber(publisher["endpoint"], publisher["replay_endpoint"], rcvhwm=1)
            time.sleep(0.3)  # joined
        assert proc.proc is not None
        rss_before = rss_bytes(proc.proc.pid)
        seconds, keys = put_run(proc.endpoint, size, blocks)
        row: dict[str, Any] = {"GB_per_s": size * blocks / seconds / 1e9, "seconds": seconds}
        row["rss_growth_MiB"] = (rss_bytes(proc.proc.pid) - rss_before) / MiB
        if keeper is not None:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and not set(keys) <= keeper.seen:
                time.sleep(0.05)
            row["seen_fraction"] = len(set(keys) & keeper.seen) / len(keys)
            keeper.stop.set()
            keeper.join()
        if case != "off":
            row["batches_missed"] = metric(url, "kvtag_kv_event_batches_missed_total")
            row["events_dropped"] = metric(url, "kvtag_kv_events_dropped_total")
            row["replay_buffer_bytes"] = metric(url, "kvtag_kv_event_replay_buffer_bytes")
        if stalled is not None:
            stalled.close()
        return row


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default="benchmarks/results/kv_events.json")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved off/live/stalled runs per size")
    parser.add_argument(
        "--quick", action="store_true", help="small runs, one repeat: checks the script works"
    )
    args = parser.parse_args()
    repeats = 1 if args.quick else args.repeats
    sizes = {"1MiB": (MiB, 64 if args.quick else 1024), "64KiB": (64 * KiB, 1000 if args.quick else 10_000)}
    results: dict[str, Any] = {
        "revision": git_describe(),
        "per_call": PER_CALL,
        "capacity": CAPACITY,
        "sizes": {},
    }
    with tempfile.TemporaryDirectory(prefix="kvtag-bench-events-") as tmp:
        root = Path(tmp)
        for label, (size, blocks) in sizes.items():
            runs: dict[str, list[dict[str, Any]]] = {"off": [], "live": [], "stalled": []}
            for _ in range(repeats):
                for case in runs:
                    runs[case].append(one(root, case, size, blocks))
            median = {case: statistics.median(r["GB_per_s"] for r in rows) for case, rows in runs.items()}
            entry = {
                "blocks": blocks,
                "runs": runs,
                "median_GB_per_s": median,
                "live_vs_off": median["live"] / median["off"],
                "stalled_vs_off": median["stalled"] / median["off"],
                "seen_fraction_min": min(r["seen_fraction"] for r in runs["live"]),
                "stalled_batches_missed": [r["batches_missed"] for r in runs["stalled"]],
            }
            results["sizes"][label] = entry
            print(
                f"{label:>6} x {blocks}: off {median['off']:.2f} GB/s, live {median['live']:.2f} GB/s "
                f"({entry['live_vs_off']:.2f}x), stalled {median['stalled']:.2f} GB/s "
                f"({entry['stalled_vs_off']:.2f}x); live subscriber saw {entry['seen_fraction_min']:.1%}; "
                f"stalled missed {entry['stalled_batches_missed']} batches"
            )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
