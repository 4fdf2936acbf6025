"""Where a shared-memory Get over Mooncake spends its time, part by part, beside raw get_batch.

One cluster, fresh blocks every repeat, the same values stored raw and through kvtag:

- raw:         a plain Mooncake client's get_batch of the raw copies (the reference), and its
               batch_get_into of them into a buffer registered up front (the transfer alone, without
               get_batch's fresh bytes per value: a bound, not a path either client offers an engine);
- references:  MooncakeBackend.get_references in process (what the GetReferences handler calls),
               with each Mooncake call it makes timed on the way through (existence check, replica
               list, batch_get_into_multi_buffers); the rest is kvtag's own Python;
- client:      StoreClient.get against a `kvtag-store serve --backend mooncake` replica, with the
               handler's own time read from its kvtag_rpc_duration_seconds histogram, so what
               remains is the client's copy and check and gRPC's transit.

bench_mooncake.py gives the headline ratios; this splits them. Prints a table, writes JSON with --out.

    .venv/bin/python benchmarks/mooncake_get_parts.py [--value-kib 64] [--repeats 6] [--out FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import socket
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
import mooncake_raw  # noqa: E402
from bench_mooncake import MODE, reexec_in_private_netns, shape, start_cluster  # noqa: E402
from provenance import git_describe  # noqa: E402

MiB = 1 << 20
# 32 MiB per repeat in Gets of ~8 MiB, as bench_mooncake reads each size (512 x 64 KiB in batches of 128).
VOLUME = 32 * MiB
TIMED = ("batch_is_exist", "batch_get_replica_desc", "batch_get_into_multi_buffers")


class Timed:
    """The backend's Mooncake client with the calls of TIMED clocked (seconds per name)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.seconds: dict[str, float] = dict.fromkeys(TIMED, 0.0)

    def __getattr__(self, name: str) -> Any:
        call = getattr(self._inner, name)
        if name not in TIMED:
            return call

        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - started

        return timed


def handler_seconds(port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    found = re.search(r'kvtag_rpc_duration_seconds_sum\{method="GetReferences"\} (\S+)', text)
    return float(found.group(1)) if found else 0.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def run(value_bytes: int, repeats: int) -> dict[str, Any]:
    from kvtag_client import keys as client_keys
    from kvtag_client.store import StoreClient
    from kvtag_store.backends.mooncake.backend import MooncakeBackend, connect

    from tests.descriptors import namespace
    from tests.mooncake.mooncake_replicas import Replica

    workdir = Path(tempfile.mkdtemp(prefix="mooncake-get-parts-"))
    cluster, plain = start_cluster(workdir)
    raw = connect(plain)
    # The raw client's destination for batch_get_into: one Get's values, registered once.
    blocks, batch = shape(value_bytes, VOLUME)
    landing = mooncake_raw.landing(raw, batch * value_bytes)
    shm_dir = tempfile.mkdtemp(dir="/dev/shm", prefix="kvtag-parts-")
    settings = dataclasses.replace(plain, shm_dir=shm_dir)  # staging: the shared-memory Get
    timed = Timed(connect(settings))
    backend = MooncakeBackend(timed, settings)
    metrics_port = free_port()
    replica = Replica(
        cluster,
        workdir,
        "replica",
        ["--mooncake-local-buffer=128MB", f"--metrics-listen=127.0.0.1:{metrics_port}"],
    )
    values = [os.urandom(value_bytes) for _ in range(8)]
    rows: dict[str, list[float]] = {}
    client: Any = None
    try:
        replica.start()
        client = StoreClient(
            f"127.0.0.1:{replica.port}",
            engine_id="parts",
            namespace=namespace("parts-" + os.urandom(4).hex()),
            mode=client_keys.mode(16, 0),
            probe_keys=client_keys.probe_keys(16, 0),
            rpc_timeout_s=60.0,
        )
        assert client.open() and client.data_path == "shared_memory", "no shared-memory session"
        ns = "ns-parts-" + os.urandom(4).hex()
        for _ in range(repeats):
            out = one_repeat(raw, landing.base, backend, timed, client, ns, values, metrics_port)
            for name, seconds in out.items():
                rows.setdefault(name, []).append(seconds)
    finally:
        if client is not None:
            client.close()
        replica.stop()
        backend.close()
        raw.unregister_buffer(landing.base)
        raw.close()
        cluster.stop()
        shutil.rmtree(shm_dir, ignore_errors=True)
    ratios = {
        name: statistics.median(s / r for s, r in zip(seconds, rows["raw_get_batch"], strict=True))
        for name, seconds in rows.items()
    }
    return {
        "value_bytes": value_bytes,
        "blocks": blocks,
        "batch": batch,
        "repeats": repeats,
        "ms": {name: [round(s * 1000, 2) for s in seconds] for name, seconds in rows.items()},
        "median_ratio_to_raw": {name: round(r, 3) for name, r in ratios.items()},
        "kvtag_commit": git_describe(),
        "loadavg": os.getloadavg(),
    }


def one_repeat(
    raw: Any,
    landing: int,
    backend: Any,
    timed: Timed,
    client: Any,
    ns: str,
    values: list[bytes],
    metrics_port: int,
) -> dict[str, float]:
    """Every column on fresh blocks (stored raw, through the backend and through the client)."""
    from kvtag.v1 import store_pb2 as pb
    from kvtag_store.backends.base import BlockKey

    tag = os.urandom(4).hex()
    size = len(values[0])
    blocks, batch = shape(size, VOLUME)
    keys = [f"{tag}-{i}".encode() for i in range(blocks)]
    raw_keys = [f"raw/{tag}-{i}" for i in range(blocks)]
    batches = [range(s, s + batch) for s in range(0, blocks, batch)]
    for b in batches:
        raw.put_batch([raw_keys[i] for i in b], [values[i % 8] for i in b])
        backend.put_many(ns, MODE, [((0, BlockKey(keys[i])), values[i % 8]) for i in b])
        assert client.put([(0, keys[i], values[i % 8], b"") for i in b]) == [pb.STORED] * batch

    def clock(call: Callable[[range], Any]) -> float:
        started = time.perf_counter()
        for b in batches:
            call(b)
        return time.perf_counter() - started

    pinned: list[Any] = []

    def references(b: range) -> None:
        addresses = [(0, BlockKey(keys[i])) for i in b]
        _, refs, held = backend.get_references(ns, MODE, addresses, verify=False)
        assert all(r is not None for r in refs), "a block was not read"
        pinned.extend(held)

    def client_get(b: range) -> None:
        got = client.get([(0, keys[i]) for i in b])
        assert all(v is not None and len(v) == size for v in got), "a block was not read"

    def raw_into(b: range) -> None:
        mooncake_raw.get_into(raw, [raw_keys[i] for i in b], landing, size)

    out = {"raw_get_batch": clock(lambda b: raw.get_batch([raw_keys[i] for i in b]))}
    out["raw_batch_get_into"] = clock(raw_into)
    timed.seconds = dict.fromkeys(TIMED, 0.0)
    out["references"] = clock(references)
    backend.unpin(ns, pinned)  # what the Get's lease release does: the slots go back
    out.update({f"references_{name}": s for name, s in timed.seconds.items()})
    out["references_python"] = out["references"] - sum(timed.seconds.values())
    before = handler_seconds(metrics_port)
    out["client_get"] = clock(client_get)
    out["client_handler"] = handler_seconds(metrics_port) - before
    out["client_outside_handler"] = out["client_get"] - out["client_handler"]
    time.sleep(1.1)  # the read leases lapse, so the blocks can go
    raw.batch_remove(raw_keys, True)
    return out


def table(result: dict[str, Any]) -> str:
    size = result["value_bytes"]
    lines = [
        f"{result['blocks']} x {size // 1024} KiB Gets in batches of {result['batch']}, "
        f"{result['repeats']} repeats: ms per repeat (min-max), median of per-repeat ratios to raw get_batch"
    ]
    for name, ms in result["ms"].items():
        ratio = result["median_ratio_to_raw"][name]
        lines.append(f"  {name:44s} {min(ms):7.1f} - {max(ms):7.1f}   {ratio:5.2f}x")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--value-kib", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    reexec_in_private_netns()
    os.environ.setdefault("GLOG_minloglevel", "2")
    result = run(args.value_kib * 1024, args.repeats)
    print(table(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
