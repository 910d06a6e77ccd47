"""Multi-LoRA through the real server: SmolLM2 with PEFT adapters, driven by the `openai` client.

Each adapter is random and non-zero, built with PEFT on SmolLM2 as transformers loads it from the
same GGUF file; the reference is transformers with that adapter merged into the weights, greedy,
float32. Adapters load at start and at runtime, rotate through 2 device slots (LRU), unload, and
bad ones are refused with 400 while the server keeps serving.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from kvfleet.engine.loader import model_cache
from tests.conftest import make_peft_adapter

from .conftest import MODEL, Server, start_server, stop_server

pytest.importorskip("peft")
pytestmark = pytest.mark.timeout(900)

NEW_TOKENS = 12
PROMPTS = ["The capital of France is", "def add(a, b):\n    return", "Rain is"]


@pytest.fixture(scope="module")
def smollm2_hf() -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = (
        model_cache.ModelCache(model_cache.kvfleet_home())
        .fetch(model_cache.BUILTIN_MODELS["smollm2"], progress=False)[0]
        .path
    )
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    return tokenizer, model


@pytest.fixture(scope="module")
def adapters(
    smollm2_hf: tuple[Any, Any], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[Path, Any]]:
    """name -> (PEFT folder, merged reference); 'big' has rank 32, above the server's 16."""
    _, model = smollm2_hf
    made = {}
    specs: dict[str, dict[str, Any]] = {
        "sql": {"rank": 8},
        "poet": {"rank": 4, "targets": ("q_proj", "v_proj", "o_proj")},
        "chef": {"rank": 16, "targets": ("gate_proj", "up_proj", "down_proj")},
        "big": {"rank": 32, "targets": ("q_proj",)},
    }
    for seed, (name, spec) in enumerate(specs.items()):
        folder = tmp_path_factory.mktemp(f"adapter-{name}")
        made[name] = (
            folder,
            make_peft_adapter(model, folder, seed=20 + seed, strength=1.5, **spec),
        )
    return made


@pytest.fixture(scope="module")
def lora_server(
    tmp_path_factory: pytest.TempPathFactory, adapters: dict[str, tuple[Path, Any]]
) -> Iterator[Server]:
    running = start_server(
        tmp_path_factory.mktemp("lora-engine"),
        "--enable-lora",
        "--max-loras",
        "2",
        "--max-lora-rank",
        "16",
        "--lora-modules",
        f"sql={adapters['sql'][0]}",
    )
    yield running
    stop_server(running)


def _expected(
    smollm2_hf: tuple[Any, Any], model: Any, hf_greedy: Callable[..., list[int]], text: str
) -> str:
    tokenizer, _ = smollm2_hf
    prompt = tokenizer.encode(text)
    return str(tokenizer.decode(hf_greedy(model, prompt, NEW_TOKENS)))


async def _complete(client: openai.AsyncOpenAI, model: str, text: str) -> str:
    response = await client.completions.create(
        model=model, prompt=text, max_tokens=NEW_TOKENS, temperature=0
    )
    assert response.model == model
    return response.choices[0].text


def test_adapters_load_rotate_and_match_their_merged_reference(
    lora_server: Server,
    adapters: dict[str, tuple[Path, Any]],
    smollm2_hf: tuple[Any, Any],
    hf_greedy: Callable[..., list[int]],
) -> None:
    for name in ("poet", "chef"):  # at runtime; three adapters now share two slots
        response = httpx.post(
            f"{lora_server.base_url}/load_lora_adapter",
            json={"lora_name": name, "lora_path": str(adapters[name][0])},
            timeout=60,
        )
        assert response.status_code == 200, response.text
    listed = httpx.get(f"{lora_server.base_url}/models", timeout=10).json()["data"]
    assert [m["id"] for m in listed] == [MODEL, "sql", "poet", "chef"]
    assert all(m["parent"] == MODEL for m in listed[1:])

    jobs = [(name, text) for name in (None, "sql", "poet", "chef") for text in PROMPTS]

    async def run_all() -> list[str]:
        async with openai.AsyncOpenAI(
            base_url=lora_server.base_url, api_key="none", max_retries=0
        ) as client:
            return await asyncio.gather(
                *(_complete(client, name or MODEL, text) for name, text in jobs)
            )

    answers = asyncio.run(run_all())
    _, base = smollm2_hf
    differs = 0
    for (name, text), answer in zip(jobs, answers, strict=True):
        reference = base if name is None else adapters[name][1]
        expected = _expected(smollm2_hf, reference, hf_greedy, text)
        assert answer == expected, (name, text)
        if name is not None:
            differs += expected != _expected(smollm2_hf, base, hf_greedy, text)
    assert differs >= 6  # the adapters change SmolLM2's answers
    info = [k for k in lora_server.metrics() if k.startswith("kvfleet:lora_requests_info{")]
    assert len(info) == 1
    assert 'max_lora="2"' in info[0]


def test_unload_then_404(lora_server: Server, adapters: dict[str, tuple[Path, Any]]) -> None:
    url = lora_server.base_url
    body = {"lora_name": "temp", "lora_path": str(adapters["poet"][0])}
    assert httpx.post(f"{url}/load_lora_adapter", json=body, timeout=60).status_code == 200
    completion = {"model": "temp", "prompt": "Hi", "max_tokens": 2}
    assert httpx.post(f"{url}/completions", json=completion, timeout=60).status_code == 200
    response = httpx.post(f"{url}/unload_lora_adapter", json={"lora_name": "temp"}, timeout=60)
    assert response.status_code == 200, response.text
    response = httpx.post(f"{url}/completions", json=completion, timeout=60)
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "model_not_found"
    response = httpx.post(f"{url}/unload_lora_adapter", json={"lora_name": "temp"}, timeout=60)
    assert response.status_code == 404


def test_bad_adapters_get_400_and_the_server_keeps_serving(
    lora_server: Server, adapters: dict[str, tuple[Path, Any]], tmp_path: Path
) -> None:
    from safetensors.torch import load_file, save_file

    url = lora_server.base_url
    (tmp_path / "empty").mkdir()
    wrong_shape = tmp_path / "wrong-shape"  # an adapter for another model's shapes
    wrong_shape.mkdir()
    source = adapters["sql"][0]
    (wrong_shape / "adapter_config.json").write_bytes((source / "adapter_config.json").read_bytes())
    tensors = load_file(str(source / "adapter_model.safetensors"))
    save_file(
        {k: torch.zeros(v.shape[0], 64) if "lora_A" in k else v for k, v in tensors.items()},
        str(wrong_shape / "adapter_model.safetensors"),
    )
    embed = tmp_path / "embed"  # a target module the engine does not adapt
    embed.mkdir()
    (embed / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 16}))
    save_file(
        {"base_model.model.model.layers.0.self_attn.rotary_emb.lora_A.weight": torch.zeros(8, 4)},
        str(embed / "adapter_model.safetensors"),
    )
    cases = [
        ({"lora_name": "x", "lora_path": str(tmp_path / "empty")}, "no adapter_config.json"),
        ({"lora_name": "x", "lora_path": str(tmp_path / "nowhere")}, "is not a folder"),
        ({"lora_name": "x", "lora_path": str(wrong_shape)}, "was it trained for another model"),
        ({"lora_name": "x", "lora_path": str(embed)}, "unsupported target module 'rotary_emb'"),
        (
            {"lora_name": "x", "lora_path": str(adapters["big"][0])},
            "rank 32, above this engine's max_lora_rank 16",
        ),
        ({"lora_name": "sql", "lora_path": str(source)}, "already loaded"),
        ({"lora_name": MODEL, "lora_path": str(source)}, "base model's name"),
        ({"lora_name": "x"}, "lora_path: Field required"),
    ]
    for body, reason in cases:
        response = httpx.post(f"{url}/load_lora_adapter", json=body, timeout=60)
        assert response.status_code == 400, (body, response.text)
        error = response.json()["error"]
        assert reason in error["message"], (reason, error)
        assert error["type"] == "invalid_request_error"
    response = httpx.post(
        f"{url}/completions", json={"model": "nope", "prompt": "Hi", "max_tokens": 2}, timeout=60
    )
    assert response.status_code == 404
    assert "'nope' does not exist" in response.json()["error"]["message"]
    response = httpx.post(
        f"{url}/completions", json={"model": "sql", "prompt": "Hi", "max_tokens": 2}, timeout=60
    )
    assert response.status_code == 200


def test_adapters_load_and_unload_through_the_gateway(
    lora_server: Server, adapters: dict[str, tuple[Path, Any]], tmp_path: Path
) -> None:
    """As `kvfleet serve` users call them: the gateway loads an adapter on its replicas, routes
    requests naming it, refuses a bad one with the engine's reason, and unloads it."""
    from .test_gateway import start_gateway, stop_gateway

    gateway = start_gateway(tmp_path, [lora_server])
    try:
        url = gateway.base_url
        body = {"lora_name": "verse", "lora_path": str(adapters["poet"][0])}
        response = httpx.post(f"{url}/load_lora_adapter", json=body, timeout=120)
        assert response.status_code == 200, response.text
        again = httpx.post(f"{url}/load_lora_adapter", json=body, timeout=120)
        assert again.status_code == 400
        assert "already loaded" in again.json()["error"]["message"]
        bad = {"lora_name": "big", "lora_path": str(adapters["big"][0])}
        refused = httpx.post(f"{url}/load_lora_adapter", json=bad, timeout=120)
        assert refused.status_code == 400
        assert "above this engine's max_lora_rank 16" in refused.json()["error"]["message"]
        listed = [m["id"] for m in httpx.get(f"{url}/models", timeout=10).json()["data"]]
        assert "verse" in listed
        assert "big" not in listed

        completion = {"model": "verse", "prompt": "Rain is", "max_tokens": 6, "temperature": 0}
        through = httpx.post(f"{url}/completions", json=completion, timeout=120)
        direct = httpx.post(f"{lora_server.base_url}/completions", json=completion, timeout=120)
        assert through.status_code == direct.status_code == 200, through.text
        assert through.json()["choices"][0]["text"] == direct.json()["choices"][0]["text"]

        gone = httpx.post(f"{url}/unload_lora_adapter", json={"lora_name": "verse"}, timeout=60)
        assert gone.status_code == 200, gone.text
        response = httpx.post(f"{lora_server.base_url}/completions", json=completion, timeout=60)
        assert response.status_code == 404  # (unloaded on the engine too)
        response = httpx.post(f"{url}/unload_lora_adapter", json={"lora_name": "verse"}, timeout=60)
        assert response.status_code == 404
    finally:
        stop_gateway(gateway)
