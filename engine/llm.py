"""LLM: the offline API — generate for a batch of prompts, or chat, and return when all are done."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

from kvfleet.engine.config import EngineConfig
from kvfleet.engine.llm_engine import LLMEngine
from kvfleet.engine.output.request_output import RequestOutput
from kvfleet.engine.protocol.openai import Message
from kvfleet.engine.sampling_params import SamplingParams

PromptInput = str | Sequence[int] | Mapping[str, Any]


class LLM:
    """`LLM(model="smollm2", dtype="float32", max_num_batched_tokens=64, ...)`.

    Keyword arguments are the engine settings, flat (`engine_settings()`, the same table the
    `kvfleet engine` flags come from): dtype, block_size, num_blocks, enable_prefix_caching,
    max_num_batched_tokens, enable_lora, lora_modules ({name: folder}), speculative_config (a
    SpeculativeConfig, or a dict or JSON as `--speculative-config` takes it), ...
    """

    def __init__(self, model: str = "smollm2", **engine_args: Any) -> None:
        config = EngineConfig.from_kwargs(model, engine_args)
        self.engine = LLMEngine(config)
        self._ids = itertools.count()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora: str | Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Outputs in the order of `prompts`. A bad prompt raises ValueError before any runs.
        `lora`: an adapter name for every prompt, or one per prompt (None: the base model)."""
        batch = _as_batch(prompts)
        params = _params_for(batch, sampling_params)
        prepared = [self._prepare(p) for p in batch]
        if lora is None or isinstance(lora, str):
            adapters: list[str | None] = [lora] * len(batch)
        else:
            adapters = list(lora)
            if len(adapters) != len(batch):
                raise ValueError(f"{len(adapters)} adapters for {len(batch)} prompts")
        return self._run(prepared, params, adapters)

    def add_lora(self, name: str, path: str) -> None:
        """Load a PEFT adapter under `name` (needs enable_lora)."""
        self.engine.add_lora(name, path)

    def remove_lora(self, name: str) -> None:
        self.engine.remove_lora(name)

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """One conversation (a list of messages) or several; each rendered by the chat template."""
        if self.engine.tokenizer is None:
            raise ValueError("chat needs a tokenizer, and this engine has none")
        conversations = (
            [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        )
        tokenizer = self.engine.tokenizer
        prompts = [
            tokenizer.encode(
                tokenizer.apply_chat_template(conv, add_generation_prompt),  # type: ignore[arg-type]
                add_special_tokens=False,
            )
            for conv in conversations
        ]
        return self._run(
            list(prompts), _params_for(prompts, sampling_params), [None] * len(prompts)
        )

    def _prepare(self, prompt: PromptInput) -> str | list[int]:
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                return list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return str(prompt["prompt"])
            raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        return prompt if isinstance(prompt, str) else list(prompt)

    def _run(
        self,
        prompts: list[str | list[int]],
        params: list[SamplingParams],
        adapters: list[str | None],
    ) -> list[RequestOutput]:
        engine = self.engine
        compiling = {
            i: engine.compile_grammar(p.grammar) for i, p in enumerate(params) if p.grammar
        }
        for i, future in compiling.items():  # (all compile at once; a bad one fails first)
            try:
                future.result()
            except ValueError as exc:
                raise type(exc)(f"prompt {i}: {exc}") from exc
        ids = [f"offline-{next(self._ids)}" for _ in prompts]
        for i, (prompt, p, adapter) in enumerate(zip(prompts, params, adapters, strict=True)):
            try:
                engine.add_request(ids[i], prompt, p, lora_name=adapter)
            except ValueError as exc:
                engine.abort_request(ids[:i])
                raise type(exc)(f"prompt {i}: {exc}") from exc  # keeps e.g. LoRANotFoundError
        finished: dict[str, RequestOutput] = {}
        while engine.has_unfinished_requests():
            for output in engine.step(final_only=True):
                if output.finished:
                    finished[output.request_id] = output
        return [finished[request_id] for request_id in ids]


def _as_batch(prompts: PromptInput | Sequence[PromptInput]) -> list[PromptInput]:
    if isinstance(prompts, str | Mapping):
        return [prompts]
    if isinstance(prompts, Sequence) and prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # type: ignore[list-item]
    if not isinstance(prompts, Sequence):
        raise ValueError(f"prompts must be a string, token ids, or a list of them, got {prompts!r}")
    return list(prompts)  # type: ignore[arg-type]


def _params_for(
    batch: Sequence[object], params: SamplingParams | Sequence[SamplingParams] | None
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in batch]
    if isinstance(params, SamplingParams):
        return [params] * len(batch)
    if len(params) != len(batch):
        raise ValueError(f"{len(params)} sampling params for {len(batch)} prompts")
    return list(params)
