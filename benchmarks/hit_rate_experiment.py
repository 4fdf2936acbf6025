"""Hit-rate experiment: what the EAGLE last-block drop costs, and what kvtag's lookahead keys win back.

A producer engine runs a GSM8K-style few-shot workload (shared instruction, k worked examples, a
question, then a multi-turn follow-up) against a fresh kvtag service; a consumer engine in a new
process then serves the same traffic. Every figure is the consumer's, read from vLLM's own
counters (local and external prefix-cache hits, prompt tokens), except the scheduler-side
connector time, which the runner measures around the connector's hooks.

Modes: spec off, EAGLE legacy (L=0), EAGLE lookahead (L=1), and a mismatch (producer lookahead,
consumer legacy) under `isolate` (nothing refuses; the split is silent) and under `strict`
(kvtag refuses the consumer at session open and names the differing field).

Run from the repo root (about 5 minutes on 2 cores):
    .venv-vllm/bin/python benchmarks/hit_rate_experiment.py
Writes benchmarks/results/hit_rate.{json,md,png}. Not part of `make test`.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.e2e.harness import kv_transfer_config, run_engine  # noqa: E402
from tests.e2e.models import build_all  # noqa: E402
from tests.store_process import StoreProcess  # noqa: E402

BLOCK = 32
INSTRUCTION = (
    "You are a careful math tutor. Solve each word problem step by step. Show every intermediate "
    "quantity, name its unit, and check the arithmetic before you continue. End with the final "
    "answer on its own line after four hash marks. Here are worked examples."
)
NAMES = ("Ava", "Ben", "Cara", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivo", "June", "Kai", "Lea")
ITEMS = ("apples", "pencils", "books", "cookies", "eggs", "stickers", "marbles", "cards")
FOLLOW_UPS = (
    "What if every price doubled? Recompute the total.",
    "Explain the second step again in simpler words.",
    "Check the answer by working backwards from the total.",
)


@dataclass(frozen=True)
class Problem:
    question: str
    solution: str


def _problem(rng: random.Random) -> Problem:
    name, other = rng.sample(NAMES, 2)
    item = rng.choice(ITEMS)
    have, buy, price, give = rng.randint(3, 40), rng.randint(2, 25), rng.randint(2, 9), rng.randint(1, 3)
    total = have + buy
    left = total - give
    question = (
        f"{name} has {have} {item} and buys {buy} more at {price} dollars each. "
        f"{name} then gives {give} {item} to {other}. How many {item} are left, and how much was spent?"
    )
    solution = (
        f"{name} starts with {have} {item}. After buying {buy} more there are {have} + {buy} = {total}. "
        f"Giving {give} away leaves {total} - {give} = {left}. The purchase cost {buy} * {price} = "
        f"{buy * price} dollars.\n#### {left} {item}, {buy * price} dollars"
    )
    return Problem(question, solution)


def build_workload(
    tokenizer_path: Path, conversations: int, shots: int, seed: int
) -> tuple[list[list[int]], list[list[int]]]:
    """Turn-1 and turn-2 prompts as token ids. Conversations share one of two few-shot sets.

    Turn 2 replays a recorded answer (the reference solution) and a follow-up question, as a
    trace replay does, so every prompt is known up front.
    """
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    rng = random.Random(seed)
    pool = [_problem(rng) for _ in range(2 * shots)]
    shot_sets = [pool[:shots], pool[shots:]]
    turn1, turn2 = [], []
    for index in range(conversations):
        shots_text = "\n\n".join(
            f"Question: {p.question}\nAnswer: {p.solution}" for p in shot_sets[index % 2]
        )
        asked = _problem(rng)
        first = f"{INSTRUCTION}\n\n{shots_text}\n\nQuestion: {asked.question}\nAnswer:"
        second = f"{first} {asked.solution}\n\nQuestion: {FOLLOW_UPS[index % len(FOLLOW_UPS)]}\nAnswer:"
        turn1.append(tokenizer.encode(first).ids)
        turn2.append(tokenizer.encode(second).ids)
    return turn1, turn2


@dataclass(frozen=True)
class Engine:
    speculative: bool
    lookahead: str  # "auto" (L=1 under EAGLE) or "off" (legacy keys, L=0)


SPEC_OFF = Engine(speculative=False, lookahead="auto")
LEGACY = Engine(speculative=True, lookahead="off")
LOOKAHEAD = Engine(speculative=True, lookahead="auto")

MODES: dict[str, tuple[Engine, Engine, str]] = {
    "spec off": (SPEC_OFF, SPEC_OFF, "isolate"),
    "EAGLE legacy": (LEGACY, LEGACY, "isolate"),
    "EAGLE lookahead": (LOOKAHEAD, LOOKAHEAD, "isolate"),
    "mismatch, not enforced (isolate)": (LOOKAHEAD, LEGACY, "isolate"),
    "mismatch, enforced (strict)": (LOOKAHEAD, LEGACY, "strict"),
}


def _job(
    engine: Engine,
    models: dict[str, Path],
    endpoint: str,
    prompts: tuple[list[list[int]], list[list[int]]],
    engine_id: str,
    max_tokens: int,
) -> dict[str, Any]:
    job: dict[str, Any] = {
        "model": str(models["llama"]),
        "block_size": BLOCK,
        "seed": 0,
        "warmup": True,
        "kv_transfer_config": kv_transfer_config(endpoint, lookahead=engine.lookahead, engine_id=engine_id),
        "steps": [
            {"prompts": prompts[0], "max_tokens": max_tokens, "sequential": False},
            {"prompts": prompts[1], "max_tokens": max_tokens, "sequential": False},
        ],
    }
    job["kv_transfer_config"]["kv_connector_extra_config"]["audit"] = False
    if engine.speculative:
        job["speculative_config"] = {
            "method": "eagle",
            "model": str(models["eagle"]),
            "num_speculative_tokens": 2,
        }
    return job


def _summarise(consumer: dict[str, Any], diagnosis: dict[str, Any], requests: int) -> dict[str, Any]:
    counters = consumer["counters"]
    prompt_tokens = counters["prompt_tokens"]
    external, local = counters["external_hit"], counters["local_hit"]
    seconds = sum(step["seconds"] for step in consumer["steps"])
    cpu_seconds = sum(step.get("cpu_seconds", 0.0) for step in consumer["steps"])
    timing = consumer.get("scheduler_connector_time") or {}
    modes = [m for ns in diagnosis.get("namespaces", []) for m in ns.get("modes", [])]
    refused = [r for ns in diagnosis.get("namespaces", []) for r in ns.get("refused", [])]
    return {
        "requests": requests,
        "prompt_tokens": prompt_tokens,
        "external_hit_tokens": external,
        "local_hit_tokens": local,
        "external_hit_rate": external / prompt_tokens if prompt_tokens else 0.0,
        "total_hit_rate": (external + local) / prompt_tokens if prompt_tokens else 0.0,
        "prefill_tokens_computed": prompt_tokens - external - local,
        "requests_per_s": requests / seconds if seconds else 0.0,
        # The machine is shared: requests per CPU-second of the engine process is the steadier figure.
        "requests_per_cpu_s": requests / cpu_seconds if cpu_seconds else 0.0,
        "connector_sched_us_per_step": timing.get("us_per_step", 0.0),
        "connector_sched_steps": timing.get("steps", 0),
        "cross_mode_misses": sum(int(m.get("counters", {}).get("cross_mode_misses", 0)) for m in modes),
        "refused_sessions": len(refused),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="kvtag-hit-rate-"))
    models = build_all(work / "models")
    prompts = build_workload(models["llama"] / "tokenizer.json", args.conversations, args.shots, args.seed)
    requests = len(prompts[0]) + len(prompts[1])
    results: dict[str, Any] = {
        "workload": {
            "conversations": args.conversations,
            "shots": args.shots,
            "turns": 2,
            "requests": requests,
            "prompt_tokens_turn1_mean": sum(map(len, prompts[0])) / len(prompts[0]),
            "prompt_tokens_turn2_mean": sum(map(len, prompts[1])) / len(prompts[1]),
            "block_size": BLOCK,
            "max_tokens": args.max_tokens,
            "seed": args.seed,
        },
        "modes": {},
    }
    for mode, (producer, consumer, policy) in MODES.items():
        store = StoreProcess(work / "store.log", "--policy", policy, process_group=True).start()
        try:
            slug = "".join(ch if ch.isalnum() else "-" for ch in mode.lower())
            started = time.perf_counter()
            run_engine(
                _job(producer, models, store.endpoint, prompts, "producer", args.max_tokens),
                work,
                f"{slug}-a",
            )
            measured = run_engine(
                _job(consumer, models, store.endpoint, prompts, "consumer", args.max_tokens),
                work,
                f"{slug}-b",
            )
            summary = _summarise(measured, store.diagnose(), requests)
            summary["wall_s"] = time.perf_counter() - started
            results["modes"][mode] = summary
            print(f"{mode}: {json.dumps(summary)}", flush=True)
        finally:
            store.kill()
    off = results["modes"]["spec off"]["external_hit_tokens"]
    for summary in results["modes"].values():
        summary["external_hit_tokens_vs_spec_off"] = summary["external_hit_tokens"] / off if off else 0.0
    return results


def table(results: dict[str, Any]) -> str:
    header = (
        "| mode | external hit rate | external hit tokens (vs spec off) | local hit tokens | "
        "prefill tokens computed | requests/s (wall) | requests/CPU-s | connector sched. µs/step | "
        "cross-mode misses | refused |\n"
        "|---|---|---|---|---|---|---|---|---|---|\n"
    )
    rows = []
    for mode, s in results["modes"].items():
        rows.append(
            f"| {mode} | {100 * s['external_hit_rate']:.1f}% | {s['external_hit_tokens']} "
            f"({s['external_hit_tokens_vs_spec_off']:.3f}) | {s['local_hit_tokens']} | "
            f"{s['prefill_tokens_computed']} | {s['requests_per_s']:.2f} | {s['requests_per_cpu_s']:.2f} | "
            f"{s['connector_sched_us_per_step']:.0f} | {s['cross_mode_misses']} | {s['refused_sessions']} |"
        )
    return header + "\n".join(rows) + "\n"


def plot(results: dict[str, Any], path: Path) -> None:
    """Grouped bars drawn with Pillow (vLLM's env has no matplotlib): hit rate and prefill work per mode."""
    from PIL import Image, ImageDraw, ImageFont

    modes = list(results["modes"])
    width, height, left, bottom, top = 1100, 560, 90, 150, 60
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default()
    plot_h = height - bottom - top
    draw.text(
        (left, 15),
        "kvtag on vLLM 0.32 (CPU): consumer engine, GSM8K-style few-shot + follow-up",
        fill="black",
        font=font,
    )
    draw.line((left, top, left, height - bottom), fill="black")
    draw.line((left, height - bottom, width - 20, height - bottom), fill="black")
    for pct in range(0, 101, 20):
        y = height - bottom - plot_h * pct / 100
        draw.line((left - 5, y, width - 20, y), fill=(225, 225, 225))
        draw.text((left - 40, y - 6), f"{pct}%", fill="black", font=font)
    max_prefill = max(s["prefill_tokens_computed"] for s in results["modes"].values()) or 1
    group = (width - left - 40) / len(modes)
    colours = ((46, 117, 182), (237, 125, 49), (120, 120, 120))
    for index, mode in enumerate(modes):
        s = results["modes"][mode]
        values = (s["external_hit_rate"], s["total_hit_rate"], s["prefill_tokens_computed"] / max_prefill)
        x0 = left + 20 + index * group
        bar = (group - 40) / 3
        for k, value in enumerate(values):
            x = x0 + k * bar
            draw.rectangle(
                (x, height - bottom - plot_h * value, x + bar - 4, height - bottom), fill=colours[k]
            )
            label = f"{100 * value:.0f}%" if k < 2 else str(s["prefill_tokens_computed"])
            draw.text((x, height - bottom - plot_h * value - 14), label, fill="black", font=font)
        for line_no, part in enumerate(mode.replace(", ", ",\n").split("\n")):
            draw.text((x0, height - bottom + 10 + 14 * line_no), part, fill="black", font=font)
    legend = (
        "external hit rate",
        "total hit rate (local+external)",
        "prefill tokens computed (scaled to max)",
    )
    for k, text in enumerate(legend):
        y = height - 60 + 16 * (k - 1)
        draw.rectangle((left, y, left + 12, y + 10), fill=colours[k])
        draw.text((left + 18, y - 2), text, fill="black", font=font)
    image.save(path)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--shots", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args()
    results = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "hit_rate.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.out / "hit_rate.md").write_text(table(results))
    plot(results, args.out / "hit_rate.png")
    print(table(results))


if __name__ == "__main__":
    main()
