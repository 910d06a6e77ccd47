"""Request bodies read into the engine's terms: parsed and validated (`kvfleet.engine.protocol`),
prompts tokenized and chat messages rendered by the model's template. Run by `BodyWork` (a
thread, or a worker process for a large body), never on the event loop."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel

from kvfleet.engine.protocol.http import APIError
from kvfleet.engine.protocol.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    parse_json_object,
    validate_request,
)
from kvfleet.engine.sampling_params import SamplingParams
from kvfleet.engine.server.chat_output import OutputParsers
from kvfleet.engine.tokenizer import Tokenizer

_Body = TypeVar("_Body", bound=BaseModel)


def read_body(raw: bytes, model: type[_Body]) -> _Body:
    """A request body parsed and validated as `model`; APIError 400 naming what is wrong."""
    try:
        return validate_request(parse_json_object(raw), model)
    except ValueError as exc:
        raise APIError(400, str(exc)) from exc


def read_completion(
    tokenizer: Tokenizer | None, raw: bytes
) -> tuple[CompletionRequest, list[list[int]]]:
    """A completions body read and its prompts tokenized (`BodyWork`: in a thread or a worker
    process); the request comes back without its prompt (the token ids carry it)."""
    req = read_body(raw, CompletionRequest)
    if req.echo:
        raise APIError(400, "echo is not supported: the prompt is not repeated in the output")
    prompt = req.prompt
    if isinstance(prompt, str):
        items: list[Any] = [prompt]
    elif prompt and all(isinstance(t, int) for t in prompt):
        items = [prompt]
    else:
        items = list(prompt)
    if not items:
        raise APIError(400, "prompt is empty")
    prompts = []
    for item in items:
        if isinstance(item, str):
            if not item:
                raise APIError(400, "prompt is empty")
            prompts.append(_require(tokenizer).encode(item))
        else:
            prompts.append(list(item))
    return req.model_copy(update={"prompt": ""}), prompts


def read_chat(
    tokenizer: Tokenizer | None, raw: bytes
) -> tuple[ChatCompletionRequest, list[list[int]]]:
    """A chat body read, rendered by the chat template and tokenized (`BodyWork`); the
    request comes back without its messages (the token ids carry them)."""
    req = read_body(raw, ChatCompletionRequest)
    tokenizer = _require(tokenizer)
    messages = [m.model_dump(exclude_none=True) for m in req.messages]
    try:
        text = tokenizer.apply_chat_template(
            messages, req.add_generation_prompt, req.template_tools(), req.chat_template_kwargs
        )
    except (ValueError, TypeError) as exc:
        raise APIError(400, f"the chat template cannot render this request: {exc}") from exc
    prompts = [tokenizer.encode(text, add_special_tokens=False)]
    return req.model_copy(update={"messages": []}), prompts


def _require(tokenizer: Tokenizer | None) -> Tokenizer:
    if tokenizer is None:
        raise APIError(400, "this model has no tokenizer: send prompts as token ids")
    return tokenizer


@dataclass(frozen=True)
class PreparedRequest:
    kind: str  # "completion" or "chat"
    request_id: str
    prompts: list[list[int]]
    params: SamplingParams
    priority: int
    cache_salt: str | None
    stream: bool
    include_usage: bool
    model: str  # as the client named it: the base model or an adapter
    lora_name: str | None = None
    # chat: how replies are read (reasoning, tool calls; server/chat_output.py), None: as is
    parsers: OutputParsers | None = None
