"""One vLLM engine on CUDA with sleep mode and kvtag: generate, sleep, wake up, generate again.

Usage: python sleep_runner.py JOB.json RESULT.json. Sleep resets the local prefix cache, so the
second pass's hits can only come from the store, through the worker's restored KV views.
"""

from __future__ import annotations

import json
import sys
from typing import Any


def run(job: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=job["model"],
        dtype="float32",
        enforce_eager=True,
        enable_prefix_caching=True,
        enable_sleep_mode=True,
        disable_log_stats=False,
        block_size=job["block_size"],
        kv_transfer_config=job["kv_transfer_config"],
        gpu_memory_utilization=0.3,
    )
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True, detokenize=False)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]

    def generate() -> list[dict[str, Any]]:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return [
            {"token_ids": list(o.outputs[0].token_ids), "num_cached_tokens": int(o.num_cached_tokens or 0)}
            for o in outputs
        ]

    before = generate()
    llm.sleep(level=1)
    llm.wake_up()
    after = generate()
    llm.llm_engine.engine_core.shutdown()
    return {"before": before, "after": after}


if __name__ == "__main__":
    job_path, result_path = sys.argv[1], sys.argv[2]
    with open(job_path) as job_file:
        result = run(json.load(job_file))
    with open(result_path, "w") as result_file:
        json.dump(result, result_file)
