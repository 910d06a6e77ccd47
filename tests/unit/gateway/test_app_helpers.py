"""The gateway's request reading: every prompt of a request (the reservation counts them all,
routing goes by the first)."""

from __future__ import annotations

from kvfleet.gateway.requests import all_prompts


def test_all_prompts_of_each_completions_form() -> None:
    assert all_prompts("hello") == ["hello"]
    assert all_prompts([5, 6, 7]) == [[5, 6, 7]]  # token ids, not a batch of ints
    assert all_prompts(["a", "b"]) == ["a", "b"]
    assert all_prompts([[1, 2], [3]]) == [[1, 2], [3]]
    assert all_prompts([]) == [[]]
