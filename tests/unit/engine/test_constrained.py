"""Token masks for constrained requests (engine/structured/matchers.py) on SmolLM2's
vocabulary: a constrained row can only sample what its grammar allows, a free row is
untouched, and a request ends when its grammar is done."""

from __future__ import annotations

import time

import pytest
import torch

from kvfleet.engine.loader.source import resolve_model_source
from kvfleet.engine.protocol.structured import GrammarSpec
from kvfleet.engine.sample.torch_sampler import apply_token_mask
from kvfleet.engine.structured.grammars import GrammarCompiler, GrammarError
from kvfleet.engine.structured.matchers import ConstrainedRequests
from kvfleet.engine.tokenizer import Tokenizer

pytest.importorskip("xgrammar")
VOCAB = 49152


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.load(resolve_model_source("smollm2"))


def ready(requests: ConstrainedRequests, req_id: str) -> None:
    deadline = time.monotonic() + 30
    while not requests.is_ready(req_id):
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_masks_keep_a_constrained_row_in_its_grammar(tokenizer: Tokenizer) -> None:
    requests = ConstrainedRequests(GrammarCompiler(tokenizer.hf, VOCAB))
    requests.add(["digits"], GrammarSpec("regex", "[0-9]{3}"))
    ready(requests, "digits")
    generator = torch.Generator().manual_seed(0)
    text = ""
    for _ in range(8):  # greedy decoding under the mask, until the grammar is done
        logits = torch.randn(2, VOCAB, generator=generator)
        free = logits[1].argmax().item()
        bitmask = requests.bitmask(["digits", "free"])
        assert bitmask is not None
        step = logits.clone()
        apply_token_mask(step, bitmask)
        assert step[1].argmax().item() == free  # the free row is untouched
        token = int(step[0].argmax())
        requests.accept("digits", [token])
        text += tokenizer.decode([token], skip_special_tokens=False)
        if requests.is_terminated("digits"):
            break
    assert requests.is_terminated("digits")
    assert text.removesuffix("<|im_end|>").isdigit()
    assert len(text.removesuffix("<|im_end|>")) == 3
    assert requests.bitmask(["free"]) is None  # no constrained row: no mask


def test_a_grammar_that_cannot_compile_fails_its_request(tokenizer: Tokenizer) -> None:
    requests = ConstrainedRequests(GrammarCompiler(tokenizer.hf, VOCAB))

    def add_and_compile() -> None:  # (refused when added, or once compiled)
        requests.add(["bad"], GrammarSpec("regex", "([a"))
        ready(requests, "bad")

    with pytest.raises(GrammarError, match="Unclosed"):
        add_and_compile()
    assert "bad" not in requests or requests.waiting() == ["bad"]
    requests.add(["ok"], GrammarSpec("regex", "a"))
    ready(requests, "ok")
    with pytest.raises(GrammarError, match="does not follow"):
        requests.accept("ok", tokenizer.encode("b", add_special_tokens=False))


def test_a_matcher_rolls_back_to_the_tokens_a_request_keeps(tokenizer: Tokenizer) -> None:
    requests = ConstrainedRequests(GrammarCompiler(tokenizer.hf, VOCAB))
    requests.add(["r"], GrammarSpec("regex", "ab|ac"))
    ready(requests, "r")
    a, b, c = (tokenizer.encode(t, add_special_tokens=False)[0] for t in "abc")
    requests.accept("r", [a, b])
    requests.keep("r", 1)  # ("b" was never delivered)
    requests.accept("r", [c])  # refused before the roll back: "abc" is not in the grammar
    with pytest.raises(GrammarError):
        requests.accept("r", [b])
