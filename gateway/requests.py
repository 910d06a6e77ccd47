"""Request bodies at the gateway: refused (400) exactly as the engine would refuse them (the
engine's own request models, `kvfleet.engine.protocol.openai`), and their prompts counted for
routing and for the token reservation. Run by `BodyWork` (a thread, or a worker process for a
large body)."""

from __future__ import annotations

import json
from typing import Any

from kvfleet.engine.protocol.http import APIError
from kvfleet.engine.protocol.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    parse_json_object,
    validate_request,
)
from kvfleet.engine.protocol.tools import ToolFields
from kvfleet.gateway.tokenizer import GatewayTokenizer

REQUEST_MODELS: dict[str, type[CompletionRequest | ChatCompletionRequest]] = {
    "completions": CompletionRequest,
    "chat/completions": ChatCompletionRequest,
}
# A chat request that names no limit may generate up to the context length; the gateway
# reserves this many tokens per choice for it up front (settled with the real usage at its end).
CHAT_RESERVED_TOKENS = 512


def read_request(
    tokenizer: GatewayTokenizer | None, raw: bytes, path: str
) -> tuple[dict[str, Any], tuple[list[int], int, int], int]:
    """A body parsed and refused (400) as the engine would refuse it, its prompts counted
    (`count_prompts`), and the tokens to reserve for what each prompt generates (all its
    choices). The body comes back without its prompt or messages: the engine reads the raw
    bytes."""
    request = _parse_body(raw, path)
    body = request.model_dump(exclude_unset=True, exclude_none=True)
    counted = _counted(tokenizer, body, path)
    new_tokens = (request.max_new_tokens() or CHAT_RESERVED_TOKENS) * request.n
    return {k: v for k, v in body.items() if k not in ("prompt", "messages")}, counted, new_tokens


def count_prompts(
    tokenizer: GatewayTokenizer | None, raw: bytes, path: str
) -> tuple[list[int], int, int]:
    """(the first prompt's token ids, for routing; the tokens of all its prompts, for the
    reservation; how many prompts). Without the engines' tokenizer yet, text counts as its
    UTF-8 bytes (at least its tokens) and routing goes by load."""
    body = _parse_body(raw, path).model_dump(exclude_unset=True, exclude_none=True)
    return _counted(tokenizer, body, path)


def _counted(
    tokenizer: GatewayTokenizer | None, body: dict[str, Any], path: str
) -> tuple[list[int], int, int]:
    try:
        return _tokenize(tokenizer, body, path)
    except (ValueError, TypeError) as exc:
        raise APIError(400, str(exc)) from exc


def _tokenize(
    tokenizer: GatewayTokenizer | None, body: dict[str, Any], path: str
) -> tuple[list[int], int, int]:
    if path == "chat/completions":
        messages = body["messages"]
        if tokenizer is None:
            return [], len(json.dumps(messages).encode()), 1
        tools = ToolFields.model_validate(
            {k: body[k] for k in ToolFields.model_fields if k in body}
        )
        ids = tokenizer.chat_ids(
            messages,
            bool(body.get("add_generation_prompt", True)),
            tools.template_tools(),
            tools.chat_template_kwargs,
        )
        return ids, len(ids), 1
    prompts = all_prompts(body["prompt"])
    first: list[int] = []
    total = 0
    for index, prompt in enumerate(prompts):
        if isinstance(prompt, list):
            ids = prompt
        elif tokenizer is None:
            total += len(prompt.encode())
            continue
        else:
            ids = tokenizer.encode(prompt)
        total += len(ids)
        if index == 0:
            first = ids
    return first, total, max(1, len(prompts))


def all_prompts(prompt: str | list[Any]) -> list[str | list[int]]:
    """Every prompt of a completions request (validated): a string, token ids, or a batch."""
    if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


def _parse_body(raw: bytes, path: str) -> CompletionRequest | ChatCompletionRequest:
    """The body refused (400) here as the engine would refuse it, else read as the engine
    reads it (validated: token ids sent as 5.0 are the integers the engine takes)."""
    try:
        request = validate_request(parse_json_object(raw), REQUEST_MODELS[path])
    except ValueError as exc:
        raise APIError(400, str(exc)) from exc
    return request
