"""The gateway's request reading: which prompt it routes by."""

from __future__ import annotations

from kvfleet.gateway.app import first_prompt


def test_first_prompt_of_each_completions_form() -> None:
    assert first_prompt("hello") == "hello"
    assert first_prompt([5, 6, 7]) == [5, 6, 7]  # token ids, not a batch of ints
    assert first_prompt(["a", "b"]) == "a"
    assert first_prompt([[1, 2], [3]]) == [1, 2]
    assert first_prompt([]) == []
    for bad in (None, 3, [1.5], [True, 2], {"x": 1}):
        assert first_prompt(bad) is None
