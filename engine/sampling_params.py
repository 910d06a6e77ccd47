"""SamplingParams: how one request's tokens are chosen and when it stops, validated on creation."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvfleet.engine.protocol.openai import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    LOGIT_BIAS_RANGE,
    MAX_INT32,
    MAX_INT64,
    MAX_LOGPROBS,
)
from kvfleet.engine.protocol.structured import GrammarSpec

# Below this, a temperature means greedy (argmax): dividing by it would overflow.
GREEDY_TEMPERATURE = 1e-5


@dataclass
class SamplingParams:
    """Per-request sampling knobs with OpenAI/vLLM semantics. Bad values raise ValueError,
    among them any that would not fit the tensor it goes into (no step can fail on them).

    `top_k=None` and `max_tokens=None` mean "no limit" (up to the context length). With `n > 1`
    and a seed, sample i is drawn with seed + i.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = COMPLETIONS_DEFAULT_MAX_TOKENS
    stop: str | Sequence[str] | None = None
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # With speculative decoding on: False keeps this request out of it (no drafts, one token
    # per step). Requests with penalties or logprobs are never drafted for.
    speculative: bool = True
    # token id -> a bias added to its logit before sampling (clamped to [-100, 100])
    logit_bias: Mapping[int, float] | None = None
    # What the output must match (a JSON schema, any JSON object, a regex, a choice, an EBNF
    # grammar): each token is sampled from those the grammar allows, and the end of sequence
    # only where the grammar is complete (engine/structured/).
    grammar: GrammarSpec | None = None
    stop_strings: tuple[str, ...] = field(init=False, default=())

    def __post_init__(self) -> None:
        self.stop_strings = _stop_strings(self.stop)
        if not isinstance(self.stop_token_ids, Sequence) or not all(
            _is_int(t) and 0 <= t <= MAX_INT32 for t in self.stop_token_ids
        ):
            raise ValueError(
                f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}"
            )
        self.stop_token_ids = tuple(self.stop_token_ids)
        self.logit_bias = _logit_bias(self.logit_bias)
        _check(_is_int(self.n) and self.n >= 1, f"n must be at least 1, got {self.n!r}")
        _check(
            _is_number(self.temperature) and 0 <= self.temperature < math.inf,
            f"temperature must be non-negative and finite, got {self.temperature!r}",
        )
        _check(
            _is_number(self.top_p) and 0 < self.top_p <= 1,
            f"top_p must be in (0, 1], got {self.top_p!r}",
        )
        _check(
            self.top_k is None or (_is_int(self.top_k) and 1 <= self.top_k <= MAX_INT32),
            f"top_k must be in [1, {MAX_INT32}] (or None to disable), got {self.top_k!r}",
        )
        _check(
            _is_number(self.min_p) and 0 <= self.min_p <= 1,
            f"min_p must be in [0, 1], got {self.min_p!r}",
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(
                _is_number(value) and -2 <= value <= 2, f"{name} must be in [-2, 2], got {value!r}"
            )
        _check(
            _is_number(self.repetition_penalty) and 0 < self.repetition_penalty < math.inf,
            f"repetition_penalty must be positive and finite, got {self.repetition_penalty!r}",
        )
        _check(
            self.max_tokens is None
            or (_is_int(self.max_tokens) and 1 <= self.max_tokens <= MAX_INT32),
            f"max_tokens must be in [1, {MAX_INT32}], got {self.max_tokens!r}",
        )
        _check(
            self.seed is None or (_is_int(self.seed) and -MAX_INT64 - 1 <= self.seed <= MAX_INT64),
            f"seed must be a 64-bit integer, got {self.seed!r}",
        )
        _check(
            isinstance(self.speculative, bool),
            f"speculative must be true or false, got {self.speculative!r}",
        )
        _check(
            self.grammar is None or isinstance(self.grammar, GrammarSpec),
            f"grammar must be a GrammarSpec, got {self.grammar!r}",
        )
        _check(
            self.grammar is None or not self.ignore_eos,
            "ignore_eos cannot be combined with an output constraint (the grammar decides where "
            "the output ends)",
        )
        _check(
            self.logprobs is None
            or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
            f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs!r}",
        )

    def check_token_ids(self, vocab_size: int) -> None:
        """ValueError for a `logit_bias` token id outside the model's vocabulary."""
        biased = [t for t in self.logit_bias or () if t >= vocab_size]
        if biased:
            raise ValueError(
                f"logit_bias: token id {biased[0]} is out of range for a vocabulary of {vocab_size}"
            )

    @property
    def may_speculate(self) -> bool:
        """Whether drafts may be verified for this request (penalties read every output token,
        logprobs are given per sampled token, a grammar masks each token from the one before:
        those requests decode one token a step)."""
        return (
            self.speculative
            and not self.has_penalties
            and self.logprobs is None
            and not self.logit_bias
            and self.grammar is None
        )

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def is_plain_greedy(self) -> bool:
        """Greedy, and its token is the logits' argmax as they come (no penalties, logit
        bias or grammar) with nothing else to return (no logprobs): an argmax alone serves it."""
        return (
            self.is_greedy
            and not self.has_penalties
            and not self.logit_bias
            and self.grammar is None
            and self.logprobs is None
        )

    @property
    def effective_temperature(self) -> float:
        """The temperature the samplers divide by, 0.0 for greedy: the one encoding of greedy
        every sampling path reads (`engine/sample/`)."""
        return 0.0 if self.is_greedy else self.temperature

    @property
    def needs_distribution(self) -> bool:
        """Whether sampling needs the whole (filtered) distribution, not just a race (a
        grammar's mask covers the whole vocabulary: with tensor parallelism a race sees a
        shard)."""
        return (
            self.grammar is not None
            or self.top_k is not None
            or self.top_p < 1
            or self.min_p > 0
            or self.has_penalties
            or self.logprobs is not None
            or bool(self.logit_bias)
        )

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1
        )


def _logit_bias(bias: object) -> dict[int, float] | None:
    if bias is None:
        return None
    if not isinstance(bias, Mapping) or not all(
        _is_int(k) and 0 <= k <= MAX_INT32 and _is_number(v) for k, v in bias.items()
    ):
        raise ValueError(f"logit_bias must map token ids to numbers, got {bias!r}")
    return {k: max(-LOGIT_BIAS_RANGE, min(LOGIT_BIAS_RANGE, float(v))) for k, v in bias.items()}


def _stop_strings(stop: object) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, Sequence) or not all(isinstance(s, str) for s in stop):
        raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
    if any(s == "" for s in stop):
        raise ValueError("stop strings must not be empty")
    return tuple(stop)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and not math.isnan(value)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
