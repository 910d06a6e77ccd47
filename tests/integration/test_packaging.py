"""Packaging guards: the layout never shadows the standard library, and light images stay light.

Each install kind goes into a fresh virtual environment that borrows this environment's
third-party packages through a .pth line (so no dependency is downloaded) but gets kvfleet only
from the install under test.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(900)

STDLIB = Path(sysconfig.get_paths()["stdlib"]).resolve()


def run(python: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "PYTHONHOME"}}
    return subprocess.run(
        [str(python), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )


def fresh_venv(where: Path) -> Path:
    """A venv without kvfleet that sees this environment's dependencies; returns its python."""
    venv.EnvBuilder(with_pip=False, symlinks=True).create(where)
    python = where / "bin" / "python"
    purelib = run(
        python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=where
    ).stdout.strip()
    # NOTE: .pth files inside the borrowed folder are not processed, so this environment's
    # editable kvfleet (an import hook installed by a .pth) does not leak into the fresh one.
    Path(purelib, "borrowed-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python


def pip_install(python: Path, *spec: str, cwd: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            *spec,
        ],
        cwd=cwd,
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.fixture(scope="module", params=["editable", "regular"])
def installed_python(
    request: pytest.FixtureRequest, repo_root: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, Path]:
    kind: str = request.param
    work = tmp_path_factory.mktemp(f"install-{kind}")
    python = fresh_venv(work / "venv")
    if kind == "editable":
        pip_install(python, "-e", str(repo_root), cwd=work)
    else:
        # Build from a copy of the tracked tree so the build leaves nothing in the checkout.
        source = work / "src"
        tracked = (
            subprocess.run(
                ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                cwd=repo_root,
                capture_output=True,
                check=True,
            )
            .stdout.decode()
            .split("\0")
        )
        for name in filter(None, tracked):
            if (repo_root / name).is_file():
                (source / name).parent.mkdir(parents=True, exist_ok=True)
                (source / name).write_bytes((repo_root / name).read_bytes())
        pip_install(python, str(source), cwd=work)
    return kind, python


def test_stdlib_operator_is_not_shadowed(
    installed_python: tuple[str, Path], repo_root: Path
) -> None:
    _, python = installed_python
    result = run(
        python, "-c", "import collections, operator; print(operator.__file__)", cwd=repo_root
    )
    assert result.returncode == 0, result.stderr
    assert Path(result.stdout.strip()).resolve().parent == STDLIB


def test_components_import_from_the_install(
    installed_python: tuple[str, Path], repo_root: Path
) -> None:
    kind, python = installed_python
    code = (
        "import kvfleet.engine, kvfleet.gateway, kvfleet.operator, kvfleet.cli.main\n"
        "print(kvfleet.engine.__file__)\n"
        "print(list(kvfleet.operator.__path__)[0])\n"
    )
    result = run(python, "-c", code, cwd=repo_root)
    assert result.returncode == 0, result.stderr
    engine_file, operator_dir = (Path(line) for line in result.stdout.split())
    if kind == "editable":
        assert engine_file == repo_root / "engine" / "__init__.py"
        assert operator_dir == repo_root / "operator"
    else:
        assert "site-packages" in engine_file.parts
        assert operator_dir.parts[-2:] == ("kvfleet", "operator")
    version = run(python, "-m", "kvfleet.cli.main", "--version", cwd=repo_root)
    assert version.returncode == 0, version.stderr
    assert version.stdout.startswith("kvfleet 0.")


def test_pytest_collects_from_the_root(installed_python: tuple[str, Path], repo_root: Path) -> None:
    _, python = installed_python
    result = run(
        python, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", cwd=repo_root
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert (
        "tests/integration/test_packaging.py::test_pytest_collects_from_the_root" in result.stdout
    )
