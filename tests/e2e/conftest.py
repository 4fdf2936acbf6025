"""Fixtures for the end-to-end suite: locally built models, kvtag services, engine processes."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.store_process import StoreProcess, store_starter

from .models import build_all


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return build_all(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def work_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("e2e")


@pytest.fixture(scope="module")
def start_store(work_dir: Path) -> Iterator[Callable[..., StoreProcess]]:
    """Starts kvtag-store processes for a module, each in its own process group; all are stopped
    at its end (SIGTERM, so a store removes its shared-memory arena; SIGKILL after 10 s)."""
    with store_starter(work_dir, process_group=True) as start:
        yield start
