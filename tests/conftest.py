"""Suite-wide pytest wiring: the `gpu` marker, its skip without CUDA, and shared fixtures."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
GPU_TESTS = REPO_ROOT / "tests" / "gpu"


def _cuda_available() -> bool:
    # NOTE: torch is imported only here, lazily: gateway/operator-only environments lack it.
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.is_relative_to(GPU_TESTS):
            item.add_marker(pytest.mark.gpu)
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if gpu_items and not _cuda_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU (run tests/gpu on the device machine)")
        for item in gpu_items:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


HEAVY_MODULES = ("torch", "triton", "transformers")


@pytest.fixture(scope="session")
def heavy_imports_of() -> Callable[..., list[str]]:
    """`heavy_imports_of(*packages)`: which of HEAVY_MODULES a fresh interpreter has loaded after
    importing every module of the given packages (the gateway and operator images lack them)."""

    def heavy_imports_of(*packages: str) -> list[str]:
        code = (
            "import importlib, json, pkgutil, sys\n"
            f"for name in {packages!r}:\n"
            "    path = getattr(importlib.import_module(name), '__path__', [])\n"
            "    for module in pkgutil.walk_packages(path, name + '.'):\n"
            "        importlib.import_module(module.name)\n"
            f"print(json.dumps(sorted(m for m in {HEAVY_MODULES!r} if m in sys.modules)))\n"
        )
        result = subprocess.run(
            [sys.executable, "-c", code],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            check=False,
            timeout=120,
        )
        assert result.returncode == 0, result.stderr
        loaded: list[str] = json.loads(result.stdout)
        return loaded

    return heavy_imports_of
