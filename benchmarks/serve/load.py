"""The load: `vllm bench serve`, vLLM's own load generator, over HTTP, and the workloads it replays.

`vllm bench serve ARGS` is `vllm.benchmarks.serve.main(parse(ARGS))`; calling that main here with the
same ARGS saves importing vLLM again for every run (20-50 s on this 2-core machine). Each run records
the equivalent command line.
"""

from __future__ import annotations

import argparse
import io
import json
import random
from contextlib import redirect_stdout
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.e2e.models import WORDS

PERCENTILES = "50,99"


@dataclass(frozen=True)
class Workload:
    """A dataset as `vllm bench serve` flags; `requests` prompts, `output_len` tokens each (EOS ignored)."""

    name: str
    args: tuple[str, ...]
    requests: int
    output_len: int


def prefix_repetition(
    requests: int, prefixes: int, prefix_len: int, suffix_len: int, output_len: int
) -> Workload:
    """A few long shared prefixes, each with distinct suffixes (vLLM's `prefix_repetition` dataset)."""
    return Workload(
        f"prefix_repetition-{prefixes}x{prefix_len}+{suffix_len}",
        (
            "--dataset-name=prefix_repetition",
            f"--prefix-repetition-num-prefixes={prefixes}",
            f"--prefix-repetition-prefix-len={prefix_len}",
            f"--prefix-repetition-suffix-len={suffix_len}",
            f"--prefix-repetition-output-len={output_len}",
        ),
        requests,
        output_len,
    )


def _sentence(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)) + "."


def multi_turn(
    path: Path, conversations: int, turns: int, system_words: int, turn_words: int, output_len: int
) -> Workload:
    """Conversations whose every turn's prompt is the previous turn's plus an answer and a new question,
    replayed in order through vLLM's `custom` dataset (one JSONL line per turn, no chat template)."""
    rng = random.Random(20240527)
    lines = []
    for c in range(conversations):
        prompt = f"Conversation {c}. " + _sentence(rng, system_words)
        for t in range(turns):
            prompt += f" Question {t}: " + _sentence(rng, turn_words)
            lines.append({"prompt": prompt, "output_tokens": output_len})
            prompt += " Answer: " + _sentence(rng, turn_words // 2)
    # Turn-major order: every conversation's turn t comes before any turn t+1, as in a live chat load.
    ordered = [lines[c * turns + t] for t in range(turns) for c in range(conversations)]
    path.write_text("".join(json.dumps(line) + "\n" for line in ordered))
    return Workload(
        f"multi_turn-{conversations}x{turns}",
        (
            "--dataset-name=custom",
            f"--dataset-path={path}",
            f"--custom-output-len={output_len}",
            "--skip-chat-template",
            "--disable-shuffle",
        ),
        len(ordered),
        output_len,
    )


def bench_args(
    url: str, model: Path, load: Workload, rate: str, concurrency: int | None, seed: int
) -> list[str]:
    args = [
        "--backend=vllm",
        f"--base-url={url}",
        f"--model={model}",
        f"--tokenizer={model}",
        *load.args,
        f"--num-prompts={load.requests}",
        f"--request-rate={rate}",
        "--temperature=0",
        "--ignore-eos",
        f"--seed={seed}",
        "--percentile-metrics=ttft,tpot,itl,e2el",
        f"--metric-percentiles={PERCENTILES}",
        "--save-detailed",
        "--disable-tqdm",
    ]
    if concurrency is not None:
        args.append(f"--max-concurrency={concurrency}")
    return args


def run(args: list[str]) -> dict[str, Any]:
    """One `vllm bench serve` run; returns its result JSON (with per-request TTFTs and texts)."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    namespace: argparse.Namespace = parser.parse_args(args)
    printed = io.StringIO()
    with redirect_stdout(printed):
        result: dict[str, Any] = main(namespace)
    result["printed"] = printed.getvalue()
    return result
