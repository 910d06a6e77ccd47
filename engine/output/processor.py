"""OutputProcessor: engine-core outputs -> detokenized, stop-string-checked RequestOutputs.

A request with `n > 1` runs as n child sequences in the scheduler; this is where they are
gathered back into one RequestOutput.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvfleet.engine.core.request import RequestId
from kvfleet.engine.core.scheduler_output import EngineCoreOutput
from kvfleet.engine.output.detokenizer import IncrementalDetokenizer
from kvfleet.engine.output.request_output import CompletionOutput, RequestMetrics, RequestOutput
from kvfleet.engine.sampling_params import SamplingParams
from kvfleet.engine.tokenizer import Tokenizer


@dataclass
class _Child:
    parent: _Parent
    completion: CompletionOutput
    detokenizer: IncrementalDetokenizer | None


@dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    metrics: RequestMetrics
    children: list[_Child]
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return all(c.completion.finished for c in self.children)

    def to_output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[_released(c) for c in self.children],
            finished=self.finished,
            metrics=self.metrics,
            num_cached_tokens=self.num_cached_tokens,
        )


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self.children: dict[RequestId, _Child] = {}

    def add_request(
        self,
        request_id: str,
        child_ids: list[RequestId],
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
    ) -> None:
        parent = _Parent(request_id, prompt, prompt_token_ids, RequestMetrics(arrival_time), [])
        for index, child_id in enumerate(child_ids):
            detokenizer = None
            if self.tokenizer is not None:
                detokenizer = IncrementalDetokenizer(
                    self.tokenizer,
                    prompt_token_ids,
                    params.skip_special_tokens,
                    params.stop_strings,
                    params.include_stop_str_in_output,
                )
            completion = CompletionOutput(
                index, "", [], logprobs=[] if params.logprobs is not None else None
            )
            child = _Child(parent, completion, detokenizer)
            parent.children.append(child)
            self.children[child_id] = child

    def num_delivered(self, child_id: RequestId) -> int | None:
        """The output tokens recorded for a child (those its client gets: outputs are
        cumulative); None once it has finished."""
        child = self.children.get(child_id)
        return None if child is None else len(child.completion.token_ids)

    def mark_scheduled(self, child_id: RequestId, now: float) -> None:
        child = self.children.get(child_id)
        if child is not None and child.parent.metrics.first_scheduled_time is None:
            child.parent.metrics.first_scheduled_time = now

    def process(
        self, outputs: list[EngineCoreOutput], now: float, final_only: bool = False
    ) -> tuple[list[RequestOutput], list[RequestId]]:
        """The updated requests (only the finished ones if `final_only`: no per-step copies),
        and the children a stop string ended (to finish in the core)."""
        updated: dict[str, _Parent] = {}
        stopped: list[RequestId] = []
        for out in outputs:
            child = self.children.get(out.req_id)
            if child is None:
                continue
            if self._apply(child, out, now):
                stopped.append(out.req_id)
            parent = child.parent
            updated[parent.request_id] = parent
            if child.completion.finished:
                del self.children[out.req_id]
                if parent.finished:
                    parent.metrics.finished_time = now
        parents = [p for p in updated.values() if p.finished or not final_only]
        return [p.to_output() for p in parents], stopped

    def abort(self, child_ids: list[RequestId], now: float) -> list[RequestOutput]:
        outputs = [
            EngineCoreOutput(child_id, [], None, finish_reason="abort") for child_id in child_ids
        ]
        return self.process(outputs, now)[0]

    def _apply(self, child: _Child, out: EngineCoreOutput, now: float) -> bool:
        completion, metrics = child.completion, child.parent.metrics
        child.parent.num_cached_tokens = out.num_cached_tokens
        if out.new_token_ids:
            metrics.first_token_time = metrics.first_token_time or now
            metrics.last_token_time = now
        new_token_ids, new_logprobs = out.new_token_ids, out.new_logprobs
        hit_stop_string = False
        if child.detokenizer is not None:
            hit_stop_string = child.detokenizer.add_tokens(new_token_ids, final=out.finished)
            if hit_stop_string:  # the tokens after the stop string's last are not output
                keep = len(new_token_ids) - child.detokenizer.num_past_stop
                new_token_ids = new_token_ids[:keep]
                new_logprobs = new_logprobs[:keep] if new_logprobs else new_logprobs
        completion.token_ids.extend(new_token_ids)
        if new_logprobs and completion.logprobs is not None:
            completion.logprobs.extend(new_logprobs)
            total = sum(lp.logprob for lp in new_logprobs)
            completion.cumulative_logprob = (completion.cumulative_logprob or 0.0) + total
        if hit_stop_string:
            assert child.detokenizer is not None
            completion.finish_reason = "stop"
            completion.stop_reason = child.detokenizer.stop_string
            return not out.finished
        if out.finished:
            completion.finish_reason = out.finish_reason
            completion.stop_reason = out.stop_reason
        return False


def _released(child: _Child) -> CompletionOutput:
    """A copy with the text that may be shown now (no partial stop string)."""
    completion = child.completion
    text = ""
    if child.detokenizer is not None:
        finished = completion.finished
        text = child.detokenizer.text if finished else child.detokenizer.releasable_text
    return CompletionOutput(
        index=completion.index,
        text=text,
        token_ids=list(completion.token_ids),
        finish_reason=completion.finish_reason,
        stop_reason=completion.stop_reason,
        logprobs=list(completion.logprobs) if completion.logprobs is not None else None,
        cumulative_logprob=completion.cumulative_logprob,
    )
