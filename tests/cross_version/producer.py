"""One engine of a cross-version pair: run in another vLLM's environment by test_canonical_keys.

It serves `prompt` through that vLLM's real Scheduler with an EAGLE drafter and kvtag (canonical keys,
lookahead auto) against the given store, waits for its saves, and prints its block keys as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvtag_client.connector import compat

from tests.connector.harness import Setup


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--prompt", required=True, help="JSON list of token ids")
    args = parser.parse_args()
    prompt = json.loads(args.prompt)
    engine = Setup(
        args.model_dir, args.endpoint, eagle_dir=args.model_dir, extra={"engine_id": "cross-version-producer"}
    ).build()
    try:
        engine.add("p", prompt, max_tokens=2)
        engine.run()
        engine.drain_saves()
        keys = engine.connector._sched().track(engine.make_request("k", prompt, 1)).keys
        keys.refresh()
        report = {
            "vllm": compat.vllm_version(),
            "lookahead": engine.connector.lookahead_tokens,
            "mode_id": engine.connector.client().mode_id,
            "namespace_id": engine.connector.client().namespace_id,
            "keys": [keys.key(j).hex() for j in range(keys.num_keyed_blocks())],
            "saved_blocks": engine.worker_connector.stats.totals["saved_blocks"],
        }
    finally:
        engine.shutdown()
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
