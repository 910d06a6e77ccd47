"""The constrained requests an engine runs: each one's grammar (compiling, then compiled), a
matcher advanced with every token the request keeps, and the step's token masks, filled on the
host (one int32 bitmask row per sampled row; all ones where a row is free) and applied to the
logits at the top of `sample()`."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import torch

from kvfleet.engine.protocol.structured import GrammarSpec
from kvfleet.engine.structured.grammars import GrammarCompiler, GrammarError


class ConstrainedRequests:
    def __init__(self, compiler: GrammarCompiler) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.compiler = compiler
        self._grammars: dict[str, Future[Any]] = {}
        self._matchers: dict[str, Any] = {}

    def add(self, req_id: str, spec: GrammarSpec) -> None:
        """Start compiling the request's grammar (shared with any request of the same text)."""
        self._grammars[req_id] = self.compiler.submit(spec)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._grammars

    def is_ready(self, req_id: str) -> bool:
        """Whether the request's grammar is compiled (GrammarError if it cannot be)."""
        if req_id in self._matchers:
            return True
        future = self._grammars[req_id]
        if not future.done():
            return False
        compiled = future.result()  # (raises the compile's GrammarError)
        self._matchers[req_id] = self._xgr.GrammarMatcher(compiled)
        return True

    def bitmask(self, req_ids: Sequence[str]) -> torch.Tensor | None:
        """The step's masks, one row per sampled request in order (None: no row constrained):
        int32 [rows, ceil(vocab / 32)], a bit per token allowed."""
        rows = [(row, self._matchers[r]) for row, r in enumerate(req_ids) if r in self._matchers]
        if not rows:
            return None
        bitmask = self._xgr.allocate_token_bitmask(len(req_ids), self.compiler.vocab_size)
        for row, matcher in rows:
            matcher.fill_next_token_bitmask(bitmask, row)
        return bitmask

    def accept(self, req_id: str, token_ids: Sequence[int]) -> None:
        """The request keeps these tokens; GrammarError if its grammar refuses one (a mask
        was not applied: a bug, reported for that request alone)."""
        matcher = self._matchers.get(req_id)
        if matcher is None:
            return
        for token_id in token_ids:
            if not matcher.accept_token(token_id):
                raise GrammarError(f"token {token_id} does not follow the request's grammar")

    def is_terminated(self, req_id: str) -> bool:
        """Whether the grammar is done (it accepted the end-of-sequence token)."""
        matcher = self._matchers.get(req_id)
        return bool(matcher is not None and matcher.is_terminated())

    def remove(self, req_id: str) -> None:
        self._grammars.pop(req_id, None)
        self._matchers.pop(req_id, None)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Disallowed tokens' logits to -inf, in place (`bitmask` on the logits' device)."""
    import xgrammar as xgr

    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1])
