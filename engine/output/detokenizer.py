"""Incremental detokenization that never emits half a character, and stop-string handling.

Each step decodes a short window of tokens twice — up to the last emitted token and up to the
newest — and emits the difference, but only once it no longer ends in U+FFFD (a character whose
bytes are still arriving). Stop strings are searched in the text as it grows; text that could
still become the start of a stop string is held back until it cannot.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvfleet.engine.tokenizer import Tokenizer

# Prompt tokens kept as context so the first output token decodes as it would mid-text.
_CONTEXT_TOKENS = 5
_INCOMPLETE = "\ufffd"


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        stop_strings: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.stop_strings = tuple(stop_strings)
        self.include_stop_str_in_output = include_stop_str_in_output
        self.text = ""
        self.stop_string: str | None = None  # the stop string that ended the text, if any
        self.num_past_stop = 0

    @property
    def releasable_text(self) -> str:
        """The text that can be shown now: all of it once stopped, else all but a possible
        stop-string prefix at its end."""
        if self.stop_string is not None or not self.stop_strings:
            return self.text
        hold = max(len(s) for s in self.stop_strings) - 1
        return self.text[: max(0, len(self.text) - hold)] if hold else self.text

    def add_tokens(self, token_ids: Sequence[int], final: bool = False) -> bool:
        """Append tokens; returns True when a stop string ended the text (then
        `num_past_stop` of these tokens came after the one that completed it: a step that
        emits several tokens, with speculative decoding, may run past a stop string)."""
        self.num_past_stop = 0
        for i, token_id in enumerate(token_ids):
            self.token_ids.append(token_id)
            delta = self._decode_delta(final=False)
            if delta and self._append(delta):
                self.num_past_stop = len(token_ids) - i - 1
                return True
        if final:
            delta = self._decode_delta(final=True)
            if delta and self._append(delta):
                return True
        return False

    def flush(self) -> str:
        """At the end of generation: emit any trailing bytes, however incomplete."""
        self.add_tokens((), final=True)
        return self.text

    def _decode_delta(self, final: bool) -> str:
        prefix = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.token_ids[self.prefix_offset :])
        if len(full) <= len(prefix) or (full.endswith(_INCOMPLETE) and not final):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        return full[len(prefix) :]

    def _append(self, delta: str) -> bool:
        searched_from = len(self.text)
        self.text += delta
        if not self.stop_strings:
            return False
        longest = max(len(s) for s in self.stop_strings)
        start = max(0, searched_from - longest + 1)
        found = [(i, s) for s in self.stop_strings if (i := self.text.find(s, start)) >= 0]
        if not found:
            return False
        index, stop = min(found)
        end = index + len(stop) if self.include_stop_str_in_output else index
        self.text = self.text[:end]
        self.stop_string = stop
        return True

    def _decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)
