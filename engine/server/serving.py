"""OpenAI completions and chat over the AsyncEngine: a read request checked against the model
(context length, adapters) and started, its outputs answered whole or streamed (server-sent
events); the bodies are written in bodies.py."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

from kvfleet.engine.lora.adapter import LoRANotFoundError
from kvfleet.engine.output.request_output import RequestOutput
from kvfleet.engine.protocol.http import APIError
from kvfleet.engine.protocol.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
    random_id,
)
from kvfleet.engine.protocol.structured import GrammarSpec
from kvfleet.engine.sampling_params import SamplingParams
from kvfleet.engine.server.async_engine import AsyncEngine
from kvfleet.engine.server.bodies import delta_choice, final_choice, usage_body
from kvfleet.engine.server.chat_output import ChatStream, OutputParsers, chat_setup
from kvfleet.engine.server.metrics import EngineMetrics
from kvfleet.engine.server.requests import PreparedRequest
from kvfleet.engine.tokenizer import Tokenizer


@dataclass
class _Choice:
    """Per-choice streaming state: how much text and how many tokens were already sent."""

    index: int
    sent_text: int = 0
    sent_tokens: int = 0
    last_time: float = field(default_factory=time.monotonic)
    finished: bool = False
    parsed: ChatStream | None = None  # a chat reply read for reasoning and tool calls


class OpenAIServing:
    def __init__(
        self,
        engine: AsyncEngine,
        model_name: str,
        max_model_len: int,
        tokenizer: Tokenizer | None,
        metrics: EngineMetrics,
        parsers: OutputParsers | None = None,
    ) -> None:
        self.engine = engine
        self.parsers = parsers or OutputParsers()
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer
        self.metrics = metrics

    # --- preparing ---------------------------------------------------------------------

    def prepare_completion(
        self, req: CompletionRequest, prompts: list[list[int]]
    ) -> PreparedRequest:
        """A completions request read by `read_completion`, ready to start."""
        self._lora_for(req.model)  # 404 before the sampling checks
        params = self._sampling_params(req, prompts)
        return self._prepared("completion", "cmpl", req, prompts, params)

    def prepare_chat(self, req: ChatCompletionRequest, prompts: list[list[int]]) -> PreparedRequest:
        """A chat request read by `read_chat`, ready to start: with tools, a parser for the
        model's calls, and a grammar when a call is required."""
        self._lora_for(req.model)  # 404 before the sampling checks
        try:
            parsers, grammar = chat_setup(self.parsers, req)
        except ValueError as exc:
            raise APIError(400, str(exc)) from exc
        params = self._sampling_params(req, prompts, grammar)
        return replace(self._prepared("chat", "chatcmpl", req, prompts, params), parsers=parsers)

    def _prepared(
        self,
        kind: str,
        prefix: str,
        req: SamplingFields,
        prompts: list[list[int]],
        params: SamplingParams,
    ) -> PreparedRequest:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return PreparedRequest(
            kind,
            random_id(prefix),
            prompts,
            params,
            req.priority,
            req.cache_salt,
            req.stream,
            include_usage,
            req.model,
            self._lora_for(req.model),
        )

    def _lora_for(self, model: str) -> str | None:
        """The adapter `model` names (None: the base model); 404 for any other name."""
        if model == self.model_name:
            return None
        if model in self.engine.lora_names:
            return model
        adapters = (
            f" and the adapters {list(self.engine.lora_names)}" if self.engine.lora_names else ""
        )
        raise APIError(
            404,
            f"the model {model!r} does not exist; this server serves {self.model_name!r}{adapters}",
            code="model_not_found",
        )

    def _sampling_params(
        self, req: SamplingFields, prompts: list[list[int]], grammar: GrammarSpec | None = None
    ) -> SamplingParams:
        max_tokens = req.max_new_tokens()
        longest = max(len(p) for p in prompts)
        if longest == 0:
            raise APIError(400, "prompt is empty")
        if longest >= self.max_model_len:
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens; "
                f"the prompt has {longest} tokens.",
                code="context_length_exceeded",
            )
        if max_tokens is None:
            max_tokens = self.max_model_len - longest
        elif longest + max_tokens > self.max_model_len:
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {longest + max_tokens} tokens ({longest} in the prompt, "
                f"{max_tokens} in the completion). Please reduce the prompt or max_tokens.",
                code="context_length_exceeded",
            )
        try:
            return SamplingParams(
                grammar=grammar or req.grammar_spec(),
                n=req.n,
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                top_k=req.top_k if req.top_k and req.top_k > 0 else None,
                min_p=req.min_p,
                presence_penalty=req.presence_penalty,
                frequency_penalty=req.frequency_penalty,
                repetition_penalty=req.repetition_penalty,
                seed=req.seed,
                max_tokens=max_tokens,
                stop=req.stop,
                stop_token_ids=req.stop_token_ids or (),
                ignore_eos=req.ignore_eos,
                logprobs=req.num_logprobs(),
                logit_bias=req.token_biases(),
                speculative=req.speculative,
            )
        except ValueError as exc:
            raise APIError(400, str(exc)) from exc

    # --- running -----------------------------------------------------------------------

    async def start(
        self, prepared: PreparedRequest, arrival_time: float | None = None
    ) -> list[AsyncIterator[RequestOutput]]:
        """Queue every prompt of the request (arrived at `arrival_time`, time.monotonic());
        a bad one aborts those already queued."""
        streams: list[AsyncIterator[RequestOutput]] = []
        try:
            for i, prompt in enumerate(prepared.prompts):
                request_id = (
                    prepared.request_id
                    if len(prepared.prompts) == 1
                    else f"{prepared.request_id}-{i}"
                )
                streams.append(
                    await self.engine.generate(
                        request_id,
                        prompt,
                        prepared.params,
                        prepared.priority,
                        prepared.cache_salt,
                        prepared.lora_name,
                        arrival_time,
                    )
                )
        except ValueError as exc:
            for stream in streams:
                await stream.aclose()  # type: ignore[attr-defined]
            if isinstance(exc, LoRANotFoundError):  # unloaded since the request was checked
                raise APIError(404, str(exc), code="model_not_found") from exc
            raise APIError(400, str(exc)) from exc
        return streams

    async def full_response(
        self, prepared: PreparedRequest, streams: list[AsyncIterator[RequestOutput]]
    ) -> dict[str, Any]:
        finals: dict[int, RequestOutput] = {}
        states: dict[tuple[int, int], _Choice] = {}
        async for prompt_index, output in _merge(streams):
            self._observe_tokens(prepared, prompt_index, output, states)
            if output.finished:
                finals[prompt_index] = output
        created = int(time.time())
        n = prepared.params.n
        choices = []
        for prompt_index in range(len(prepared.prompts)):
            for completion in finals[prompt_index].outputs:
                index = prompt_index * n + completion.index
                choices.append(final_choice(prepared, index, completion, self._token_text))
        body: dict[str, Any] = {
            "id": prepared.request_id,
            "object": "text_completion" if prepared.kind == "completion" else "chat.completion",
            "created": created,
            "model": prepared.model,
            "choices": choices,
            "usage": usage_body(prepared, finals.values()),
        }
        return body

    async def sse_stream(
        self, prepared: PreparedRequest, streams: list[AsyncIterator[RequestOutput]]
    ) -> AsyncIterator[str]:
        created = int(time.time())
        n = prepared.params.n
        choices = {
            (p, j): _Choice(p * n + j) for p in range(len(prepared.prompts)) for j in range(n)
        }
        finals: dict[int, RequestOutput] = {}
        object_name = (
            "text_completion" if prepared.kind == "completion" else "chat.completion.chunk"
        )

        def chunk(
            payload_choices: list[dict[str, Any]], usage: dict[str, int] | None = None
        ) -> str:
            body: dict[str, Any] = {
                "id": prepared.request_id,
                "object": object_name,
                "created": created,
                "model": prepared.model,
                "choices": payload_choices,
            }
            if prepared.include_usage:
                body["usage"] = usage
            return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

        if prepared.kind == "chat":
            yield chunk(
                [
                    {
                        "index": c.index,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                    for c in choices.values()
                ]
            )
        async for prompt_index, output in _merge(streams):
            if output.finished:
                finals[prompt_index] = output
            self._observe_tokens(prepared, prompt_index, output, choices)
            for completion in output.outputs:
                state = choices[(prompt_index, completion.index)]
                if state.finished:
                    continue
                delta_text = completion.text[state.sent_text :]
                new_tokens = completion.token_ids[state.sent_tokens :]
                new_logprobs = (
                    (completion.logprobs or [])[state.sent_tokens :]
                    if completion.logprobs is not None
                    else None
                )
                finish = completion.finish_reason if completion.finished else None
                if not delta_text and not finish and not new_tokens:
                    continue
                state.sent_text, state.sent_tokens = len(completion.text), len(completion.token_ids)
                state.finished = finish is not None
                parsed = None
                if prepared.parsers is not None:
                    state.parsed = state.parsed or ChatStream(prepared.parsers)
                    parsed = state.parsed.delta(completion.text, finish)
                    finish = parsed[1]
                    if not parsed[0] and not finish and new_logprobs is None:
                        continue  # (held back: it may be a tool call's start)
                yield chunk(
                    [
                        delta_choice(
                            prepared,
                            state.index,
                            delta_text,
                            new_tokens,
                            new_logprobs,
                            finish,
                            self._token_text,
                            parsed[0] if parsed else None,
                        )
                    ]
                )
        if prepared.include_usage:
            yield chunk([], usage_body(prepared, finals.values()))
        yield "data: [DONE]\n\n"

    def _observe_tokens(
        self,
        prepared: PreparedRequest,
        prompt_index: int,
        output: RequestOutput,
        choices: dict[tuple[int, int], _Choice],
    ) -> None:
        now = time.monotonic()
        for completion in output.outputs:
            state = choices.setdefault((prompt_index, completion.index), _Choice(0))
            new = len(completion.token_ids) - state.sent_tokens
            if new > 0 and state.sent_tokens > 0:
                self.metrics.observe_inter_token((now - state.last_time) / new, new)
            if new > 0:
                state.last_time = now
                if not prepared.stream:
                    state.sent_tokens = len(completion.token_ids)

    # --- bodies ------------------------------------------------------------------------

    def _token_text(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


async def _merge(
    streams: list[AsyncIterator[RequestOutput]],
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several request streams as they come, tagged with the stream's index."""
    if len(streams) == 1:
        try:
            async for output in streams[0]:
                yield 0, output
        finally:
            await streams[0].aclose()  # type: ignore[attr-defined]
        return
    merged: asyncio.Queue[tuple[int, RequestOutput] | tuple[int, BaseException] | None] = (
        asyncio.Queue()
    )

    async def pump(index: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for output in stream:
                await merged.put((index, output))
        except Exception as exc:
            await merged.put((index, exc))
        finally:
            await merged.put(None)

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            item = await merged.get()
            if item is None:
                remaining -= 1
                continue
            index, value = item
            if isinstance(value, BaseException):
                raise value
            yield index, value
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams:
            await stream.aclose()  # type: ignore[attr-defined]
