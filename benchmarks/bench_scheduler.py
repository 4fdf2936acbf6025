"""The connector's scheduler-side cost for a long prompt, on a real vLLM Scheduler (CPU) and store.

A 64k-token prompt (4,096 blocks of 16) is run once cold so its blocks are saved, the scheduler's
local prefix cache is reset, and the same prompt is scheduled again: the timed parts are the
connector's get_num_new_matched_tokens (one ordered Lookup of 4,096 keys through StoreClient) and
build_connector_meta (the load plan of the 4,096 hit blocks), both inside Scheduler.schedule().

They are reported in ms, as a share of the schedule() call they run in, and as a share of a nominal
engine step (--step-ms, default 25 ms: one decode step of an 8B model on one GPU; this machine has
no GPU, so the step is an assumption stated in the JSON, not a measurement).

    .venv-vllm/bin/python benchmarks/bench_scheduler.py [--tokens 65536] [--out results/scheduler.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from provenance import git_describe

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.connector.harness import Setup, llama_dir
from tests.store_process import StoreProcess

BLOCK = 16


class LongSetup(Setup):
    """The connector tests' engine with a context long enough for the prompt."""

    max_model_len: int = 4096

    def vllm_config(self) -> Any:
        vc = super().vllm_config()
        vc.model_config.max_model_len = self.max_model_len
        vc.scheduler_config.max_model_len = self.max_model_len
        return vc


def timed(record: list[float], method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            record.append(time.perf_counter() - t0)

    return wrapper


def run(args: argparse.Namespace) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="kvtag-bench-sched-"))
    blocks = args.tokens // BLOCK
    prompt = [(7 * i + 3) % 30000 + 10 for i in range(args.tokens)]
    with StoreProcess(root / "store.log", "--capacity", "1GiB") as store:
        setup = LongSetup(
            llama_dir(root), store.endpoint, num_blocks=blocks + 64, max_num_batched_tokens=args.tokens
        )
        setup.max_model_len = args.tokens + 64
        engine = setup.build()
        # The harness fills KV with a prefix function (quadratic in the prompt); only the scheduler
        # side is timed here, so the "forward" writes nothing.
        engine._forward = lambda out, layer, samples: None  # type: ignore[method-assign]
        try:
            engine.add("cold", prompt, max_tokens=1)
            engine.run(max_steps=20)
            engine.drain_saves(120)
            matched: list[float] = []
            meta: list[float] = []
            schedule: list[float] = []
            hits: list[int] = []
            rows: list[tuple[float, float, float]] = []
            conn = engine.connector
            conn.get_num_new_matched_tokens = timed(matched, conn.get_num_new_matched_tokens)  # type: ignore[method-assign]
            conn.build_connector_meta = timed(meta, conn.build_connector_meta)  # type: ignore[method-assign]
            engine.scheduler.schedule = timed(schedule, engine.scheduler.schedule)
            for n in range(args.repeats + 1):
                assert engine.scheduler.reset_prefix_cache(), "local prefix cache did not reset"
                del matched[:], meta[:], schedule[:]
                engine.add(f"warm-{n}", prompt, max_tokens=1)
                engine.step()
                hits.append(engine.requests[f"warm-{n}"].num_computed_tokens)
                first = (sum(matched), meta[0], schedule[0])
                engine.run(max_steps=20)
                if n:  # the first warm pass is dropped
                    rows.append(first)
        finally:
            engine.shutdown()
    matched_ms = [1e3 * r[0] for r in rows]
    meta_ms = [1e3 * r[1] for r in rows]
    schedule_ms = [1e3 * r[2] for r in rows]
    both = statistics.median(m + b for m, b in zip(matched_ms, meta_ms, strict=True))
    return {
        "benchmark": "bench_scheduler",
        "commit": git_describe(),
        "prompt_tokens": args.tokens,
        "blocks": blocks,
        "hit_tokens_scheduled": hits[1:],
        "load_avg": [round(x, 2) for x in os.getloadavg()],
        "get_num_new_matched_tokens_ms_median": round(statistics.median(matched_ms), 3),
        "build_connector_meta_ms_median": round(statistics.median(meta_ms), 3),
        "connector_ms_median": round(both, 3),
        "schedule_call_ms_median": round(statistics.median(schedule_ms), 3),
        "share_of_schedule_call": round(both / statistics.median(schedule_ms), 3),
        "nominal_step_ms": args.step_ms,
        "share_of_nominal_step": round(both / args.step_ms, 3),
        "samples_ms": {"matched": matched_ms, "meta": meta_ms, "schedule": schedule_ms},
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--step-ms", type=float, default=25.0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    report = run(args)
    print(json.dumps({k: v for k, v in report.items() if k != "samples_ms"}, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
