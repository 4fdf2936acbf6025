"""Records, comparisons, the table that leads with ratios, and the plot of `make bench-serve`."""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

from .load import Workload

SUMMARY = (
    "completed",
    "duration",
    "request_throughput",
    "output_throughput",
    "median_ttft_ms",
    "p99_ttft_ms",
    "mean_ttft_ms",
    "median_tpot_ms",
    "mean_tpot_ms",
    "p99_tpot_ms",
)
SAMPLES = ("ttfts", "input_lens", "output_lens", "generated_texts", "errors")
# What an operator is told about a refused or split mode: kvtag's connector log lines.
TOLD = re.compile(
    r"refused engine|MODE_SPLIT|LAYOUT_SPLIT|MODE_REFUSED|mode split|hashes in mode|key_scheme:",
    re.IGNORECASE,
)


def record(
    scenario: str,
    system: str,
    phase: str,
    load: Workload,
    rate: tuple[str, int | None],
    result: dict[str, Any],
    before: dict[str, float],
    after: dict[str, float],
) -> dict[str, Any]:
    delta = {k.removeprefix("vllm:"): after[k] - before.get(k, 0.0) for k in after}
    prompt = delta["prompt_tokens_total"]
    local = delta["prefix_cache_hits_total"]
    external = delta["external_prefix_cache_hits_total"]
    queried = delta["external_prefix_cache_queries_total"]
    return {
        "scenario": scenario,
        "system": system,
        "phase": phase,
        "workload": load.name,
        "rate": rate[0],
        "max_concurrency": rate[1],
        "requests": load.requests,
        **{k: result.get(k) for k in SUMMARY},
        "counters": delta,
        "external_hit_tokens": external,
        "external_hit_rate": external / queried if queried else 0.0,
        "local_hit_tokens": local,
        "prefill_tokens_computed": prompt - local - external,
        "samples": {k: result.get(k) for k in SAMPLES},
    }


def compare(texts: list[str], cold: list[str] | None) -> dict[str, Any]:
    """Greedy outputs against the cold run's of the same load (same seed, same order); a request that
    failed (no text) is counted apart from one that answered differently."""
    if cold is None:
        return {"compared": 0, "differ": None, "failed": None}
    pairs = list(zip(texts, cold, strict=False))
    failed = [i for i, (a, _) in enumerate(pairs) if not a]
    differ = [i for i, (a, b) in enumerate(pairs) if a and a != b]
    return {"compared": len(pairs), "differ": len(differ), "differing_indexes": differ, "failed": len(failed)}


def with_cold_comparisons(records: list[dict[str, Any]]) -> None:
    """Each record's outputs against the `none` server's (no store: a cold run) for the same load and rate."""
    cold: dict[tuple[str, str, Any], list[str]] = {}
    for r in records:
        if r["system"] == "none" and r["phase"] in ("consumer", "single"):
            cold.setdefault((r["workload"], r["rate"], r["max_concurrency"]), r["samples"]["generated_texts"])
    for r in records:
        key = (r["workload"], r["rate"], r["max_concurrency"])
        r["outputs_vs_cold"] = compare(r["samples"]["generated_texts"] or [], cold.get(key))


def line(r: dict[str, Any]) -> str:
    return (
        f"{r['scenario']:<13} {r['system']:<26} {r['phase']:<9} {r['workload']:<30} "
        f"rate {r['rate']}/{r['max_concurrency']}: TTFT p50 {r['median_ttft_ms']:.0f} ms "
        f"p99 {r['p99_ttft_ms']:.0f} ms, TPOT {r['median_tpot_ms']:.1f} ms, "
        f"{r['request_throughput']:.3f} req/s, {r['output_throughput']:.1f} tok/s, "
        f"external hit {r['external_hit_tokens']:.0f} tok ({100 * r['external_hit_rate']:.1f}%), "
        f"computed {r['prefill_tokens_computed']:.0f} tok"
    )


def operator_lines(log: str, limit: int = 6) -> list[str]:
    return [ln.strip()[-400:] for ln in log.splitlines() if TOLD.search(ln)][:limit]


def probe_prompt(length: int, seed: int) -> list[int]:
    """Random token ids (2..511, no special tokens): a prompt of exactly `length` tokens."""
    rng = random.Random(seed)
    return [rng.randrange(2, 512) for _ in range(length)]


def _ratio(r: dict[str, Any], base: dict[str, Any] | None, field: str) -> str:
    if base is None or not r[field] or not base[field]:
        return "-"
    return f"{r[field] / base[field]:.2f}x"


def groups(document: dict[str, Any]) -> dict[tuple[str, str, str], dict[str, dict[str, Any]]]:
    """Measured (non-producer) records by (scenario, workload, rate) then system."""
    out: dict[tuple[str, str, str], dict[str, dict[str, Any]]] = {}
    for r in document["records"]:
        if r["phase"] == "producer":
            continue
        key = (r["scenario"], r["workload"], f"{r['rate']}/{r['max_concurrency'] or '-'}")
        out.setdefault(key, {})[r["system"]] = r
    return out


def _base(system: str) -> str:
    return system.split("/")[0]


def _outputs(cmp: dict[str, Any]) -> str:
    if cmp.get("differ") is None:
        return "-"
    same = cmp["compared"] - cmp["differ"] - cmp["failed"]
    return f"{same}/{cmp['compared']} same" + (f", {cmp['failed']} failed" if cmp["failed"] else "")


def table(document: dict[str, Any]) -> str:
    """Markdown: per scenario, load and rate, each system's ratios to none and to the peer first."""
    rows = [
        "| scenario | load | rate/conc | system | TTFT p50 vs none | TTFT p50 vs peer | out tok/s vs none | "
        "out tok/s vs peer | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | req/s | out tok/s | ext hit tok | "
        "ext hit % | prefill computed | outputs vs cold |",
        "|" + "---|" * 17,
    ]
    for (scenario, workload, rate), systems in groups(document).items():
        none = next((r for s, r in systems.items() if _base(s) == "none"), None)
        peer = next((r for s, r in systems.items() if _base(s) == "peer"), None)
        for system, r in systems.items():
            cmp = r.get("outputs_vs_cold", {})
            outputs = "cold run" if _base(system) == "none" else _outputs(cmp)
            rows.append(
                f"| {scenario} | {workload} | {rate} | {system} | "
                f"{_ratio(r, none, 'median_ttft_ms')} | "
                f"{_ratio(r, peer, 'median_ttft_ms')} | "
                f"{_ratio(r, none, 'output_throughput')} | "
                f"{_ratio(r, peer, 'output_throughput')} | "
                f"{r['median_ttft_ms']:.0f} | {r['p99_ttft_ms']:.0f} | {r['median_tpot_ms']:.1f} | "
                f"{r['request_throughput']:.3f} | {r['output_throughput']:.1f} | "
                f"{r['external_hit_tokens']:.0f} | "
                f"{100 * r['external_hit_rate']:.1f} | {r['prefill_tokens_computed']:.0f} | {outputs} |"
            )
    return "\n".join(rows)


def plot(document: dict[str, Any], path: Path) -> None:
    """TTFT p50 (ms) and output throughput (tokens/s) side by side, a bar per system in each
    scenario/load/rate group; one unit per axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grouped = groups(document)
    labels = [f"{s}\n{w.split('-')[0]}\n{r}" for s, w, r in grouped]
    colours = {
        "none": "tab:blue",
        "kvtag-mem": "tab:orange",
        "kvtag-mc": "tab:green",
        "peer": "tab:red",
        "peer+kvtag": "tab:purple",
    }
    fig, axes = plt.subplots(1, 2, figsize=(16, 6))
    for axis, field, unit in (
        (axes[0], "median_ttft_ms", "TTFT p50 (ms)"),
        (axes[1], "output_throughput", "output throughput (tokens/s)"),
    ):
        for i, members in enumerate(grouped.values()):
            width = 0.8 / len(members)
            for j, (system, r) in enumerate(members.items()):
                variant = "/" in system
                axis.bar(
                    i + (j - (len(members) - 1) / 2) * width,
                    r[field],
                    width,
                    color=colours.get(_base(system), "grey"),
                    hatch="//" if variant else None,
                    edgecolor="white" if variant else None,
                )
        axis.set_xticks(range(len(labels)), labels, fontsize=7)
        axis.set_ylabel(unit)
        axis.grid(axis="y", alpha=0.3)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colours.values()]
    handles.append(plt.Rectangle((0, 0), 1, 1, facecolor="grey", hatch="//", edgecolor="white"))
    names = [*colours, "variant (spec-eagle: lookahead, legacy; mismatch)"]
    axes[1].legend(handles, names, fontsize=7)
    axes[0].set_title("time to first token, p50 (lower is better)")
    axes[1].set_title("output throughput (higher is better)")
    fig.suptitle("make bench-serve: vllm bench serve against vllm serve (CPU, random Llama)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
