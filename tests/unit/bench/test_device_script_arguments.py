"""The device benchmarks refuse counts they cannot use when parsed, before they touch a GPU."""

from __future__ import annotations

import sys

import pytest

from kvfleet.bench import attention_steps


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--part", "prompt-splits", "--splits", "0"], "--splits: must be at least 1, got 0"),
        (["--part", "tiles", "--min-split", "-4"], "--min-split: must be at least 1, got -4"),
    ],
)
def test_attention_steps_refuses_split_counts_below_one(
    argv: list[str], says: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "argv", ["attention_steps.py", *argv])
    monkeypatch.setattr(attention_steps, "measure_ceilings", None)  # (it must not get there)
    with pytest.raises(SystemExit) as exited:
        attention_steps.main()
    assert exited.value.code == 2
    assert says in capsys.readouterr().err
