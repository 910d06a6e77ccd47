"""The constrained requests an engine runs: each one's grammar (compiling, then compiled), a
matcher advanced with every token the request keeps (rolled back with tokens it loses), and
each step's token masks, filled on the host while the step's forward runs (one int32 bitmask
row per logits row; all ones where a row is free) and applied to the logits in `sample()`
(sample/torch_sampler.py `apply_token_mask`)."""

from __future__ import annotations

from collections.abc import Container, Iterable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

import torch

from kvfleet.engine.core.request import Request, RequestId
from kvfleet.engine.protocol.structured import GrammarSpec
from kvfleet.engine.structured.grammars import GrammarCompiler, GrammarError


class ConstrainedRequests:
    """The engine thread's side (`compiler.submit` alone may be called from any thread)."""

    def __init__(self, compiler: GrammarCompiler, device: torch.device | None = None) -> None:
        self.compiler = compiler
        self.device = device or torch.device("cpu")
        self._grammars: dict[str, Future[Any]] = {}
        self._matchers: dict[str, Any] = {}
        self._num_accepted: dict[str, int] = {}
        self._host: torch.Tensor | None = None  # the masks' host buffer, reused step to step
        self._copied: torch.cuda.Event | None = None  # its last copy to the device done
        self._batch: Any = None  # xgrammar's threaded mask filling
        self._expected: tuple[str, ...] | None = None  # the next mask's rows, if known
        self._pending: tuple[tuple[str, ...], Future[torch.Tensor | None]] | None = None
        self._filler = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvfleet-masks")

    @property
    def _xgr(self) -> Any:
        import xgrammar as xgr  # (imported with the first constrained request)

        return xgr

    def add(self, req_ids: Sequence[str], spec: GrammarSpec) -> set[str]:
        """Start compiling the requests' grammar (shared with any request of the same text);
        those ready now. GrammarError (none of them kept) if it is known not to compile."""
        future = self.compiler.submit(spec)
        try:
            for req_id in req_ids:
                self._grammars[req_id] = future
            return {r for r in req_ids if self.is_ready(r)}
        except GrammarError:
            for req_id in req_ids:
                self.remove(req_id)
            raise

    def admit(self, requests: Mapping[RequestId, Request], idle: bool) -> dict[str, str]:
        """The waiting requests whose grammar is now compiled may be scheduled (their
        `waits_for_grammar` cleared); returns those whose grammar cannot compile, with the
        reason. `idle`: nothing else can run, wait for a compile a little."""
        waiting = self.waiting()
        if idle and waiting:
            wait([self._grammars[r] for r in waiting], timeout=0.05, return_when=FIRST_COMPLETED)
        failed = {}
        for req_id in waiting:
            try:
                ready = self.is_ready(req_id)
            except GrammarError as exc:
                failed[req_id] = str(exc)
                continue
            if ready and (request := requests.get(RequestId(req_id))) is not None:
                request.waits_for_grammar = False
        return failed

    def advance(
        self, req_ids: Sequence[str], tokens: Sequence[list[int]], live: Container[str]
    ) -> dict[str, str]:
        """Each constrained request still `live` takes its new tokens (one that ended while
        the step ran takes none); those its grammar refuses, with the reason (a mask was not
        applied: a bug, to fail that request alone)."""
        self.settle()
        refused = {}
        for req_id, new in zip(req_ids, tokens, strict=True):
            if new and req_id in self._matchers and req_id in live:
                try:
                    self.accept(req_id, new)
                except GrammarError as exc:
                    refused[req_id] = str(exc)
        expected, self._expected = self._expected, None
        if expected is not None:
            self._pending = (expected, self._filler.submit(self._fill, expected))
        return refused

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._grammars

    def __bool__(self) -> bool:
        return bool(self._grammars)

    def waiting(self) -> list[str]:
        """The requests whose grammar is not compiled yet."""
        return [r for r in self._grammars if r not in self._matchers]

    def is_ready(self, req_id: str) -> bool:
        """Whether the request's grammar is compiled (GrammarError if it cannot be)."""
        if req_id in self._matchers:
            return True
        future = self._grammars[req_id]
        if not future.done():
            return False
        compiled = future.result()  # (raises the compile's GrammarError)
        self._matchers[req_id] = self._xgr.GrammarMatcher(compiled)
        self._num_accepted[req_id] = 0
        return True

    def any_in(self, req_ids: Iterable[str]) -> bool:
        """Whether any of these requests samples under a grammar."""
        matchers = self._matchers
        return bool(matchers) and any(r in matchers for r in req_ids)

    def expect(self, row_ids: Sequence[str]) -> None:
        """The next `bitmask` is for these rows: `advance` starts filling it on a worker
        thread once the matchers have their latest tokens, while the engine thread goes on
        with the step's outputs (xgrammar releases the GIL)."""
        self._expected = tuple(row_ids)

    def bitmask(self, row_ids: Sequence[str]) -> torch.Tensor | None:
        """The step's masks on the device, one row per logits row (`row_ids`: the request of
        each; None: no row constrained): int32 [rows, ceil(vocab / 32)], a bit per token
        allowed. The copy is queued without waiting."""
        pending, self._pending, self._expected = self._pending, None, None
        if pending is not None and pending[0] == tuple(row_ids):
            host = pending[1].result()
        else:
            self.settle()
            host = self._fill(tuple(row_ids))
        if host is None:
            return None
        on_device = host.to(self.device, non_blocking=True)
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()  # type: ignore[no-untyped-call]
            self._copied.record()
        return on_device

    def settle(self) -> None:
        """Wait for a fill in flight (before the matchers change outside a step)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending[1].result()

    def _fill(self, row_ids: tuple[str, ...]) -> torch.Tensor | None:
        rows = [
            (row, matcher)
            for row, req_id in enumerate(row_ids)
            if (matcher := self._matchers.get(req_id)) is not None
            and not matcher.is_terminated()  # (its request ends with this step)
        ]
        if not rows:
            return None
        if self._copied is not None:
            self._copied.synchronize()  # (done long ago: the step that read it has ended)
        host = self._host_rows(len(row_ids))
        host.fill_(-1)
        if self._batch is None:
            self._batch = self._xgr.BatchGrammarMatcher("auto")  # (threads: half the cores)
        self._batch.batch_fill_next_token_bitmask(
            [m for _, m in rows], host, indices=[row for row, _ in rows]
        )
        return host

    def accept(self, req_id: str, token_ids: Sequence[int]) -> None:
        """The request keeps these tokens; GrammarError if its grammar refuses one (its mask
        was not applied: a bug, reported for that request alone)."""
        matcher = self._matchers.get(req_id)
        if matcher is None:
            return
        for token_id in token_ids:
            if not matcher.accept_token(token_id):
                raise GrammarError(f"token {token_id} does not follow the request's grammar")
            self._num_accepted[req_id] += 1

    def keep(self, req_id: str, num_tokens: int) -> None:
        """The request goes on from its first `num_tokens` outputs (after a failed step): the
        matcher forgets the tokens after them."""
        self.settle()
        matcher = self._matchers.get(req_id)
        extra = self._num_accepted.get(req_id, 0) - num_tokens
        if matcher is not None and extra > 0:
            matcher.rollback(extra)
            self._num_accepted[req_id] = num_tokens

    def is_terminated(self, req_id: str) -> bool:
        """Whether the grammar is done (it accepted the end-of-sequence token)."""
        matcher = self._matchers.get(req_id)
        return bool(matcher is not None and matcher.is_terminated())

    def close(self) -> None:
        """Stop the compile and mask-filling threads (idempotent)."""
        self.compiler.close()
        self._filler.shutdown(wait=False, cancel_futures=True)

    def remove(self, *req_ids: str) -> None:
        for req_id in req_ids:
            self._grammars.pop(req_id, None)
            self._matchers.pop(req_id, None)
            self._num_accepted.pop(req_id, None)

    def _host_rows(self, num_rows: int) -> torch.Tensor:
        host = self._host
        if host is None or host.shape[0] < num_rows:
            words = self._xgr.get_bitmask_shape(1, self.compiler.vocab_size)[1]
            capacity = max(num_rows, 2 * (host.shape[0] if host is not None else 32))
            host = torch.empty((capacity, words), dtype=torch.int32)
            if self.device.type == "cuda":
                host = host.pin_memory()
            self._host = host
        return host[:num_rows]
