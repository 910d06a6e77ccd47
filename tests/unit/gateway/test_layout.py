"""The gateway package stays importable without torch: its image does not have it."""

from __future__ import annotations

from collections.abc import Callable


def test_gateway_imports_no_torch(heavy_imports_of: Callable[..., list[str]]) -> None:
    assert heavy_imports_of("kvfleet.gateway") == []
