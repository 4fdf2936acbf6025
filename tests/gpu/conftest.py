"""The GPU suite: vLLM 0.34 with CUDA (as `pip install vllm` gives it), a tiny local model, a real store.

Without a CUDA device every test here is skipped with one reason (`make test-gpu` does not even
build its environment then, and says so in one line).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.store_process import StoreProcess, store_starter

NO_CUDA = "no CUDA device: the GPU suite runs only where torch.cuda.is_available()"


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _cuda():
        return
    skip = pytest.mark.skip(reason=NO_CUDA)
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/") + "/":
            item.add_marker(skip)


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from tests.e2e.models import build_llama

    return {"llama": build_llama(tmp_path_factory.mktemp("models") / "llama")}


@pytest.fixture
def work_dir(tmp_path: Path) -> Path:
    return tmp_path


@pytest.fixture
def start_store(tmp_path: Path) -> Iterator[Callable[..., StoreProcess]]:
    """start_store(*serve_args) -> a private store (the throughput test needs a larger one)."""
    with store_starter(tmp_path) as start:
        yield start
