"""The launchers' integer helpers (engine/layers/grid.py) give Triton's own answers."""

from __future__ import annotations

import triton

from kvfleet.engine.layers.grid import cdiv, next_power_of_2


def test_cdiv_and_next_power_of_2_agree_with_triton() -> None:
    for n in range(0, 5000):
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in (1, 2, 3, 16, 64, 127, 128, 4096):
            assert cdiv(n, d) == triton.cdiv(n, d), (n, d)
    assert next_power_of_2(128256) == triton.next_power_of_2(128256) == 131072
