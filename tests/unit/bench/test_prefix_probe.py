"""bench/prefix_probe.py refuses lengths it cannot use before it loads anything."""

from __future__ import annotations

import sys

import pytest

from kvfleet.bench import prefix_probe


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--prefix-len", "0"], "--prefix-len must be at least 1"),
        (["--new-len", "-3"], "--new-len must be at least 1"),
        (["--repeats", "0"], "--repeats must be at least 1"),
        (["--prefix-len", "8000", "--new-len", "500"], "must fit the 8,192-token context"),
    ],
)
def test_bad_lengths_are_refused_with_the_flag_named(
    argv: list[str], says: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "argv", ["prefix_probe.py", *argv])
    monkeypatch.setattr(prefix_probe, "LLM", None)  # (loading would fail the test: it must not)
    with pytest.raises(SystemExit) as exited:
        prefix_probe.main()
    assert exited.value.code == 2
    assert says in capsys.readouterr().err
