"""SamplingParams validation: every bad knob is a ValueError that names it."""

from __future__ import annotations

import pytest

from kvfleet.engine.sampling_params import SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -0.1}, "temperature must be non-negative"),
        ({"temperature": float("nan")}, "temperature must be non-negative"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"top_k": 0}, r"top_k must be in \[1, 2147483647\]"),
        ({"top_k": 2**31}, r"top_k must be in \[1, 2147483647\]"),
        ({"temperature": float("inf")}, "temperature must be non-negative and finite"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty must be positive"),
        ({"seed": 2**63}, "seed must be a 64-bit integer"),
        ({"min_p": 1.5}, r"min_p must be in \[0, 1\]"),
        ({"max_tokens": 0}, r"max_tokens must be in \[1, 2147483647\]"),
        ({"max_tokens": 2.5}, r"max_tokens must be in \[1, 2147483647\]"),
        ({"n": 0}, "n must be at least 1"),
        ({"presence_penalty": 3}, r"presence_penalty must be in \[-2, 2\]"),
        ({"frequency_penalty": -3}, r"frequency_penalty must be in \[-2, 2\]"),
        ({"repetition_penalty": 0}, "repetition_penalty must be positive"),
        ({"logprobs": 21}, r"logprobs must be in \[0, 20\]"),
        ({"seed": "x"}, "seed must be a 64-bit integer"),
        ({"stop": 5}, "stop must be a string or a list of strings"),
        ({"stop": ["ok", 5]}, "stop must be a string or a list of strings"),
        ({"stop": [""]}, "stop strings must not be empty"),
        ({"stop_token_ids": ["a"]}, "stop_token_ids must be a list of token ids"),
        ({"stop_token_ids": 5}, "stop_token_ids must be a list of token ids"),
        ({"speculative": "no"}, "speculative must be true or false"),
    ],
)
def test_bad_values_raise(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_good_values() -> None:
    params = SamplingParams(temperature=0, stop="###", stop_token_ids=[5], top_k=3, max_tokens=None)
    assert params.is_greedy
    assert params.stop_strings == ("###",)
    assert params.stop_token_ids == (5,)
    assert not params.has_penalties
    assert SamplingParams(repetition_penalty=1.2).has_penalties
    assert SamplingParams(stop=["a", "b"]).stop_strings == ("a", "b")
