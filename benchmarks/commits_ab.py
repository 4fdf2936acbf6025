"""The shared-memory path at several commits, in interleaved rounds (issue 42): is HEAD slower?

Each commit is checked out in a detached worktree and run from there: its own bench_client.py, its
own client and store code (PYTHONPATH over the editable installs, and a kvtag-store launcher per
commit), in the same environments. A round runs every commit once, in turn, so a drift of the
machine's speed lands on all of them alike; each figure is also divided by the memcpy of its own run.

    .venv-vllm/bin/python benchmarks/commits_ab.py f52ef4e 1959b49 HEAD --rounds 3 \
        --out benchmarks/results/commits_ab.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
ROWS = (
    "memcpy_1MiB",
    "storeclient_put_1MiB_shm",
    "storeclient_get_into_1MiB_shm",
    "storeclient_get_1MiB_shm",
    "memcpy_64KiB",
    "storeclient_put_64KiB_shm",
    "storeclient_get_into_64KiB_shm",
)


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, check=True).stdout


def checkout(commit: str, root: Path) -> tuple[str, Path]:
    sha = git("rev-parse", "--short", commit).strip()
    tree = root / sha
    if not tree.exists():
        git("worktree", "add", "--detach", str(tree), sha)
    return sha, tree


def store_launcher(tree: Path, path: Path) -> Path:
    """kvtag-store of that commit: its entry point moved in the redesign (cli -> app.cli)."""
    module = (
        "kvtag_store.app.cli"
        if (tree / "store_service/kvtag_store/app/cli.py").exists()
        else "kvtag_store.cli"
    )
    path.write_text(
        "#!/bin/sh\n"
        f"PYTHONPATH={python_path(tree)} exec {REPO / '.venv/bin/python'} "
        f'-c "import sys; from {module} import main; sys.exit(main())" "$@"\n'
    )
    path.chmod(0o755)
    return path


def python_path(tree: Path) -> str:
    return ":".join(str(tree / p) for p in ("client", "store_service", "proto/python", "."))


def run_once(tree: Path, launcher: Path, repeats: int, out: Path) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": python_path(tree)}
    command = [sys.executable, "bench_client.py", "--kvtag-store", str(launcher), "--repeats", str(repeats)]
    done = subprocess.run(
        [*command, "--out", str(out)], cwd=tree / "benchmarks", env=env, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise RuntimeError(f"bench_client at {tree.name} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    rows = json.loads(out.read_text())["rows"]
    return {name: rows[name]["GBps_median"] for name in ROWS if name in rows}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("commits", nargs="+")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3, help="bench_client --repeats per run")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kvtag-ab-"))
    trees = [checkout(c, work) for c in args.commits]
    launchers = {sha: store_launcher(tree, work / f"kvtag-store-{sha}") for sha, tree in trees}
    runs: list[dict[str, Any]] = []
    try:
        for round_ in range(args.rounds):
            for sha, tree in trees:
                load = os.getloadavg()[0]
                figures = run_once(tree, launchers[sha], args.repeats, work / f"{sha}-{round_}.json")
                runs.append({"round": round_, "commit": sha, "load_avg_1m": round(load, 2), "GBps": figures})
                print(
                    f"round {round_} {sha}: load {load:.2f} "
                    + " ".join(f"{k}={v}" for k, v in figures.items())
                )
    finally:
        for _, tree in trees:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], check=False)
    summary: dict[str, dict[str, float]] = {}
    for sha, _ in trees:
        mine = [r for r in runs if r["commit"] == sha]
        for row in (r for r in ROWS if not r.startswith("memcpy")):
            memcpy = "memcpy_64KiB" if "64KiB" in row else "memcpy_1MiB"
            rates = [r["GBps"][row] for r in mine if row in r["GBps"]]
            shares = [r["GBps"][row] / r["GBps"][memcpy] for r in mine if row in r["GBps"]]
            if rates:
                summary.setdefault(sha, {})[row] = round(statistics.median(rates), 3)
                summary[sha][f"{row}_vs_memcpy"] = round(statistics.median(shares), 3)
    head = trees[-1][0]
    ratios = {
        sha: {
            row: round(summary[head][row] / summary[sha][row], 3)
            for row in summary[sha]
            if row in summary[head]
        }
        for sha, _ in trees[:-1]
    }
    document = {
        "benchmark": "commits_ab",
        "commits": [sha for sha, _ in trees],
        "rounds": args.rounds,
        "repeats": args.repeats,
        "cpus": os.cpu_count(),
        "finished_unix": int(time.time()),
        "runs": runs,
        "medians": summary,
        f"{head}_over": ratios,
    }
    args.out.write_text(json.dumps(document, indent=1) + "\n")
    print(json.dumps({"medians": summary, f"{head}_over": ratios}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
