"""Runs engine jobs against kvtag over a real Mooncake cluster, all in this private network namespace.

Started by test_mooncake_shared_memory.py under `unshare -n` with the service environment's Python
(.venv: kvtag-store, the Mooncake wheel and binaries); the engines run with the vLLM environment's
Python given on the command line, one after another, each writing its engine_runner result.

    python -m tests.e2e.mooncake_driver WORKDIR PORT VLLM_PYTHON NAME=JOB.json ...
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.mooncake.mooncake_cluster import MooncakeCluster, in_private_netns
from tests.mooncake.mooncake_replicas import Replica

RUNNER = Path(__file__).with_name("engine_runner.py")
ENGINE_TIMEOUT_S = 300


def main() -> int:
    workdir, port, vllm_python, *jobs = sys.argv[1:]
    if not in_private_netns():
        raise SystemExit("run inside `unshare -n` with loopback up")
    work = Path(workdir)
    shm_dir = Path("/dev/shm") / f"kvtag-e2e-mooncake-{os.getpid()}"
    shm_dir.mkdir(mode=0o700)
    cluster = MooncakeCluster(work)
    replica = Replica(cluster, work, "replica", [f"--shm-dir={shm_dir}"], port=int(port))
    env = dict(
        os.environ,
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_CPU_OMP_THREADS_BIND="nobind",
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
    )
    try:
        cluster.start_master()
        cluster.start_storage(256 << 20)
        replica.start()
        for spec in jobs:
            name, _, job = spec.partition("=")
            with (work / f"{name}.log").open("wb") as log:
                done = subprocess.run(
                    [vllm_python, str(RUNNER), job, str(work / f"{name}.result.json")],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    timeout=ENGINE_TIMEOUT_S,
                    check=False,
                )
            if done.returncode != 0:
                tail = (work / f"{name}.log").read_text(errors="replace").splitlines()[-40:]
                print(f"engine {name} failed (exit {done.returncode}):", *tail, sep="\n", file=sys.stderr)
                return 1
        return 0
    finally:
        replica.stop()
        cluster.stop()
        for leftover in shm_dir.iterdir():
            leftover.unlink()
        shm_dir.rmdir()


if __name__ == "__main__":
    raise SystemExit(main())
