"""The device benchmarks refuse counts they cannot use when parsed, before they touch a GPU."""

from __future__ import annotations

import sys

import pytest

from kvfleet.bench import attention_steps, gemv


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


@pytest.mark.parametrize("tiles", ["8,512,4", "8,512,4,x", "8,500,4,3", "0,512,4,3", "8,512,3,3"])
def test_gemv_bench_refuses_tiles_a_launch_cannot_take(
    tiles: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`bench/gemv.py --tiles`: four numbers, positive, blocks and warps powers of two."""
    monkeypatch.setattr(sys, "argv", ["gemv.py", "--tiles", "8,1024,4,3", tiles])
    monkeypatch.setattr(gemv, "measure_ceilings", None)  # (it must not get there)
    with pytest.raises(SystemExit) as exited:
        gemv.main()
    assert exited.value.code == 2
    assert f"{tiles!r}: want BLOCK_N,BLOCK_K,warps,stages" in capsys.readouterr().err
