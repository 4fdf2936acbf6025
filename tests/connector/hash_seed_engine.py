"""Run as a subprocess: one key_scheme=vllm engine under the PYTHONHASHSEED it was started with.

For each endpoint, prints one JSON line: the store state, mode id, seed fingerprint, refusal diff
fields, the external hit for the shared prompt, and whether its request finished.
Usage: MODEL_DIR ENGINE_ID ENDPOINT [ENDPOINT ...].
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

PROMPT = [7000 + i for i in range(3 * 16 + 4)]


def serve_once(model_dir: Path, endpoint: str, engine_id: str) -> dict[str, Any]:
    """Build a key_scheme=vllm engine, ask for the shared prompt, run it, and report."""
    if __package__:
        from .harness import Setup
    else:  # run as a script: this directory is on sys.path
        from harness import Setup  # type: ignore[no-redef]

    engine = Setup(model_dir, endpoint, extra={"key_scheme": "vllm", "engine_id": engine_id}).build()
    hit = engine.external_hit("probe", PROMPT)
    request = engine.add("run", PROMPT, max_tokens=2)
    engine.run()
    engine.drain_saves()
    client = engine.connector.client()
    refusal = client.refusal
    report = {
        "state": client.state.name,
        "mode_id": client.mode_id,
        "seed": engine.connector.hashing_mode().seed_fingerprint,
        "refused_fields": [d.field for d in refusal.diffs] if refusal is not None else [],
        "hit": hit,
        "finished": request.is_finished(),
        "saved": engine.worker_connector.stats.totals["saved_blocks"],
    }
    engine.shutdown()
    return report


def main() -> None:
    model_dir, engine_id, *endpoints = sys.argv[1:]
    for endpoint in endpoints:
        print(json.dumps(serve_once(Path(model_dir), endpoint, engine_id)))


if __name__ == "__main__":
    main()
