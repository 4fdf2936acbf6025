"""A/B of each hand-written codec against the generated protobuf code it replaces, same bytes in and out.

One process, no network: each pair is timed interleaved (A, B, A, B, ...) on the same message, so
load from other processes hits both alike; the figure is the median per call and B/A. A hand path
that shows no gain here has no reason to exist (docs/benchmarks.md, "Hand-written codecs").

    .venv/bin/python benchmarks/bench_codecs.py [--out benchmarks/results/codecs.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvtag.v1 import store_pb2 as pb
from kvtag_client.inline.get_decoding import decode_get_response
from kvtag_client.inline.put_encoding import encode_put_request
from kvtag_store.api import codec
from kvtag_store.backends.base import KeyStatus, ReadResult
from provenance import git_describe

KiB, MiB = 1024, 1024 * 1024


def _median_call(call: Callable[[], Any], calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - t0) / calls


def ab(hand: Callable[[], Any], generated: Callable[[], Any], repeats: int, calls: int) -> dict[str, Any]:
    hand(), generated()  # warm
    a: list[float] = []
    b: list[float] = []
    for _ in range(repeats):
        a.append(_median_call(hand, calls))
        b.append(_median_call(generated, calls))
    ha, gb = statistics.median(a), statistics.median(b)
    return {"hand_us": round(ha * 1e6, 1), "generated_us": round(gb * 1e6, 1), "speedup": round(gb / ha, 2)}


def cases(value_size: int, count: int) -> dict[str, tuple[Callable[[], Any], Callable[[], Any]]]:
    keys = [os.urandom(32) for _ in range(count)]
    values = [os.urandom(value_size) for _ in range(count)]
    put_message = pb.PutRequest(
        session_id="s-1",
        items=[pb.PutItem(block=pb.BlockRef(key=k), value=v) for k, v in zip(keys, values, strict=True)],
    )
    put_bytes = put_message.SerializeToString(deterministic=True)
    fields = [(0, k, v, b"") for k, v in zip(keys, values, strict=True)]
    results = [ReadResult(KeyStatus.HIT, v) for v in values]
    get_reply = pb.GetResponse(results=[pb.GetResult(status=pb.HIT, value=v) for v in values])
    get_bytes = get_reply.SerializeToString()
    assert codec.encode_get_results(results) == get_bytes
    assert encode_put_request("s-1", fields) == put_bytes
    label = f"{count}x{value_size // KiB}KiB"

    def put_generated_encode() -> bytes:
        return pb.PutRequest(
            session_id="s-1",
            items=[pb.PutItem(block=pb.BlockRef(key=k, group=g), value=v) for g, k, v, _ in fields],
        ).SerializeToString()

    def get_generated_encode() -> bytes:
        reply = pb.GetResponse()
        reply.results.extend(pb.GetResult(status=int(r.status), value=r.value) for r in results)  # type: ignore[arg-type]
        return reply.SerializeToString()

    def get_generated_decode() -> list[tuple[int, bytes]]:
        return [(r.status, r.value) for r in pb.GetResponse.FromString(get_bytes).results]

    return {
        f"client put encoding (put_encoding), {label}": (
            lambda: encode_put_request("s-1", fields),
            put_generated_encode,
        ),
        f"service Put parsing (codec.parse_put), {label}": (
            lambda: codec.parse_put(put_bytes),
            lambda: codec.put_from_message(pb.PutRequest.FromString(put_bytes)),
        ),
        f"service Get reply encoding (codec.encode_get_results), {label}": (
            lambda: codec.encode_get_results(results),
            get_generated_encode,
        ),
        f"client Get reply decoding (get_decoding), {label}": (
            lambda: decode_get_response(get_bytes),
            get_generated_decode,
        ),
    }


def lookup_cases(count: int) -> dict[str, tuple[Callable[[], Any], Callable[[], Any]]]:
    keys = [os.urandom(32) for _ in range(count)]
    v1 = pb.LookupRequest(session_id="s-1", blocks=[pb.BlockRef(key=k) for k in keys], lease_ms=200)
    data = v1.SerializeToString()
    packed = pb.LookupRequest(
        session_id="s-1", packed_blocks=[pb.PackedBlocks(key_length=32, keys=b"".join(keys))], lease_ms=200
    ).SerializeToString()
    assert codec.parse_lookup(data).addresses == codec.lookup_from_message(v1).addresses
    return {
        f"service Lookup parsing, v1 form (codec._parse_lookup_fast), {count} keys": (
            lambda: codec.parse_lookup(data).addresses,
            lambda: codec.lookup_from_message(pb.LookupRequest.FromString(data)).addresses,
        ),
        f"service Lookup parsing, packed form vs v1 generated, {count} keys": (
            lambda: codec.packed_addresses(codec.parse_lookup(packed).message.packed_blocks),  # type: ignore[union-attr]
            lambda: codec.lookup_from_message(pb.LookupRequest.FromString(data)).addresses,
        ),
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    load_before = os.getloadavg()
    rows: dict[str, Any] = {}
    for name, (hand, generated) in {**cases(MiB, 16), **cases(64 * KiB, 256), **lookup_cases(4096)}.items():
        rows[name] = ab(hand, generated, args.repeats, calls=5)
        print(f"{name:<78} hand {rows[name]['hand_us']:>9} us  generated {rows[name]['generated_us']:>9} us"
              f"  x{rows[name]['speedup']}")  # fmt: skip
    report = {
        "benchmark": "bench_codecs",
        "commit": git_describe(),
        "load_avg_before": [round(x, 2) for x in load_before],
        "load_avg_after": [round(x, 2) for x in os.getloadavg()],
        "rows": rows,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
