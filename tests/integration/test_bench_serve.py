"""`kvfleet bench serve` against the real engine server: every mode completes its requests and
reports what it measured."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import Server


@pytest.mark.parametrize(
    ("mode", "extra"),
    [
        ("random", ["--request-rate", "20"]),
        ("shared-prefix", ["--prefix-len", "40"]),
        ("blocker", ["--blocker-len", "60"]),
    ],
)
def test_bench_serve_modes(server: Server, tmp_path: Path, mode: str, extra: list[str]) -> None:
    report_file = tmp_path / "report.json"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvfleet.cli.main",
            "bench",
            "serve",
            "--base-url",
            server.base_url,
            "--mode",
            mode,
            "--num-prompts",
            "3",
            "--input-len",
            "4:12",
            "--output-len",
            "5",
            "--vocab-size",
            "49152",
            "--timeout",
            "60",
            "--json",
            str(report_file),
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    report = json.loads(report_file.read_text())
    runs = [report["alone"], report["with_blocker"]] if mode == "blocker" else [report]
    for run in runs:
        assert run["completed"] == 3
        assert run["failed"] == 0
        assert 0 < run["ttft_ms"]["p50"] <= run["e2e_ms"]["p50"]
        assert run["itl_ms"]["p50"] > 0
        assert run["output_tok_per_s"] > 0
    if mode == "blocker":
        assert report["blocker_ok"]
        assert report["itl_p99_ratio"] > 0
    if mode == "shared-prefix":
        assert report["primer_ttft_ms"] > 0
    if mode != "blocker":  # (the engine's own account: after the request reached it)
        engine = report["engine"]
        assert 0 < engine["ttft_ms_mean"] <= report["ttft_ms"]["mean"]
        assert 0 <= engine["queue_ms_mean"] < engine["ttft_ms_mean"]
