"""The dependent-launch switch (engine/layers/dependent_launch.py): off on the CPU, off when the
environment says 0, a clear error for any other value than 0 or 1; the kernel flag and the
launch option always given together."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kvfleet.engine.layers.dependent_launch import (
    ENV_SWITCH,
    dependent_launch,
    dependent_launch_args,
)


@pytest.mark.parametrize("value", ["0", "1"])
def test_the_cpu_never_launches_dependent(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(ENV_SWITCH, value)
    assert not dependent_launch(torch.device("cpu"))
    assert dependent_launch_args(torch.device("cpu")) == {"PDL": False, "launch_pdl": False}


@pytest.mark.parametrize("value", ["off", "false", "", "2"])
def test_a_switch_other_than_0_or_1_is_refused(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(ENV_SWITCH, value)
    with pytest.raises(ValueError, match=f"{ENV_SWITCH} must be 0 or 1"):
        dependent_launch(torch.device("cpu"))
