"""Shared fixtures: the tiny GGUF models (written once per checkout) and one runtime."""

from __future__ import annotations

import inspect
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.models.make_models import build_all

if TYPE_CHECKING:  # the pure tests run without the extension (test_pure.py)
    from engine.session import Model, Runtime

MODELS_DIR = Path(__file__).parent / "models" / ".generated"


@pytest.hookimpl(tryfirst=True)
def pytest_pycollect_makeitem(collector: pytest.Collector, name: str, obj: object) -> None:
    """Every ``async def`` test runs on anyio's plugin (marked before it collects them)."""
    if inspect.iscoroutinefunction(obj) and name.startswith("test"):
        pytest.mark.anyio(obj)


@pytest.fixture
def anyio_backend() -> str:
    """asyncio, unless a module overrides this fixture (the engine's run on trio too)."""
    return "asyncio"


@pytest.fixture(scope="session")
def model_paths() -> dict[str, Path]:
    """Every tiny test model, generated on first use (seconds) and reused afterwards."""
    return build_all(MODELS_DIR)


@pytest.fixture(scope="session")
def runtime() -> Iterator[Runtime]:
    from engine.session import Runtime

    rt = Runtime()
    yield rt
    rt.close()


class ModelCache:
    """Loads each model once per test session."""

    def __init__(self, runtime: Runtime, paths: dict[str, Path]) -> None:
        self.runtime = runtime
        self.paths = paths
        self._loaded: dict[tuple[str, bool], Model] = {}

    def __call__(self, name: str, *, mtp: bool = False) -> Model:
        key = (name, mtp)
        if key not in self._loaded:
            from engine.session import Model

            self._loaded[key] = Model.load(self.runtime, self.paths[name], mtp=mtp)
        return self._loaded[key]


@pytest.fixture(scope="session")
def models(runtime: Runtime, model_paths: dict[str, Path]) -> ModelCache:
    return ModelCache(runtime, model_paths)


@pytest.fixture(scope="session")
def threads() -> int:
    return min(2, os.cpu_count() or 1)
