"""Incremental detokenization with the real SmolLM2 tokenizer: whole characters, stop strings."""

from __future__ import annotations

import random

import pytest

from kvfleet.engine.core.request import RequestId
from kvfleet.engine.core.scheduler_output import EngineCoreOutput
from kvfleet.engine.loader.source import resolve_model_source
from kvfleet.engine.output.detokenizer import IncrementalDetokenizer
from kvfleet.engine.output.processor import OutputProcessor
from kvfleet.engine.sampling_params import SamplingParams
from kvfleet.engine.tokenizer import Tokenizer

TEXT = "Robots 🤖 say 你好 and 👩‍💻 codes; naïve café — done. The end. Nothing after."


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.load(resolve_model_source("smollm2"))


def stream(detok: IncrementalDetokenizer, token_ids: list[int]) -> list[str]:
    """Feed tokens one at a time; the releasable text after each."""
    snapshots = []
    for token_id in token_ids:
        if detok.add_tokens([token_id]):
            break
        snapshots.append(detok.releasable_text)
    return snapshots


def test_multibyte_characters_are_never_split(tokenizer: Tokenizer) -> None:
    token_ids = tokenizer.encode(TEXT)
    assert len(token_ids) > len(TEXT.split())  # some characters span several tokens
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Prompt:"))
    for text in stream(detok, token_ids):
        assert "\ufffd" not in text
    assert detok.flush() == TEXT == tokenizer.decode(token_ids)


def test_random_token_streams_decode_like_the_whole(tokenizer: Tokenizer) -> None:
    rng = random.Random(0)
    for _ in range(20):
        token_ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(1, 40))]
        detok = IncrementalDetokenizer(tokenizer, [1, 2, 3])
        stream(detok, token_ids)
        assert detok.flush() == tokenizer.decode(token_ids)


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_is_never_emitted_in_part(tokenizer: Tokenizer, include: bool) -> None:
    token_ids = tokenizer.encode(TEXT)
    detok = IncrementalDetokenizer(
        tokenizer, [], stop_strings=["The end", "unused stop"], include_stop_str_in_output=include
    )
    snapshots = stream(detok, token_ids)
    expected = TEXT[: TEXT.index("The end") + (len("The end") if include else 0)]
    assert detok.stop_string == "The end"
    assert detok.releasable_text == expected
    for snapshot in snapshots:  # everything shown along the way survives in the final text
        assert expected.startswith(snapshot)
    assert not any(s.endswith(("The", "The e")) and not include for s in snapshots)


def test_tokens_past_a_stop_string_in_one_step_are_not_output(tokenizer: Tokenizer) -> None:
    """A step with several tokens (speculative decoding) that completes a stop string midway:
    the output ends with the token that completed it, as when the tokens come one a step."""
    token_ids = tokenizer.encode(TEXT)
    one_by_one = IncrementalDetokenizer(tokenizer, [], stop_strings=["The end"])
    used = len(stream(one_by_one, token_ids)) + 1  # (the stopping token included)
    assert used % 4  # (it comes mid-step below)

    processor = OutputProcessor(tokenizer)
    params = SamplingParams(stop=["The end"], max_tokens=100)
    processor.add_request("r", [RequestId("r")], "", [], params, 0.0)
    outputs, stopped = [], []
    for start in range(0, len(token_ids), 4):  # four tokens a step
        step = EngineCoreOutput(RequestId("r"), token_ids[start : start + 4], None)
        outputs, stopped = processor.process([step], 1.0)
        if stopped:
            break
    assert stopped == ["r"]
    (completion,) = outputs[0].outputs
    assert completion.token_ids == token_ids[:used]
    assert completion.text == one_by_one.text
    assert (completion.finish_reason, completion.stop_reason) == ("stop", "The end")
