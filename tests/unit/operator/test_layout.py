"""The operator package: a namespace portion that never shadows the stdlib; no torch."""

from __future__ import annotations

import operator
import sysconfig
from collections.abc import Callable
from pathlib import Path

import kvfleet.operator


def test_operator_folder_is_a_namespace_portion(repo_root: Path) -> None:
    # NOTE: an __init__.py here would shadow the stdlib `operator` under `python -m pytest`.
    assert not (repo_root / "operator" / "__init__.py").exists()
    assert getattr(kvfleet.operator, "__file__", None) is None
    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    assert Path(operator.__file__).resolve().parent == stdlib


def test_operator_imports_no_torch(heavy_imports_of: Callable[..., list[str]]) -> None:
    assert heavy_imports_of("kvfleet.operator") == []


def test_cli_imports_no_torch(heavy_imports_of: Callable[..., list[str]]) -> None:
    # The gateway and operator images run the same `kvfleet` command (its parser reads the
    # engine's settings table; the operator derives engine arguments from it too).
    assert heavy_imports_of("kvfleet.cli", "kvfleet.engine.config") == []
    assert heavy_imports_of("kvfleet.engine.loader.model_cache") == []
