"""`kvfleet bench speculative` end to end on a small random model (the CPU): both runs, the
same greedy output, the figures it reports."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from kvfleet.cli.main import build_parser


def test_speculative_bench_reports_both_runs(
    tmp_path: Path, tiny_config: Callable[..., Path]
) -> None:
    config = tiny_config(hidden_size=64, intermediate_size=128, num_attention_heads=4)
    out = tmp_path / "result.json"
    args = build_parser().parse_args(
        [
            "bench",
            "speculative",
            f"--model={config}",
            "--load-format=dummy",
            "--dtype=float32",
            "--batch-size=3",
            "--output-len=12",
            "--repeats=1",
            "--max-model-len=512",
            '--speculative-config={"method": "ngram", "num_speculative_tokens": 3, '
            '"prompt_lookup_min": 1, "adaptive": false}',
            f"--json={out}",
        ]
    )
    assert args.run(args) == 0
    result = json.loads(out.read_text())
    assert result["same_output"] is True
    assert (result["diverged_requests"], result["first_divergence"]) == (0, [])
    for run in ("plain", "speculative"):
        assert result[run]["output_tokens"] == 3 * 12
    assert result["plain"]["draft_tokens"] == result["plain"]["proposal_steps"] == 0
    assert result["speculative"]["proposal_steps"] >= result["speculative"]["drafted_steps"] > 0
    assert result["speculative"]["draft_tokens"] > 0
    proposals = result["speculative"]["proposals"]  # (requests, drafts asked, got, ms)
    assert len(proposals) == min(32, result["speculative"]["proposal_steps"])
    assert all(n == 3 and k == 3 and 0 <= got <= 3 and ms > 0 for n, k, got, ms in proposals)
    assert "proposals" not in result["plain"]
    assert result["plain"]["kernel_variants_first_met"] == []  # (torch kernels on the CPU)
    assert result["speedup"] > 0
