"""OpenAI response bodies: a choice whole or as a stream delta, logprobs in the completions or
the chat shape, usage."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from kvfleet.engine.output.request_output import CompletionOutput, RequestOutput
from kvfleet.engine.server.chat_output import chat_message
from kvfleet.engine.server.requests import PreparedRequest

TokenText = Callable[[int], str]  # a token id as text


def final_choice(
    prepared: PreparedRequest, index: int, completion: CompletionOutput, token_text: TokenText
) -> dict[str, Any]:
    logprobs = logprobs_body(prepared, completion.token_ids, completion.logprobs, token_text)
    if prepared.kind == "chat" and prepared.parsers is not None:
        message, finish = chat_message(completion.text, completion.finish_reason, prepared.parsers)
        return {
            "index": index,
            "message": message,
            "logprobs": logprobs,
            "finish_reason": finish,
            "stop_reason": completion.stop_reason,
        }
    if prepared.kind == "completion":
        return {
            "index": index,
            "text": completion.text,
            "logprobs": logprobs,
            "finish_reason": completion.finish_reason,
            "stop_reason": completion.stop_reason,
        }
    return {
        "index": index,
        "message": {"role": "assistant", "content": completion.text},
        "logprobs": logprobs,
        "finish_reason": completion.finish_reason,
        "stop_reason": completion.stop_reason,
    }


def delta_choice(
    prepared: PreparedRequest,
    index: int,
    text: str,
    token_ids: Sequence[int],
    logprobs: Sequence[Any] | None,
    finish: str | None,
    token_text: TokenText,
    parsed: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """`parsed`: a chat delta read for reasoning and tool calls (ChatStream), else the text."""
    lp = logprobs_body(prepared, token_ids, logprobs, token_text)
    if prepared.kind == "completion":
        return {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}
    delta = parsed if parsed is not None else {"content": text} if text or not finish else {}
    return {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}


def logprobs_body(
    prepared: PreparedRequest,
    token_ids: Sequence[int],
    logprobs: Sequence[Any] | None,
    token_text: TokenText,
) -> dict[str, Any] | None:
    if logprobs is None or prepared.params.logprobs is None:
        return None
    token = token_text
    if prepared.kind == "chat":
        return {
            "content": [
                {
                    "token": token(lp.token_id),
                    "logprob": lp.logprob,
                    "bytes": list(token(lp.token_id).encode()),
                    "top_logprobs": [
                        {"token": token(t), "logprob": v, "bytes": list(token(t).encode())}
                        for t, v in zip(lp.top_token_ids, lp.top_logprobs, strict=True)
                    ],
                }
                for lp in logprobs
            ]
        }
    return {
        "tokens": [token(lp.token_id) for lp in logprobs],
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": [
            {token(t): v for t, v in zip(lp.top_token_ids, lp.top_logprobs, strict=True)}
            for lp in logprobs
        ],
    }


def usage_body(prepared: PreparedRequest, finals: Iterable[RequestOutput]) -> dict[str, int]:
    outputs = list(finals)
    completion_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    prompt_tokens = sum(len(p) for p in prepared.prompts)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
