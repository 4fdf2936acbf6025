"""Runs one vLLM engine in this (fresh) process for a JSON job and writes JSON results.

Every end-to-end figure the suite asserts on comes from vLLM itself: per-request
`RequestOutput.num_cached_tokens`, and the deltas of vLLM's own prefix-cache counters
(`vllm:prefix_cache_hits` for the local cache, `vllm:external_prefix_cache_hits` for the
connector) around each request. Connector counters are reported beside them, read from the
in-process connector objects, for the checks only the connector can answer (audit).

Usage: python engine_runner.py JOB.json RESULT.json
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ENGINE_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "HF_HUB_OFFLINE": "1",
}
for _name, _value in ENGINE_ENV.items():
    os.environ.setdefault(_name, _value)

_COUNTERS = {
    "local_hit": "vllm:prefix_cache_hits",
    "local_queries": "vllm:prefix_cache_queries",
    "external_hit": "vllm:external_prefix_cache_hits",
    "external_queries": "vllm:external_prefix_cache_queries",
    "prompt_tokens": "vllm:prompt_tokens",
}


def _counters(llm: Any) -> dict[str, int]:
    """vLLM's own cumulative counters, summed over label sets."""
    values = dict.fromkeys(_COUNTERS, 0)
    by_metric = {metric: key for key, metric in _COUNTERS.items()}
    for metric in llm.get_metrics():
        key = by_metric.get(metric.name)
        if key is not None and hasattr(metric, "value"):
            values[key] += int(metric.value)
    return values


def _core(llm: Any) -> Any:
    return llm.llm_engine.engine_core.engine_core


def _walk(obj: Any, depth: int = 0, seen: set[int] | None = None) -> Iterator[Any]:
    """Objects reachable from a connector through its attributes (bounded), to find recorders."""
    seen = set() if seen is None else seen
    if id(obj) in seen or depth > 3:
        return
    seen.add(id(obj))
    yield obj
    attrs = getattr(obj, "__dict__", None)
    if not isinstance(attrs, dict):
        return
    for value in attrs.values():
        if value is None or isinstance(value, str | bytes | int | float | bool):
            continue
        if isinstance(value, list | tuple | dict):
            continue
        yield from _walk(value, depth + 1, seen)


def _connector_totals(connectors: list[Any]) -> dict[str, int]:
    """Sums every stats recorder (an object with a `totals` dict) reachable from the connectors."""
    totals: dict[str, int] = {}
    seen: set[int] = set()
    for connector in connectors:
        for obj in _walk(connector):
            recorder_totals = getattr(obj, "totals", None)
            if isinstance(recorder_totals, dict) and id(recorder_totals) not in seen:
                seen.add(id(recorder_totals))
                for name, value in recorder_totals.items():
                    if isinstance(value, int):
                        totals[name] = totals.get(name, 0) + value
    return totals


def _worker_connector() -> Any:
    from vllm.distributed.kv_transfer.kv_transfer_state import (
        get_kv_transfer_group,
        has_kv_transfer_group,
    )

    return get_kv_transfer_group() if has_kv_transfer_group() else None


def _await_store(scheduler_connector: Any, timeout_s: float) -> float | None:
    """Seconds until every in-process connector's session is open (or refused), None on timeout.

    A connector whose first OpenSession fails (a TLS handshake cut short on a loaded machine) runs
    degraded and re-dials every reconnect interval, as it should; a test that asserts what a connected
    engine does waits for that here instead of racing it."""
    from kvtag_client.session import StoreState

    clients = [c.client() for c in (scheduler_connector, _worker_connector()) if c is not None]
    started = time.perf_counter()
    while time.perf_counter() - started < timeout_s:
        if all(client.state in (StoreState.CONNECTED, StoreState.REFUSED) for client in clients):
            return time.perf_counter() - started
        time.sleep(0.05)
    return None


class _SchedulerTimer:
    """Wall time spent in the scheduler-side connector hooks, measured from outside."""

    HOOKS = (
        "get_num_new_matched_tokens",
        "update_state_after_alloc",
        "build_connector_meta",
        "request_finished",
        "request_finished_all_groups",
        "update_connector_output",
    )

    def __init__(self, connector: Any) -> None:
        self.seconds = dict.fromkeys(self.HOOKS, 0.0)
        self.calls = dict.fromkeys(self.HOOKS, 0)
        for hook in self.HOOKS:
            original = getattr(connector, hook, None)
            if original is not None:
                setattr(connector, hook, self._wrap(hook, original))

    def _wrap(self, hook: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[hook] += time.perf_counter() - start
                self.calls[hook] += 1

        return timed

    def report(self) -> dict[str, Any]:
        steps = max(self.calls["build_connector_meta"], 1)
        return {
            "steps": self.calls["build_connector_meta"],
            "seconds": self.seconds,
            "calls": self.calls,
            "us_per_step": 1e6 * sum(self.seconds.values()) / steps,
        }


def _drain(llm: Any, timeout_s: float) -> None:
    """Steps the engine until the scheduler holds nothing (finish-time saves release their blocks)."""
    core = _core(llm)
    deadline = time.monotonic() + timeout_s
    while core.scheduler.has_requests() and time.monotonic() < deadline:
        core.step()
        time.sleep(0.01)


def _block_report(llm: Any) -> dict[str, Any]:
    core = _core(llm)
    pool = core.scheduler.kv_cache_manager.block_pool
    return {
        "requests_left": len(core.scheduler.requests),
        "has_requests": bool(core.scheduler.has_requests()),
        "free_blocks": int(pool.get_num_free_blocks()),
        # One block is vLLM's reserved null block; every other block should be free.
        "total_blocks": int(pool.num_gpu_blocks) - 1,
    }


def _wait_for(path: str, timeout_s: float) -> None:
    Path(path + ".ready").write_text("ready")
    deadline = time.monotonic() + timeout_s
    while not Path(path).exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"runner waited {timeout_s}s for {path}")
        time.sleep(0.05)


def _inject_state_fault(llm: Any, fault: str) -> None:
    """A fault in the Mamba state the store serves this engine, for the hybrid controls.

    Every state block a load receives is either replaced by zeros ("zero": a wrong state with the
    right size) or not delivered ("fail": a Get that failed, so the connector reports the load error
    and vLLM recomputes). Attention KV is untouched. Both StoreClient read paths are wrapped: the
    shared-memory `get_into` (what engines on the store's host use) and inline `get`.
    """
    from kvtag_client.connector.groups import classify
    from kvtag_client.inline.get_decoding import Value
    from kvtag_client.store import StoreClient

    state_groups = set(classify(_core(llm).scheduler.kv_cache_config).state_groups)
    assert state_groups, "a Mamba-state fault needs a hybrid model"
    real_get, real_get_into = StoreClient.get, StoreClient.get_into

    def get(self: Any, blocks: Any, leases: tuple[str, ...] = ()) -> list[Value | None]:
        values: list[Value | None] = real_get(self, blocks, leases)
        for n, (group, _key) in enumerate(blocks):
            value = values[n]
            if group in state_groups and value is not None:
                values[n] = bytes(len(value)) if fault == "zero" else None
        return values

    def get_into(
        self: Any, blocks: Any, leases: tuple[str, ...], sink: Callable[[int, memoryview], bool]
    ) -> list[bool]:
        def faulty_sink(n: int, source: memoryview) -> bool:
            if blocks[n][0] not in state_groups:
                return sink(n, source)
            return fault == "zero" and sink(n, memoryview(bytes(source.nbytes)))

        served: list[bool] = real_get_into(self, blocks, leases, faulty_sink)
        return served

    StoreClient.get = get  # type: ignore[method-assign]
    StoreClient.get_into = get_into  # type: ignore[method-assign]


def run(job: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    engine_kwargs: dict[str, Any] = {
        "model": job["model"],
        "dtype": job.get("dtype", "float32"),
        "enforce_eager": True,
        "enable_prefix_caching": True,
        "disable_log_stats": False,
        "seed": job.get("seed", 0),
    }
    for key in (
        "block_size",
        "mamba_cache_mode",
        "speculative_config",
        "kv_transfer_config",
        "max_num_seqs",
        "max_model_len",
        "tensor_parallel_size",
        "distributed_executor_backend",
    ):
        if job.get(key) is not None:
            engine_kwargs[key] = job[key]
    started = time.perf_counter()
    llm = LLM(**engine_kwargs)
    startup_s = time.perf_counter() - started
    core = _core(llm)
    if job.get("mamba_state_fault"):
        _inject_state_fault(llm, job["mamba_state_fault"])
    scheduler_connector = getattr(core.scheduler, "connector", None)
    timer = _SchedulerTimer(scheduler_connector) if scheduler_connector is not None else None
    store_ready_s = None
    if job.get("await_store_s"):
        store_ready_s = _await_store(scheduler_connector, float(job["await_store_s"]))

    baseline = dict.fromkeys(_COUNTERS, 0)
    if job.get("warmup"):
        # One short request (under a block: nothing to look up or save) takes the first-call costs
        # out of the measured steps; the reported counters start after it.
        warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, detokenize=False)
        llm.generate([TokensPrompt(prompt_token_ids=[3, 4, 5, 6, 7, 8, 9, 10])], warm, use_tqdm=False)
        baseline = _counters(llm)
    results: dict[str, Any] = {
        "startup_s": startup_s,
        "store_ready_s": store_ready_s,
        "block_size": int(core.scheduler.block_size),
        "steps": [],
    }
    for step in job["steps"]:
        if step.get("wait_for"):
            _wait_for(step["wait_for"], step.get("wait_timeout_s", 120.0))
        params = SamplingParams(
            temperature=0.0, max_tokens=step.get("max_tokens", 8), ignore_eos=True, detokenize=False
        )
        prompts = step["prompts"]
        batches = [[p] for p in prompts] if step.get("sequential", True) else [prompts]
        step_result: dict[str, Any] = {"requests": [], "seconds": 0.0, "cpu_seconds": 0.0}
        for batch in batches:
            before = _counters(llm)
            t0, cpu0 = time.perf_counter(), time.process_time()
            outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], params, use_tqdm=False)
            step_result["seconds"] += time.perf_counter() - t0
            step_result["cpu_seconds"] += time.process_time() - cpu0
            after = _counters(llm)
            delta = {key: after[key] - before[key] for key in _COUNTERS}
            for prompt, output in zip(batch, outputs, strict=True):
                request = {
                    "prompt_len": len(prompt),
                    "token_ids": list(output.outputs[0].token_ids),
                    "num_cached_tokens": int(output.num_cached_tokens or 0),
                    "finish_reason": output.outputs[0].finish_reason,
                }
                if len(batch) == 1:
                    request.update(delta)
                step_result["requests"].append(request)
            if len(batch) > 1:
                step_result["counters"] = delta
        results["steps"].append(step_result)

    _drain(llm, job.get("drain_timeout_s", 20.0))
    results["blocks"] = _block_report(llm)
    final = _counters(llm)
    results["counters"] = {key: final[key] - baseline[key] for key in _COUNTERS}
    connectors = [c for c in (scheduler_connector, _worker_connector()) if c is not None]
    worker = _worker_connector()
    # Which data path the worker's saves and loads took ("shared_memory" on one host, else "inline").
    # A companion (data_path MooncakeStoreConnector) has no worker-side client: the peer moves the bytes.
    client = getattr(worker, "client", None)
    results["worker_data_path"] = client().data_path if callable(client) else None
    results["scheduler_connector_time"] = timer.report() if timer is not None else None
    # A clean engine shutdown shuts the connector down, which flushes its pending saves:
    # the next engine process must find everything this one stored.
    t0 = time.perf_counter()
    llm.llm_engine.engine_core.shutdown()
    results["shutdown_s"] = time.perf_counter() - t0
    # Read after shutdown so audits and saves finished during the flush are counted.
    results["connector_totals"] = _connector_totals(connectors)
    return results


def main() -> None:
    job = json.loads(Path(sys.argv[1]).read_text())
    result = run(job)
    Path(sys.argv[2]).write_text(json.dumps(result))
    # Leave at once: engine teardown threads are not part of what the suite measures.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
