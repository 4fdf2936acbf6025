"""Fixtures: a real kvtag-store on loopback, tiny model dirs, and real-Scheduler engines against them."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.store_process import StoreProcess, store_starter

from .harness import Engine, Setup, llama_dir, qwen3_next_dir


@pytest.fixture(scope="session")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StoreProcess]:
    """One isolate-policy store shared by the tests that neither fault it nor need a policy."""
    with StoreProcess(tmp_path_factory.mktemp("store") / "store.log") as proc:
        yield proc


@pytest.fixture
def start_store(tmp_path: Path) -> Iterator[Callable[..., StoreProcess]]:
    """start_store(*serve_args, port=None) -> a private store for tests that fault it or set a policy."""
    with store_starter(tmp_path) as start:
        yield start


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {"llama": llama_dir(root), "qwen3_next": qwen3_next_dir(root)}


@pytest.fixture
def make_engine(models: dict[str, Path]) -> Iterator[Callable[..., Engine]]:
    """make_engine(endpoint, eagle=False, hybrid=False, **Setup fields) -> an Engine, shut down after."""
    engines: list[Engine] = []

    def factory(endpoint: str, *, eagle: bool = False, hybrid: bool = False, **fields: Any) -> Engine:
        if hybrid:
            fields.setdefault("block_size", 64)
            fields.setdefault("prefix_match_unit", 16)
        setup = Setup(
            models["qwen3_next" if hybrid else "llama"],
            endpoint,
            eagle_dir=models["llama"] if eagle else None,
            hybrid=hybrid,
            **fields,
        )
        engine = setup.build()
        engines.append(engine)
        return engine

    yield factory
    for engine in engines:
        engine.shutdown()
