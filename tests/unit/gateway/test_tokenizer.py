"""GatewayTokenizer (tokenizers + jinja2) against the engine's tokenizer (transformers) on SmolLM2:
the same token ids for texts and chats, hence the same prefix-cache block hashes."""

from __future__ import annotations

import pytest

from kvfleet.engine.loader.source import resolve_model_source
from kvfleet.engine.tokenizer import Tokenizer
from kvfleet.gateway.tokenizer import GatewayTokenizer

TEXTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n",
    "  leading spaces, émojis 🚀 and 中文 ",
    "",
]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You answer in one word."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Colour of "}, {"type": "text", "text": "grass?"}],
        },
        {"role": "assistant", "content": "Green."},
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "And the sky?"},
    ],
]


@pytest.fixture(scope="module")
def pair() -> tuple[Tokenizer, GatewayTokenizer]:
    engine = Tokenizer.load(resolve_model_source("smollm2"))
    info = engine.info("smollm2", block_size=16).model_dump()
    return engine, GatewayTokenizer.from_info(info)


def test_texts_encode_to_the_same_ids(pair: tuple[Tokenizer, GatewayTokenizer]) -> None:
    engine, gateway = pair
    for text in TEXTS:
        for special in (True, False):
            assert gateway.encode(text, special) == engine.encode(text, special), text


def test_chats_render_and_encode_the_same(pair: tuple[Tokenizer, GatewayTokenizer]) -> None:
    engine, gateway = pair
    for chat in CHATS:
        for add_generation_prompt in (True, False):
            text = engine.apply_chat_template(chat, add_generation_prompt)
            expected = engine.encode(text, add_special_tokens=False)
            assert gateway.chat_ids(chat, add_generation_prompt) == expected


def test_unknown_role_is_refused(pair: tuple[Tokenizer, GatewayTokenizer]) -> None:
    _, gateway = pair
    with pytest.raises(ValueError, match="unknown chat role"):
        gateway.chat_ids([{"role": "robot", "content": "hi"}])


# A Qwen-style template: the tools offered, the calls in the history with their arguments as
# objects, the tool results, and a template switch (`chat_template_kwargs`).
TOOL_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }}:"
    "{{ t.function.parameters | tojson }};{% endfor %}</tools>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }}"
    "{{ c.function.arguments | tojson }}</tool_call>{% endfor %}"
    "{% if m.tool_call_id %}[{{ m.tool_call_id }}]{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is false %}<think>\n\n</think>\n{% endif %}{% endif %}"
)


def test_tools_and_call_history_render_the_same() -> None:
    engine = Tokenizer.load(resolve_model_source("smollm2"))
    engine.hf.chat_template = TOOL_TEMPLATE
    info = engine.info("smollm2", block_size=16).model_dump()
    gateway = GatewayTokenizer.from_info(info)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    chat = [
        {"role": "user", "content": "Call f."},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "done"},
    ]
    kwargs = {"enable_thinking": False}
    text = engine.apply_chat_template(chat, True, tools, kwargs)
    assert 'f:{"type": "object"};' in text
    assert '<tool_call>f{"a": 1}</tool_call>' in text  # (arguments as an object)
    assert "[c1]" in text
    assert text.endswith("<think>\n\n</think>\n")
    expected = engine.encode(text, add_special_tokens=False)
    assert gateway.chat_ids(chat, True, tools, kwargs) == expected
