"""Soak of the control plane: does the store's memory plateau under any stream of calls?

Two phases, each against a fresh `kvtag-store serve` process (RSS read from /proc):

1. fuzz: RPCS seeded calls, one at a time, well-formed and malformed: sessions opened in new and
   old namespaces, tenants and modes (many abandoned), puts, lookups, gets, heartbeats, closes,
   Diagnose and GetStats pages, and bytes that parse as nothing. RSS is sampled along the way, with
   its parts (anonymous heap, arena files in the tmpfs); the plateau figure is the growth over the
   second half of the run (100,000 RPCs by default, ~3 min).
2. abandon: ABANDON sessions opened in distinct namespaces (half closed, the rest left to
   expire), then RSS and the time of Diagnose's first page at that many namespaces, and RSS once
   the retention window has passed; ABANDON_ROUNDS times over (3 by default), so that a leak
   shows as growth from round to round and the allocators' high-water mark as a level.

Writes benchmarks/results/soak_control_plane.json. `make soak` runs it; SOAK_ARGS passes flags.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc
from kvtag.v1 import store_pb2 as pb
from kvtag.v1 import store_pb2_grpc

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.descriptors import PROBE, mode, namespace  # noqa: E402

MiB = 1 << 20
METHODS = ["OpenSession", "Lookup", "Put", "Get", "Heartbeat", "CloseSession", "Diagnose", "GetStats"]


def rss_mib(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) of the process, in MiB."""
    fields = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line
    )
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def memory_parts(pid: int, shm_dir: str = "/dev/shm") -> dict[str, float]:
    """Where the memory is, in MiB: the process's anonymous pages (the interpreter's heap, gRPC's),
    its mapped shared-memory pages, and the bytes its arena files hold in the tmpfs. The files can
    hold more than is mapped: the up-front prefault reserves pages without mapping them, and they
    count against the machine all the same, so the memory figure is anon + files."""
    fields = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line
    )
    files = sum(p.stat().st_blocks * 512 for p in Path(shm_dir).glob(f"kvtag-{pid}-*"))
    anon = int(fields["RssAnon"].split()[0]) / 1024
    return {
        "anon_mib": round(anon, 1),
        "shmem_mapped_mib": round(int(fields["RssShmem"].split()[0]) / 1024, 1),
        "arena_files_mib": round(files / MiB, 1),
        "memory_mib": round(anon + files / MiB, 1),
    }


class Server:
    def __init__(self, flags: list[str]) -> None:
        self.flags = flags
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvtag_store.app.cli",
                "serve",
                "--listen",
                "127.0.0.1:0",
                "--metrics-listen",
                "",
                "--log-level",
                "error",
                *flags,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if "serving on" in line:
                self.address = line.split("serving on", 1)[1].split()[0]
                break
        else:
            raise RuntimeError("the store did not start")
        options = [("grpc.max_receive_message_length", 64 * MiB), ("grpc.max_send_message_length", 64 * MiB)]
        self.channel = grpc.insecure_channel(self.address, options=options)
        self.stub = store_pb2_grpc.KvStoreStub(self.channel)  # type: ignore[no-untyped-call]
        self.raw = {
            m: self.channel.unary_unary(
                f"/kvtag.v1.KvStore/{m}", request_serializer=None, response_deserializer=None
            )
            for m in METHODS
        }

    def rss(self) -> tuple[float, float]:
        return rss_mib(self.proc.pid)

    def parts(self) -> dict[str, float]:
        return memory_parts(self.proc.pid)

    def stop(self) -> None:
        self.channel.close()
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=30)


def fuzz(server: Server, rpcs: int, seed: int, sample_every: int) -> dict[str, Any]:
    rng = random.Random(seed)
    sessions: list[str] = []
    keys: list[bytes] = []
    outcomes: dict[str, int] = {}
    curve = [(0, *server.rss())]
    parts = [server.parts()]
    started = time.monotonic()
    for n in range(1, rpcs + 1):
        roll = rng.random()
        try:
            if roll < 0.10 or not sessions:
                fresh = rng.random() < 0.5
                ns = namespace(
                    model=f"model-{rng.getrandbits(40) if fresh else rng.randrange(8)}",
                    tenant=f"tenant-{rng.getrandbits(32) if rng.random() < 0.2 else rng.randrange(3)}",
                )
                hashing = mode(
                    lookahead=rng.choice([0, 1]), seed="" if rng.random() < 0.8 else str(rng.getrandbits(32))
                )
                labels = {f"l{i}": "x" * rng.randrange(200) for i in range(rng.randrange(8))}
                opened = server.stub.OpenSession(
                    pb.OpenSessionRequest(
                        engine_id=f"e-{rng.getrandbits(24)}",
                        namespace=ns,
                        mode=hashing,
                        probe_keys=PROBE,
                        labels=labels,
                    ),
                    timeout=10,
                )
                sessions.append(opened.session_id)
                del sessions[:-200]
            elif roll < 0.40:
                batch = [
                    (rng.randbytes(rng.randrange(1, 40)), rng.randbytes(rng.randrange(0, 64 << 10)))
                    for _ in range(rng.randrange(1, 8))
                ]
                keys.extend(k for k, _ in batch)
                del keys[:-2000]
                server.stub.Put(
                    pb.PutRequest(
                        session_id=rng.choice(sessions),
                        items=[
                            pb.PutItem(block=pb.BlockRef(key=k, base_key=k[:8]), value=v) for k, v in batch
                        ],
                    ),
                    timeout=10,
                )
            elif roll < 0.65:
                chosen = rng.sample(keys, min(len(keys), rng.randrange(1, 64))) if keys else [b"none"]
                server.stub.Lookup(
                    pb.LookupRequest(
                        session_id=rng.choice(sessions),
                        blocks=[pb.BlockRef(key=k, base_key=k[:8]) for k in chosen],
                        lease_ms=rng.choice([0, 1000, 600_000]),
                    ),
                    timeout=10,
                )
            elif roll < 0.78:
                chosen = rng.sample(keys, min(len(keys), rng.randrange(1, 16))) if keys else [b"none"]
                server.stub.Get(
                    pb.GetRequest(
                        session_id=rng.choice(sessions), blocks=[pb.BlockRef(key=k) for k in chosen]
                    ),
                    timeout=10,
                )
            elif roll < 0.84:
                server.stub.Heartbeat(pb.HeartbeatRequest(session_id=rng.choice(sessions)), timeout=10)
            elif roll < 0.88:
                sid = sessions.pop(rng.randrange(len(sessions)))
                server.stub.CloseSession(pb.CloseSessionRequest(session_id=sid), timeout=10)
            elif roll < 0.91:
                server.stub.Diagnose(pb.DiagnoseRequest(page_size=rng.choice([0, 10, 1000])), timeout=30)
            elif roll < 0.93:
                server.stub.GetStats(pb.GetStatsRequest(), timeout=30)
            else:
                server.raw[rng.choice(METHODS)](rng.randbytes(rng.randrange(0, 4096)), timeout=10)
            outcomes["OK"] = outcomes.get("OK", 0) + 1
        except grpc.RpcError as exc:
            code = exc.code().name if isinstance(exc, grpc.Call) else "?"
            outcomes[code] = outcomes.get(code, 0) + 1
        if n % sample_every == 0:
            curve.append((n, *server.rss()))
            parts.append(server.parts())
    half = next(rss for at, rss, _ in curve if at >= rpcs // 2)
    end = curve[-1][1]
    memory = [(at, part["memory_mib"], 0.0) for (at, _, _), part in zip(curve, parts, strict=True)]
    return {
        "rpcs": rpcs,
        "seed": seed,
        "seconds": round(time.monotonic() - started, 1),
        "outcomes": outcomes,
        "curve": [
            {"rpcs": at, "rss_mib": round(rss, 1), "hwm_mib": round(hwm, 1), **part}
            for (at, rss, hwm), part in zip(curve, parts, strict=True)
        ],
        "rss_at_half_mib": round(half, 1),
        "rss_at_end_mib": round(end, 1),
        "second_half_growth": round(end / half - 1, 4),
        "peak_mib": round(max(hwm for _, _, hwm in curve), 1),
        # Tenant arenas come and go, so single samples swing by tens of MiB: compare the median RSS of
        # the second quarter with the last quarter's, and the highest of each half.
        "second_quarter_median_mib": round(quarter(curve, rpcs, 1), 1),
        "last_quarter_median_mib": round(quarter(curve, rpcs, 3), 1),
        "last_half_growth_of_medians": round(quarter(curve, rpcs, 3) / quarter(curve, rpcs, 1) - 1, 4),
        # The same over anon + arena files (what the machine gives the store, mapped or not), and
        # its parts: the interpreter's and gRPC's heap apart from the arenas.
        "last_half_growth_of_medians_memory": round(
            quarter(memory, rpcs, 3) / quarter(memory, rpcs, 1) - 1, 4
        ),
        "last_half_growth_of_medians_anon": round(
            part_quarter(curve, parts, rpcs, 3, "anon_mib") / part_quarter(curve, parts, rpcs, 1, "anon_mib")
            - 1,
            4,
        ),
        "last_half_growth_of_medians_arena_files": round(
            part_quarter(curve, parts, rpcs, 3, "arena_files_mib")
            / part_quarter(curve, parts, rpcs, 1, "arena_files_mib")
            - 1,
            4,
        ),
        "peak_memory_mib": round(max(part["memory_mib"] for part in parts), 1),
        # The target: the last half adds < 2% (medians of the second and last quarters).
        "plateau_met": quarter(memory, rpcs, 3) / quarter(memory, rpcs, 1) - 1 < 0.02,
        "last_half_growth_of_maxima": round(
            max(r for at, r, _ in curve if at > rpcs // 2)
            / max(r for at, r, _ in curve if 0 < at <= rpcs // 2)
            - 1,
            4,
        ),
    }


def quarter(curve: list[tuple[int, float, float]], rpcs: int, index: int) -> float:
    """The median RSS sampled in the index-th quarter of the run (0-based)."""
    low, high = rpcs * index // 4, rpcs * (index + 1) // 4
    return statistics.median(rss for at, rss, _ in curve if low < at <= high)


def part_quarter(
    curve: list[tuple[int, float, float]], parts: list[dict[str, float]], rpcs: int, index: int, name: str
) -> float:
    """The median of one memory part sampled in the index-th quarter of the run (0-based)."""
    low, high = rpcs * index // 4, rpcs * (index + 1) // 4
    return statistics.median(
        part[name] for (at, _, _), part in zip(curve, parts, strict=True) if low < at <= high
    )


def abandon(server: Server, count: int, retention_s: float, rounds: int) -> dict[str, Any]:
    """`rounds` times: open `count` namespaces (half the sessions closed, half left to expire), then
    wait out the retention window. Later rounds show whether what the first left behind is a leak or
    the allocators' high-water mark, reused."""
    cold = server.rss()[0]
    # The pre-run figure is the warmed store's: the first session creates the shared pool's arena,
    # prefaulted to --capacity up front (data-plane memory the run does not add to).
    warm = server.stub.OpenSession(
        pb.OpenSessionRequest(
            engine_id="warm", namespace=namespace(model="warm"), mode=mode(), probe_keys=PROBE
        ),
        timeout=10,
    )
    server.stub.CloseSession(pb.CloseSessionRequest(session_id=warm.session_id), timeout=10)
    time.sleep(5)
    before = server.rss()[0]
    before_parts = server.parts()
    each: list[dict[str, Any]] = []
    for r in range(rounds):
        started = time.monotonic()
        for i in range(count):
            opened = server.stub.OpenSession(
                pb.OpenSessionRequest(
                    engine_id=f"e{i}",
                    namespace=namespace(model=f"abandoned-{r}-{i}"),
                    mode=mode(),
                    probe_keys=PROBE,
                ),
                timeout=10,
            )
            if i % 2 == 0:
                server.stub.CloseSession(pb.CloseSessionRequest(session_id=opened.session_id), timeout=10)
        opened_s = time.monotonic() - started
        full = server.rss()[0]
        full_parts = server.parts()
        if r == 0:
            diagnose = diagnose_pages(server)
        # Sessions expire, the window passes, and the next sweep (every quarter window, at most 30 s) runs.
        time.sleep(retention_s + min(30.0, retention_s / 4) + 5)
        each.append(
            {
                "open_seconds": round(opened_s, 1),
                "rss_with_namespaces_mib": round(full, 1),
                "rss_after_retention_mib": round(server.rss()[0], 1),
                "parts_with_namespaces": full_parts,
                "parts_after_retention": server.parts(),
                "namespaces_listed_after": server.stub.Diagnose(
                    pb.DiagnoseRequest(), timeout=60
                ).total_namespaces,
            }
        )
        print(json.dumps({"round": r + 1, **each[-1]}), flush=True)
    first, last = each[0], each[-1]
    return {
        "namespaces": count,
        "rounds": rounds,
        "open_seconds": first["open_seconds"],
        "rss_cold_mib": round(cold, 1),
        "rss_before_mib": round(before, 1),
        "rss_with_namespaces_mib": first["rss_with_namespaces_mib"],
        "rss_after_retention_mib": first["rss_after_retention_mib"],
        "after_vs_before": round(first["rss_after_retention_mib"] / before - 1, 4),
        "parts_before": before_parts,
        "parts_with_namespaces": first["parts_with_namespaces"],
        "parts_after_retention": first["parts_after_retention"],
        "memory_after_vs_before": round(
            first["parts_after_retention"]["memory_mib"] / before_parts["memory_mib"] - 1, 4
        ),
        "memory_last_round_after_vs_first": round(
            last["parts_after_retention"]["memory_mib"] / first["parts_after_retention"]["memory_mib"] - 1, 4
        ),
        "namespaces_listed_after": last["namespaces_listed_after"],
        "each_round": each,
        **diagnose,
    }


def diagnose_pages(server: Server) -> dict[str, Any]:
    """The first page's latency with every namespace present, then a walk of every page."""
    timings = []
    for _ in range(5):
        t0 = time.perf_counter()
        page = server.stub.Diagnose(pb.DiagnoseRequest(), timeout=60)
        timings.append((time.perf_counter() - t0) * 1000)
    pages, largest, walked = 0, 0, 0
    request = pb.DiagnoseRequest(page_size=1000)
    while True:
        answer = server.stub.Diagnose(request, timeout=60)
        pages += 1
        largest = max(largest, answer.ByteSize())
        walked += len(answer.namespaces)
        if not answer.next_page_token:
            break
        request.page_token = answer.next_page_token
    return {
        "diagnose_first_page_ms": {
            "median": round(statistics.median(timings), 1),
            "all": [round(t, 1) for t in timings],
        },
        "diagnose_total_namespaces": page.total_namespaces,
        "diagnose_pages_of_1000": pages,
        "diagnose_largest_page_bytes": largest,
        "diagnose_namespaces_walked": walked,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rpcs", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--sample-every", type=int, default=1000)
    parser.add_argument("--abandon", type=int, default=20_000)
    parser.add_argument("--abandon-rounds", type=int, default=3, help="abandon phases, one after another")
    parser.add_argument("--census-retention", default="5s", help="the fuzz's window (seconds)")
    parser.add_argument(
        "--abandon-retention", default="90s", help="the abandon phase's window: longer than opening takes"
    )
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "soak_control_plane.json"))
    args = parser.parse_args()
    documented = [
        "--capacity",
        "32MiB",
        "--max-message-bytes",
        "64MiB",
        "--session-ttl-ms",
        "2000",
        "--census-retention",
        args.census_retention,
    ]
    result: dict[str, Any] = {
        "documented_flags": documented,
        "commit": subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip(),
        "load_average_at_start": Path("/proc/loadavg").read_text().split()[:3],
    }
    if args.rpcs:
        server = Server(documented)
        try:
            result["fuzz"] = fuzz(server, args.rpcs, args.seed, args.sample_every)
        finally:
            server.stop()
        print(json.dumps({k: v for k, v in result["fuzz"].items() if k != "curve"}, indent=1))
    if args.abandon:
        wide = [
            *documented[:-2],
            "--census-retention",
            args.abandon_retention,
            "--max-namespaces",
            str(args.abandon + 1000),
            "--max-namespaces-per-tenant",
            str(args.abandon + 1000),
            "--max-sessions",
            str(args.abandon + 1000),
            "--max-sessions-per-tenant",
            str(args.abandon + 1000),
        ]
        server = Server(wide)
        try:
            result["abandon"] = abandon(
                server, args.abandon, int(args.abandon_retention.rstrip("s")), args.abandon_rounds
            )
        finally:
            server.stop()
        print(json.dumps(result["abandon"], indent=1))
    result["load_average_at_end"] = Path("/proc/loadavg").read_text().split()[:3]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
