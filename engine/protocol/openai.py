"""The OpenAI-compatible wire protocol: request and response bodies as pydantic models.

Pure pydantic, no torch: the gateway imports this module too.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, Field, ValidationError, field_validator

from kvfleet.engine.protocol.base import IGNORED_FIELDS, OpenAIBaseModel
from kvfleet.engine.protocol.structured import GrammarFields
from kvfleet.engine.protocol.tools import MAX_TOOLS, MessageToolCall, ToolFields

MAX_N = 128
MAX_LOGPROBS = 20
# Bounds on what a request may carry, so every value fits where it goes (a token id in an
# int32 tensor, a seed in int64) and no body costs more to read than to refuse.
MAX_INT32, MAX_INT64 = (1 << 31) - 1, (1 << 63) - 1
MAX_JSON_DEPTH = 64
MAX_PROMPTS = 1024  # prompts in one completions request
MAX_STOP = 64  # stop strings or stop token ids
MAX_STOP_LENGTH = 1024  # characters of one stop string
MAX_MESSAGES = 100_000
MAX_CONTENT_PARTS = 1024
MESSAGES_PER_CALL = 256  # longer message lists are validated one message at a time

TokenId = Annotated[int, Field(ge=0, le=MAX_INT32)]
TokenIds = Annotated[list[TokenId], Field(min_length=0)]


# OpenAI's default for /v1/completions (and SamplingParams'); chat has none (to the context).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16

Message = Mapping[str, Any]
_Body = TypeVar("_Body", bound=BaseModel)


MAX_LOGIT_BIAS = 1024  # token biases in one request
LOGIT_BIAS_RANGE = 100.0  # each clamped to [-100, 100], as OpenAI's


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False


class SamplingFields(GrammarFields):
    """Fields shared by completions and chat completions (OpenAI's, then vLLM's extras; the
    output constraints in protocol/structured.py)."""

    model: str
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_INT32)
    temperature: float | None = Field(default=None, ge=0, le=100)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stop: (
        Annotated[str, Field(max_length=MAX_STOP_LENGTH)]
        | Annotated[
            list[Annotated[str, Field(max_length=MAX_STOP_LENGTH)]], Field(max_length=MAX_STOP)
        ]
        | None
    ) = None
    seed: int | None = Field(default=None, ge=-MAX_INT64 - 1, le=MAX_INT64)
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    top_k: int | None = Field(default=None, le=MAX_INT32)
    min_p: float = Field(default=0.0, ge=0, le=1)
    repetition_penalty: float = Field(default=1.0, gt=0, le=100)
    ignore_eos: bool = False
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP)] | None = None
    priority: int = Field(default=0, ge=-MAX_INT32 - 1, le=MAX_INT32)
    cache_salt: str | None = Field(default=None, max_length=1024)
    speculative: bool = True  # false: no speculative decoding for this request
    # token id (as a string, OpenAI's form) -> a bias added to its logit, clamped to [-100, 100]
    logit_bias: Annotated[dict[str, float], Field(max_length=MAX_LOGIT_BIAS)] | None = None

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value is None:
            return None
        for key in value:
            if not key.isdigit() or int(key) > MAX_INT32:
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
        return {key: max(-LOGIT_BIAS_RANGE, min(LOGIT_BIAS_RANGE, v)) for key, v in value.items()}

    def token_biases(self) -> dict[int, float] | None:
        """`logit_bias` by token id."""
        return {int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None

    def max_new_tokens(self) -> int | None:
        """The most tokens a choice may generate; None: up to the context length. The one
        place this rule is written (engine and gateway read it here)."""
        raise NotImplementedError

    def num_logprobs(self) -> int | None:
        """How many top logprobs each sampled token reports; None: no logprobs."""
        raise NotImplementedError


class CompletionRequest(SamplingFields):
    prompt: (
        str
        | Annotated[list[str], Field(max_length=MAX_PROMPTS)]
        | list[TokenId]
        | Annotated[list[list[TokenId]], Field(max_length=MAX_PROMPTS)]
    )
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False

    def max_new_tokens(self) -> int:
        return self.max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS

    def num_logprobs(self) -> int | None:
        return self.logprobs


class TextPart(OpenAIBaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(OpenAIBaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[TextPart], Field(max_length=MAX_CONTENT_PARTS)] | None = None
    name: str | None = None
    tool_calls: Annotated[list[MessageToolCall], Field(max_length=MAX_TOOLS)] | None = None
    tool_call_id: str | None = None  # (a tool message: the call it answers)
    reasoning_content: str | None = None  # (an assistant message's thinking, echoed back)


class ChatCompletionRequest(SamplingFields, ToolFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_INT32)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens  # (the first: OpenAI's newer name)

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "kvfleet"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    # kvfleet: how the served weights are quantized (method, source, weights, activations)
    quantization: dict[str, str] | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class LoadLoRAAdapterRequest(OpenAIBaseModel):
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)

    @staticmethod
    def parse_flag(items: Sequence[str], flag: str) -> list[tuple[str, str]]:
        """Adapters named on a command line as `NAME=PATH` (the engine's `--lora-modules`, the
        gateway's `--lora-adapter`), as (name, path) pairs; ValueError naming the flag."""
        pairs = []
        for item in items:
            name, sep, path = item.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"{flag} takes NAME=PATH, got {item!r}")
            pairs.append((name, path))
        return pairs


class UnloadLoRAAdapterRequest(OpenAIBaseModel):
    lora_name: str = Field(min_length=1)


class TokenizerInfo(OpenAIBaseModel):
    """What a gateway needs to tokenize and hash prompts exactly as this engine does."""

    model: str
    block_size: int
    tokenizer: str  # the fast tokenizer's tokenizer.json
    chat_template: str | None = None
    special_tokens: dict[str, str] = Field(default_factory=dict)  # bos_token, eos_token, ...


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """A request body as a JSON object; ValueError saying what is wrong (HTTP 400): not UTF-8,
    not JSON, nested deeper than MAX_JSON_DEPTH, or text that is no Unicode (a lone surrogate
    escape such as "\\ud800" reads as JSON but cannot be encoded, tokenized or hashed)."""
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ValueError(f"the request body is not valid UTF-8 (byte {exc.start})") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"the request body is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from exc
    except RecursionError:
        raise ValueError(
            f"the request body is nested deeper than {MAX_JSON_DEPTH} levels"
        ) from None
    if not isinstance(data, dict):
        raise ValueError("the request body must be a JSON object")
    _check_tree(data)
    return data


def openapi_body(model: type[BaseModel]) -> dict[str, Any]:
    """A route's `openapi_extra` declaring `model` as its JSON request body (the routes read the
    body themselves, to answer bad ones with the OpenAI error body): the schema with its
    definitions inlined, so API fuzzers and client generators see the real operation."""
    schema = model.model_json_schema()
    definitions = schema.pop("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            if "$ref" in node:
                return inline(definitions[node["$ref"].rsplit("/", 1)[-1]])
            return {key: inline(value) for key, value in node.items()}
        if isinstance(node, list):
            return [inline(item) for item in node]
        return node

    content = {"application/json": {"schema": inline(schema)}}
    return {"requestBody": {"required": True, "content": content}}


def validate_request(data: Mapping[str, Any], model: type[_Body]) -> _Body:
    """A parsed body as `model`; ValueError naming the first bad field (HTTP 400). The engine
    and the gateway both check bodies with this, so both refuse the same requests alike.

    Long message lists are checked one message per call: pydantic holds the GIL for a whole
    call, and one call over 100,000 messages stalls every other thread ~0.4 s."""
    messages = data.get("messages")
    if (
        "messages" in model.model_fields
        and isinstance(messages, list)
        and MESSAGES_PER_CALL < len(messages) <= MAX_MESSAGES
    ):
        checked = []
        for i, message in enumerate(messages):
            try:
                checked.append(ChatMessage.model_validate(message))
            except ValidationError as exc:
                raise ValueError(_first_error(exc, ("messages", i))) from None
        data = {**data, "messages": checked}  # (instances are not validated again)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ValueError(_first_error(exc)) from None


def _first_error(exc: ValidationError, prefix: tuple[str | int, ...] = ()) -> str:
    first = exc.errors()[0]
    where = ".".join(str(p) for p in (*prefix, *first["loc"])) or "body"
    if first["type"] == "extra_forbidden":
        return (
            f"{where}: kvfleet does not support this field (it refuses rather than ignore it; "
            f"fields it ignores: {', '.join(sorted(IGNORED_FIELDS))})"
        )
    return f"{where}: {first['msg']}"


def _check_tree(data: Any) -> None:
    """Depth and text of a parsed body, iteratively (no recursion on hostile input)."""
    stack: list[tuple[Any, int]] = [(data, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise ValueError(f"the request body is nested deeper than {MAX_JSON_DEPTH} levels")
        if isinstance(node, dict):
            for key, value in node.items():
                _check_text(key)
                stack.append((value, depth + 1))
        elif isinstance(node, list):
            stack.extend((item, depth + 1) for item in node)
        elif isinstance(node, str):
            _check_text(node)


def _check_text(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"the request body holds text that is not valid Unicode (a lone surrogate "
            f"{text[exc.start]!r} at character {exc.start})"
        ) from None


def normalize_message(message: Message) -> dict[str, Any]:
    """A message as chat templates read it: role and content (OpenAI text parts joined), and
    where present the name, the tool calls (their arguments as objects, as templates expect),
    the id of the call a tool message answers, an assistant's reasoning."""
    if not isinstance(message, Mapping) or "role" not in message:
        raise ValueError(f"a chat message must be an object with a role, got {message!r}")
    role, content = message["role"], message.get("content", "")
    if role not in ("system", "user", "assistant", "developer", "tool"):
        raise ValueError(f"unknown chat role {role!r}")
    if content is None:
        content = ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text":
                raise ValueError(f"only text content parts are supported, got {part!r}")
            parts.append(str(part.get("text", "")))
        content = "".join(parts)
    if not isinstance(content, str):
        raise ValueError(f"message content must be a string or text parts, got {content!r}")
    normalized: dict[str, Any] = {"role": "system" if role == "developer" else role}
    normalized["content"] = content
    for key in ("name", "tool_call_id", "reasoning_content"):
        if message.get(key) is not None:
            normalized[key] = message[key]
    if message.get("tool_calls"):
        normalized["tool_calls"] = [_template_call(c) for c in message["tool_calls"]]
    return normalized


def _template_call(call: Any) -> dict[str, Any]:
    function = dict(call.get("function") or {}) if isinstance(call, Mapping) else {}
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        with contextlib.suppress(json.JSONDecodeError):  # (else shown as written)
            function["arguments"] = json.loads(arguments)
    return {"id": call.get("id"), "type": "function", "function": function}
