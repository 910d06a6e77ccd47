"""Grammars for constrained decoding, compiled by xgrammar (the library vLLM and SGLang use):
a JSON schema, any JSON object, a regex, a choice among strings, or an EBNF grammar, each
compiled once against the model's tokenizer and cached by its text. Compiling runs on worker
threads (xgrammar releases the GIL), off the engine's step loop: a request waits in the
scheduler until its grammar is ready while the others keep stepping.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from kvfleet.engine.protocol.structured import GrammarSpec

logger = logging.getLogger(__name__)

MAX_CACHED_GRAMMARS = 512
# Whitespace between JSON elements, at most: room for indented output, none for the endless
# newlines a small model falls into under a grammar that allows any whitespace.
MAX_JSON_WHITESPACE = 32


class GrammarError(ValueError):
    """A grammar that cannot be compiled (HTTP 400 with the reason)."""


class GrammarCompiler:
    """Compiles `GrammarSpec`s for one tokenizer on a worker thread; the same text compiles
    once (its future is shared, success or failure, up to MAX_CACHED_GRAMMARS of them)."""

    def __init__(
        self,
        hf_tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Sequence[int | None] = (),
        threads: int = 2,
    ) -> None:
        """`vocab_size`: the model's (its logits' width, which may pass the tokenizer's);
        `stop_token_ids`: the tokens that end a request, allowed where the grammar is complete
        (default: the tokenizer's end of sequence). The tokenizer is read on the worker thread
        with the first grammar (a large vocabulary takes a second)."""
        self.vocab_size = vocab_size
        stops = sorted({t for t in stop_token_ids if t is not None})
        self._tokenizer = (hf_tokenizer, stops or None)
        self._threads = threads
        self._compiler: Any = None
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvfleet-grammar")
        self._futures: dict[GrammarSpec, Future[Any]] = {}
        self._lock = threading.Lock()
        self._starting = threading.Lock()

    def submit(self, spec: GrammarSpec) -> Future[Any]:
        """The compiled grammar (xgrammar's CompiledGrammar), when ready; its exception is a
        GrammarError saying what is wrong."""
        with self._lock:
            future = self._futures.get(spec)
            if future is None:
                if len(self._futures) >= MAX_CACHED_GRAMMARS:
                    self._futures.pop(next(iter(self._futures)))  # the oldest
                future = self._futures[spec] = self._pool.submit(self._compile, spec)
            return future

    def compile(self, spec: GrammarSpec) -> Any:
        """`submit`, waiting for the result (offline use and tests)."""
        return self.submit(spec).result()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, spec: GrammarSpec) -> Any:
        compiler = self._compiler or self._start()
        try:
            if spec.kind == "json_object":  # (an object: not any JSON value)
                return compiler.compile_json_schema(
                    '{"type": "object"}', max_whitespace_cnt=MAX_JSON_WHITESPACE
                )
            if spec.kind == "json":
                return compiler.compile_json_schema(
                    _schema_text(spec.text), max_whitespace_cnt=MAX_JSON_WHITESPACE
                )
            if spec.kind == "regex":
                return compiler.compile_regex(spec.text)
            if spec.kind == "structural_tag":
                return compiler.compile_structural_tag(spec.text)
            if spec.kind == "choice":
                options = json.loads(spec.text)
                return compiler.compile_grammar(_choice_grammar(options))
            return compiler.compile_grammar(spec.text)
        except GrammarError:
            raise
        except (RuntimeError, ValueError) as exc:
            # (xgrammar's messages start with a timestamp and a C++ source location)
            reason = str(exc).strip().split(": ", 1)[-1]
            raise GrammarError(f"the {spec.kind} cannot be compiled: {reason}") from None

    def _start(self) -> Any:
        import xgrammar as xgr

        with self._starting:
            if self._compiler is None:
                hf_tokenizer, stop_token_ids = self._tokenizer
                info = xgr.TokenizerInfo.from_huggingface(
                    hf_tokenizer, vocab_size=self.vocab_size, stop_token_ids=stop_token_ids
                )
                self._compiler = xgr.GrammarCompiler(info, max_threads=self._threads)
        return self._compiler


def _schema_text(text: str) -> str:
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as exc:
        raise GrammarError(f"the JSON schema is not valid JSON: {exc}") from None
    if not isinstance(schema, dict | bool):
        raise GrammarError("a JSON schema must be an object (or a boolean)")
    return text


def _choice_grammar(options: Sequence[str]) -> str:
    """EBNF accepting exactly one of `options`."""
    return "root ::= " + " | ".join(json.dumps(o) for o in options)
