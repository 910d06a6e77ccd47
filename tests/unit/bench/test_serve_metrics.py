"""`kvfleet bench serve`'s reading of a server's own histograms (bench/serve.py)."""

from __future__ import annotations

from kvfleet.bench.serve import engine_means, histogram_totals

EXPOSITION = """\
# HELP kvfleet:time_to_first_token_seconds Time to first token.
# TYPE kvfleet:time_to_first_token_seconds histogram
kvfleet:time_to_first_token_seconds_bucket{le="0.05",model_name="a"} 1.0
kvfleet:time_to_first_token_seconds_bucket{le="+Inf",model_name="a"} 2.0
kvfleet:time_to_first_token_seconds_count{model_name="a"} 2.0
kvfleet:time_to_first_token_seconds_sum{model_name="a"} 0.25
kvfleet:time_to_first_token_seconds_count{model_name="b"} 1.0
kvfleet:time_to_first_token_seconds_sum{model_name="b"} 0.05
# HELP vllm:time_to_first_token_seconds Time to first token.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_count{model_name="a"} 2.0
vllm:time_to_first_token_seconds_sum{model_name="a"} 9.0
# HELP vllm:request_queue_time_seconds Waiting before first scheduled.
# TYPE vllm:request_queue_time_seconds histogram
vllm:request_queue_time_seconds_count{model_name="a"} 3.0
vllm:request_queue_time_seconds_sum{model_name="a"} 0.03
# HELP other:time_to_first_token_seconds Someone else's.
# TYPE other:time_to_first_token_seconds histogram
other:time_to_first_token_seconds_count 7.0
other:time_to_first_token_seconds_sum 7.0
"""


def test_totals_sum_label_sets_and_prefer_our_prefix() -> None:
    totals = histogram_totals(EXPOSITION)
    assert totals["time_to_first_token_seconds"] == (0.30, 3.0)  # (kvfleet:, both models)
    assert totals["request_queue_time_seconds"] == (0.03, 3.0)  # (vllm: where ours is absent)


def test_means_cover_only_what_came_between_two_scrapes() -> None:
    before = {"time_to_first_token_seconds": (0.30, 3.0)}
    after = {"time_to_first_token_seconds": (0.50, 7.0), "request_queue_time_seconds": (1.0, 1.0)}
    assert engine_means(before, after) == {"ttft_ms_mean": 50.0}
    assert engine_means(after, after) == {}
    assert engine_means({}, {}) == {}
