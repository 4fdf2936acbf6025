"""`make bench-serve`: what an operator sees with kvtag, against vLLM's own MooncakeStoreConnector (the peer)
and against no store, from real `vllm serve` processes driven over HTTP by `vllm bench serve`.

Systems (the same run, the same Mooncake cluster):
  none         vLLM's local prefix cache only
  kvtag-mem    kvtag's default store (memory backend)
  kvtag-mc     kvtag-store --backend mooncake on the cluster
  peer         vLLM's MooncakeStoreConnector on the cluster (MOONCAKE_CONFIG_PATH, wheel in the engine's env)
  peer+kvtag   the companion: KvtagConnector with data_path MooncakeStoreConnector, the peer on the same
               cluster with kvtag's mode-prefixed keys, admitted and counted by the kvtag-mem store

Scenarios: cross-engine (a producer server fills the store, a fresh consumer server serves the same
load), capacity (a local KV cache smaller than the working set), spec (EAGLE: kvtag lookahead keys,
kvtag legacy last-block drop, the peer), mismatch (producer and consumer configured differently).
Every Mooncake process (master, storage, kvtag-store --backend mooncake, every vLLM server) runs in
one private network namespace: this script re-executes itself under `unshare -n`.

    .venv-vllm/bin/python benchmarks/bench_serve.py [--quick] [--out benchmarks/results/serve.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from provenance import git_describe  # noqa: E402
from serve import report  # noqa: E402
from serve.cluster import Cluster, in_private_netns, memory_store, mooncake_store, rpc_seconds  # noqa: E402
from serve.load import Workload, bench_args, multi_turn, prefix_repetition, run  # noqa: E402
from serve.model import Shape, build  # noqa: E402
from serve.servers import Server, ServerSpec, kvtag_transfer, peer_transfer  # noqa: E402

from tests.net import free_port  # noqa: E402
from tests.store_process import StoreProcess  # noqa: E402

SYSTEMS = ("none", "kvtag-mem", "kvtag-mc", "peer", "peer+kvtag")
SAVE_SETTLE_S = 5.0  # after a producer's last response, before SIGTERM: the async saves drain
CLOSED = ("inf", 2)  # closed loop: as fast as 2 in-flight requests allow


class Bench:
    """One run: the model, the cluster and stores of the current scenario, and every record."""

    def __init__(self, args: argparse.Namespace, work: Path) -> None:
        self.args = args
        self.work = work
        self.models = build(work.parent / "models" if args.models is None else args.models, Shape())
        self.records: list[dict[str, Any]] = []
        self.prefill: dict[str, Any] = {}
        self.measure_prefill_first = not args.quick
        # Each kvtag memory store and the Mooncake segment: room for every block of a scenario.
        self.store_bytes = (256 if args.quick else 1024) << 20
        # The service and client run from this working tree: what they were when the run began.
        self.commit = git_describe()
        self.dirty = subprocess.run(
            ["git", "-C", str(REPO), "status", "--porcelain", "--", "store_service", "client", "proto"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.split("\n")
        self.seq = 0
        self.cluster: Cluster | None = None
        self.stores: dict[str, StoreProcess] = {}
        self.store_metrics: dict[str, str] = {}

    # -- stores --------------------------------------------------------------------------------
    @contextmanager
    def stores_for(self, scenario: str, policy: str = "isolate") -> Iterator[None]:
        """A fresh cluster and fresh kvtag stores per scenario, so no scenario hits another's blocks."""
        with ExitStack() as stack:
            self.cluster = Cluster(self.work, segment_bytes=self.store_bytes).start()
            stack.callback(self.cluster.stop)
            self.store_metrics = {s: f"127.0.0.1:{free_port()}" for s in ("kvtag-mem", "kvtag-mc")}
            mem = memory_store(
                self.work,
                f"store-mem-{scenario}",
                self.store_metrics["kvtag-mem"],
                self.store_bytes,
                "--policy",
                policy,
            )
            stack.callback(mem.start().stop)
            mc = mooncake_store(
                self.work,
                f"store-mc-{scenario}",
                self.store_metrics["kvtag-mc"],
                self.cluster,
                "--policy",
                policy,
            )
            stack.callback(mc.start(60).stop)
            self.stores = {"kvtag-mem": mem, "kvtag-mc": mc}
            yield

    def spec(self, system: str, role: str, *, eagle: bool = False, **kvtag: Any) -> ServerSpec:
        self.seq += 1
        engine = f"{system}-{role}-{self.seq}"
        speculative = (
            {"method": "eagle", "model": str(self.models["eagle"]), "num_speculative_tokens": 2}
            if eagle
            else None
        )
        if system == "none":
            return ServerSpec(engine, speculative=speculative)
        if system in ("peer", "peer+kvtag"):
            assert self.cluster is not None
            config = self.cluster.peer_config(self.work / f"mooncake-{engine}.json")
            transfer = peer_transfer(20000 + self.seq)
            if system == "peer+kvtag":
                # The same peer settings, under KvtagConnector: one key added, kv_connector changed.
                companion = {"data_path": "MooncakeStoreConnector", **transfer["kv_connector_extra_config"]}
                transfer = kvtag_transfer(self.stores["kvtag-mem"].endpoint, engine, **companion, **kvtag)
            return ServerSpec(
                engine, transfer, env={"MOONCAKE_CONFIG_PATH": str(config)}, speculative=speculative
            )
        extra = {**self.args.kvtag_config, **kvtag}
        return ServerSpec(
            engine, kvtag_transfer(self.stores[system].endpoint, engine, **extra), speculative=speculative
        )

    # -- servers and runs ------------------------------------------------------------------------
    def start(self, specs: list[ServerSpec], extra: list[str] | None = None) -> list[Server]:
        """Starts servers together (startup is mostly imports) and waits for all of them."""
        servers = []
        for s in specs:
            s.extra_args += extra or []
            servers.append(Server(s, self.models["target"], self.work, s.name).start())
        try:
            for server in servers:
                try:
                    server.wait_ready()
                except RuntimeError as failed:
                    # One restart: on this shared machine another session's OOM kill can take an engine.
                    print(f"{server.spec.name} did not start ({str(failed)[:200]}); again", flush=True)
                    server.stop()
                    server.start().wait_ready()
        except BaseException:
            for server in servers:
                server.stop()
            raise
        return servers

    def measure(
        self,
        server: Server,
        scenario: str,
        system: str,
        phase: str,
        load: Workload,
        rate: tuple[str, int | None],
    ) -> dict[str, Any]:
        before = server.counters()
        store = self.store_metrics.get(system.split("/")[0])
        rpc_before = rpc_seconds(store) if store else {}
        argv = bench_args(server.url, self.models["target"], load, rate[0], rate[1], self.args.seed)
        started = time.monotonic()
        result = run(argv)
        wall = time.monotonic() - started
        after = server.counters()
        record = report.record(scenario, system, phase, load, rate, result, before, after)
        if store:
            # The service hop, server side: each RPC method's calls and seconds during this run.
            rpc_after = rpc_seconds(store)
            record["store_rpc"] = {
                m: {
                    "calls": v[0] - rpc_before.get(m, [0, 0])[0],
                    "seconds": v[1] - rpc_before.get(m, [0, 0])[1],
                }
                for m, v in rpc_after.items()
            }
        record.update(
            command="vllm bench serve " + shlex.join(argv),
            server_start_s=round(server.started_s, 1),
            wall_s=round(wall, 1),
            load_avg=os.getloadavg(),
        )
        self.records.append(record)
        print(report.line(record), flush=True)
        self.save()
        return record

    def save(self) -> None:
        self.args.out.parent.mkdir(parents=True, exist_ok=True)
        self.args.out.write_text(json.dumps(self.document(), indent=1) + "\n")

    def document(self) -> dict[str, Any]:
        shape = Shape()
        report.with_cold_comparisons(self.records)
        return {
            "benchmark": "bench_serve",
            "quick": self.args.quick,
            "commit": self.commit,
            "dirty_paths": [p for p in self.dirty if p],
            "kvtag_config": self.args.kvtag_config,
            "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "load_avg_end": os.getloadavg()},
            "model": {**shape.__dict__, "kv_bytes_per_token": shape.kv_bytes_per_token(), **self.prefill},
            "records": self.records,
        }

    # -- scenarios -------------------------------------------------------------------------------
    def cross_engine(
        self, loads: list[tuple[Workload, list[tuple[str, int | None]]]], systems: tuple[str, ...]
    ) -> None:
        """Producers serve each load once and stop; fresh consumers then serve every load at every rate,
        their local prefix cache emptied after each run (the store keeps its blocks)."""
        scenario = "cross-engine"
        stored = [s for s in systems if s != "none"]
        with self.stores_for(scenario):
            servers = self.start([self.spec(s, "producer") for s in stored])
            try:
                for load, rates in loads:
                    for server, system in zip(servers, stored, strict=True):
                        self.measure(server, scenario, system, "producer", load, rates[-1])
                time.sleep(SAVE_SETTLE_S)
            finally:
                for server in servers:
                    server.stop()
            consumers = self.start([self.spec(s, "consumer") for s in systems])
            try:
                if self.measure_prefill_first and "none" in systems:
                    self.measure_prefill(consumers[systems.index("none")])
                for load, rates in loads:
                    for rate in rates:
                        for server, system in zip(consumers, systems, strict=True):
                            self.measure(server, scenario, system, "consumer", load, rate)
                            server.reset_local_cache()
            finally:
                for server in consumers:
                    server.stop()

    def capacity(self, load: Workload, blocks: int, systems: tuple[str, ...]) -> None:
        """One server per system whose local cache holds `blocks` blocks, a fraction of the working set."""
        scenario = "capacity"
        tokens = (blocks - 1) * 32  # vLLM keeps one block back: the longest prompt must fit in the rest
        extra = [
            f"--num-gpu-blocks-override={blocks}",
            f"--max-model-len={tokens}",
            f"--max-num-batched-tokens={tokens}",
        ]
        with self.stores_for(scenario):
            servers = self.start([self.spec(s, "single") for s in systems], extra)
            try:
                for server, system in zip(servers, systems, strict=True):
                    self.measure(server, scenario, system, "single", load, CLOSED)
            finally:
                for server in servers:
                    server.stop()

    def speculative(self, load: Workload) -> None:
        """Cross-engine under EAGLE, and the mismatch, on one set of producers.

        spec-eagle: kvtag with lookahead keys, kvtag with the legacy last-block drop (lookahead off),
        the peer, and none, all consumers under EAGLE. mismatch: consumers without speculative
        decoding read what EAGLE producers stored (kvtag-mc: lookahead keys, L=1, against the
        consumer's L=0; the peer: the same two engines); each records what its log told the operator.
        """
        producers = [
            ("kvtag-mem", "eagle-lookahead", {}),
            ("kvtag-mem", "eagle-legacy", {"lookahead": "off"}),
            ("kvtag-mc", "eagle-lookahead", {}),
            ("peer", "eagle", {}),
            ("peer+kvtag", "eagle", {}),
        ]
        consumers = [
            ("spec-eagle", "none", "eagle", True),
            ("spec-eagle", "kvtag-mem", "eagle-lookahead", True),
            ("spec-eagle", "kvtag-mem", "eagle-legacy", True),
            ("spec-eagle", "peer", "eagle", True),
            ("spec-eagle", "peer+kvtag", "eagle", True),
            ("mismatch", "kvtag-mc", "eagle-producer/spec-off-consumer", False),
            ("mismatch", "peer", "eagle-producer/spec-off-consumer", False),
            ("mismatch", "peer+kvtag", "eagle-producer/spec-off-consumer", False),
        ]
        settings = {f"{s}/{v}": kv for s, v, kv in producers}
        with self.stores_for("spec-eagle"):
            servers = self.start([self.spec(s, "producer", eagle=True, **kv) for s, _, kv in producers])
            try:
                for server, (system, variant, _) in zip(servers, producers, strict=True):
                    self.measure(server, "spec-eagle", f"{system}/{variant}", "producer", load, CLOSED)
                time.sleep(SAVE_SETTLE_S)
            finally:
                for server in servers:
                    server.stop()
            specs = [
                self.spec(s, "consumer", eagle=eagle, **settings.get(f"{s}/{v}", {}))
                for _, s, v, eagle in consumers
            ]
            servers = self.start(specs)
            told: list[tuple[dict[str, Any], str]] = []
            try:
                for server, (scenario, system, variant, _) in zip(servers, consumers, strict=True):
                    record = self.measure(server, scenario, f"{system}/{variant}", "consumer", load, CLOSED)
                    if scenario == "mismatch":
                        record["operator_told"] = report.operator_lines(server.log_text())
                        told.append((record, system))
            finally:
                for server in servers:
                    server.stop()
            # After the stops: a companion's last usage counts reach its store when its session closes.
            for record, system in told:
                store = self.stores.get("kvtag-mem" if system == "peer+kvtag" else system)
                if store is not None:
                    record["diagnose"] = store.cli("diagnose").splitlines()[:120]

    def measure_prefill(self, server: Server) -> None:
        """The model's prefill rate on a fresh server without a store: a 2,048-token prompt, 3 times;
        the local cache is emptied after."""
        try:
            times = []
            for i in range(3):
                prompt = report.probe_prompt(2048, seed=i)
                t = time.monotonic()
                server.complete(prompt, 1)
                times.append(time.monotonic() - t)
            best = min(times)
            self.prefill = {
                "prefill_2048_s": [round(x, 3) for x in times],
                "prefill_tokens_per_s_best": round(2048 / best, 1),
            }
            print(f"prefill of 2,048 tokens: {', '.join(f'{x:.2f}' for x in times)} s", flush=True)
        finally:
            server.reset_local_cache()


def reexec_in_netns() -> int:
    """Runs this same command again inside a new private network namespace with loopback up."""
    script = 'ip link set lo up && exec "$0" "$@"'
    command = ["unshare", "-n", "--", "bash", "-c", script, sys.executable, *sys.argv]
    return subprocess.run(command, check=False).returncode


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="cross-engine only, every system, a small load")
    parser.add_argument(
        "--requests", type=int, default=None, help="requests per run (default: 8 quick, 24 full)"
    )
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--scenarios", default="cross-engine,capacity,spec")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--kvtag-config",
        type=json.loads,
        default={},
        help="extra kv_connector_extra_config keys for every kvtag server, e.g. '{\"lookup_wait_ms\": 200}'",
    )
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "serve.json")
    parser.add_argument("--plot", type=Path, default=None, help="PNG to draw (default: none)")
    parser.add_argument("--models", type=Path, default=None, help="where the random models are built/reused")
    parser.add_argument("--workdir", type=Path, default=None, help="logs and configs (default: a temp dir)")
    args = parser.parse_args()
    if not in_private_netns():
        return reexec_in_netns()
    os.environ.setdefault("GLOG_minloglevel", "2")
    started = time.monotonic()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench-serve-"))
    work.mkdir(parents=True, exist_ok=True)
    if args.models is None:
        args.models = Path(tempfile.gettempdir()) / "kvtag-bench-serve-models"
    print(f"logs in {work}", flush=True)
    bench = Bench(args, work)
    systems = tuple(s for s in args.systems.split(",") if s)
    scenarios = args.scenarios.split(",")
    if args.quick:
        requests = args.requests or 8
        load = prefix_repetition(
            requests, prefixes=max(1, requests // 2), prefix_len=1024, suffix_len=128, output_len=16
        )
        bench.cross_engine([(load, [CLOSED])], systems)
    else:
        requests = args.requests or 16
        repetition = prefix_repetition(
            requests, prefixes=requests // 4, prefix_len=2048, suffix_len=256, output_len=32
        )
        chat = multi_turn(
            work / "multi_turn.jsonl",
            conversations=requests // 4,
            turns=4,
            system_words=400,
            turn_words=60,
            output_len=32,
        )
        if "cross-engine" in scenarios:
            bench.cross_engine([(repetition, [("0.5", None), CLOSED]), (chat, [CLOSED])], systems)
        if "capacity" in scenarios:
            many = prefix_repetition(
                requests * 2, prefixes=requests // 2, prefix_len=1024, suffix_len=128, output_len=16
            )
            bench.capacity(many, blocks=96, systems=systems)
        if "spec" in scenarios:  # and the mismatch, on the same producers
            bench.speculative(chat)
    document = bench.document()
    document["duration_s"] = round(time.monotonic() - started, 1)
    args.out.write_text(json.dumps(document, indent=1) + "\n")
    print(report.table(document), flush=True)
    if args.plot is not None:
        report.plot(document, args.plot)
    print(f"bench-serve took {document['duration_s']:.0f} s; results in {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
