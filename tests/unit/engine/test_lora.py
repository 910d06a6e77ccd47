"""Multi-LoRA in the engine, on the CPU: PEFT adapters against the adapter merged into the weights.

The reference is transformers with the PEFT adapter merged (`merge_and_unload`), run greedily in
float32; our output must equal it token for token, alone and in batches that mix the base model
with several adapters, through LRU slot replacement and unloading.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from kvfleet.engine.llm import LLM
from kvfleet.engine.lora.adapter import LoRAError, LoRANotFoundError, load_adapter
from kvfleet.engine.sampling_params import SamplingParams
from tests.conftest import make_peft_adapter

pytest.importorskip("peft")

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _prompts(count: int, seed: int = 3) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = [5, 23, 40, 9, 31, 14, 27, 18][:count]
    return [torch.randint(3, 384, (n,), generator=generator).tolist() for n in lengths]


@pytest.fixture(scope="module")
def adapters(
    hf_model_dir: Callable[[str], tuple[Any, Path]], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[Path, Any]]:
    """Three adapters on the random Llama 3 model: all projections (rank 8), attention only
    (rank 4, rsLoRA scaling), MLP only (rank 16); name -> (folder, merged reference)."""
    hf_model, _ = hf_model_dir("llama3-rope-untied")
    made = {}
    specs = {
        "all": {"rank": 8},
        "attn": {
            "rank": 4,
            "targets": ("q_proj", "k_proj", "v_proj", "o_proj"),
            "use_rslora": True,
        },
        "mlp": {"rank": 16, "targets": ("gate_proj", "up_proj", "down_proj")},
    }
    for seed, (name, spec) in enumerate(specs.items()):
        folder = tmp_path_factory.mktemp(f"lora-{name}")
        made[name] = (folder, make_peft_adapter(hf_model, folder, seed=10 + seed, **spec))
    return made


def _llm(folder: Path, adapters: dict[str, tuple[Path, Any]], **kwargs: Any) -> LLM:
    args: dict[str, Any] = {
        "dtype": "float32",
        "skip_tokenizer_init": True,
        "block_size": 8,
        "max_num_batched_tokens": 32,  # longer prompts run in chunks
        "num_blocks": 256,
        "max_model_len": 256,
        "enable_lora": True,
        "max_lora_rank": 16,
        "lora_modules": {name: str(path) for name, (path, _) in adapters.items()},
        **kwargs,
    }
    return LLM(str(folder), **args)


def test_each_adapter_equals_its_merged_reference_in_a_mixed_batch(
    hf_model_dir: Callable[[str], tuple[Any, Path]],
    adapters: dict[str, tuple[Path, Any]],
    hf_greedy: Callable[[Any, list[int], int], list[int]],
) -> None:
    hf_model, folder = hf_model_dir("llama3-rope-untied")
    llm = _llm(folder, adapters, max_loras=3)
    prompts = _prompts(8)
    names: list[str | None] = [None, "all", "attn", "mlp", "all", None, "mlp", "attn"]
    mixed = llm.generate(prompts, GREEDY, lora=names)
    references = {None: hf_model, **{n: merged for n, (_, merged) in adapters.items()}}
    changed = 0
    for prompt, name, output in zip(prompts, names, mixed, strict=True):
        expected = hf_greedy(references[name], prompt, 12)
        assert output.outputs[0].token_ids == expected, name
        alone = llm.generate([prompt], GREEDY, lora=name)[0]
        assert alone.outputs[0].token_ids == expected
        if name is not None:
            changed += expected != hf_greedy(hf_model, prompt, 12)
    assert changed >= 4  # the adapters really change the output


def test_more_adapters_than_slots_rotate_through_them(
    hf_model_dir: Callable[[str], tuple[Any, Path]],
    adapters: dict[str, tuple[Path, Any]],
    hf_greedy: Callable[[Any, list[int], int], list[int]],
) -> None:
    _, folder = hf_model_dir("llama3-rope-untied")
    llm = _llm(folder, adapters, max_loras=1, max_cpu_loras=1)  # one slot, one host copy
    manager = llm.engine.lora
    assert manager is not None
    prompts = _prompts(6, seed=5)
    names = ["all", "attn", "mlp", "all", "attn", "mlp"]
    outputs = llm.generate(prompts, GREEDY, lora=names)
    for prompt, name, output in zip(prompts, names, outputs, strict=True):
        assert output.outputs[0].token_ids == hf_greedy(adapters[name][1], prompt, 12)
    assert manager.num_loads >= 3  # each adapter came into the one slot in turn
    assert len(manager.resident) == 1


def test_unloading_an_adapter_in_use_lets_its_requests_finish(
    hf_model_dir: Callable[[str], tuple[Any, Path]],
    adapters: dict[str, tuple[Path, Any]],
    hf_greedy: Callable[[Any, list[int], int], list[int]],
) -> None:
    _, folder = hf_model_dir("llama3-rope-untied")
    llm = _llm(folder, adapters)
    engine = llm.engine
    prompt = _prompts(3, seed=7)[2]  # 40 tokens: 5 full blocks go to the prefix cache
    engine.add_request("r1", prompt, GREEDY, lora_name="all")
    engine.step()
    assert engine.remove_lora("all") == 1  # one request still uses it
    with pytest.raises(LoRANotFoundError):
        engine.add_request("r2", prompt, GREEDY, lora_name="all")
    finished = []
    for _ in range(40):
        finished += [o for o in engine.step() if o.finished]
        if not engine.has_unfinished_requests():
            break
    assert [o.request_id for o in finished] == ["r1"]
    assert finished[0].outputs[0].token_ids == hf_greedy(adapters["all"][1], prompt, 12)
    assert engine.lora is not None
    assert "all" not in engine.lora.names
    with pytest.raises(LoRANotFoundError):
        engine.remove_lora("all")  # gone now
    # The name is free again; a different adapter under it never hits the old one's blocks.
    llm.add_lora("all", str(adapters["attn"][0]))
    (again,) = llm.generate([prompt], GREEDY, lora="all")
    assert again.num_cached_tokens == 0
    assert again.outputs[0].token_ids == hf_greedy(adapters["attn"][1], prompt, 12)


def test_aborting_the_last_request_of_an_unloading_adapter_removes_it(
    hf_model_dir: Callable[[str], tuple[Any, Path]], adapters: dict[str, tuple[Path, Any]]
) -> None:
    _, folder = hf_model_dir("llama3-rope-untied")
    engine = _llm(folder, adapters).engine
    engine.add_request("r1", _prompts(3, seed=2)[2], GREEDY, lora_name="mlp")
    engine.step()
    assert engine.remove_lora("mlp") == 1
    engine.abort_request(["r1"])
    assert engine.lora is not None
    assert "mlp" not in engine.lora.names
    assert not engine.has_unfinished_requests()


def test_prefix_cache_is_keyed_by_adapter(
    hf_model_dir: Callable[[str], tuple[Any, Path]], adapters: dict[str, tuple[Path, Any]]
) -> None:
    _, folder = hf_model_dir("llama3-rope-untied")
    llm = _llm(folder, adapters)
    prompt = _prompts(3, seed=9)[2]  # 40 tokens: 5 full blocks
    params = SamplingParams(temperature=0, max_tokens=2)
    first = llm.generate([prompt], params, lora="all")[0]
    same = llm.generate([prompt], params, lora="all")[0]
    other = llm.generate([prompt], params, lora="attn")[0]
    base = llm.generate([prompt], params)[0]
    assert first.num_cached_tokens == 0
    assert same.num_cached_tokens == 32  # hits under the same adapter (last block recomputed)
    assert other.num_cached_tokens == 0  # never another adapter's blocks
    assert base.num_cached_tokens == 0


def test_unknown_adapter_and_lora_off(
    hf_model_dir: Callable[[str], tuple[Any, Path]], adapters: dict[str, tuple[Path, Any]]
) -> None:
    _, folder = hf_model_dir("llama3-rope-untied")
    llm = _llm(folder, adapters)
    with pytest.raises(LoRANotFoundError, match="'nope' does not exist"):
        llm.generate([[5, 6, 7]], GREEDY, lora="nope")
    assert not llm.engine.has_unfinished_requests()
    plain = LLM(str(folder), dtype="float32", skip_tokenizer_init=True, max_model_len=256)
    with pytest.raises(LoRANotFoundError, match="without enable_lora"):
        plain.generate([[5, 6, 7]], GREEDY, lora="all")


def _copy_adapter(source: Path, target: Path) -> Path:
    target.mkdir()
    for item in source.iterdir():
        (target / item.name).write_bytes(item.read_bytes())
    return target


def test_bad_adapters_are_refused_with_the_reason(
    hf_model_dir: Callable[[str], tuple[Any, Path]],
    adapters: dict[str, tuple[Path, Any]],
    tmp_path: Path,
) -> None:
    from safetensors.torch import load_file, save_file

    from kvfleet.engine.config import ModelConfig

    _, folder = hf_model_dir("llama3-rope-untied")
    config = ModelConfig.from_hf_config(json.loads((folder / "config.json").read_text()))
    good = adapters["all"][0]

    def refused(path: Path, match: str, max_rank: int = 16) -> None:
        with pytest.raises(LoRAError, match=match):
            load_adapter("x", path, config, max_rank)

    refused(tmp_path / "missing", "is not a folder")
    (tmp_path / "empty").mkdir()
    refused(tmp_path / "empty", "no adapter_config.json")
    no_weights = _copy_adapter(good, tmp_path / "no-weights")
    (no_weights / "adapter_model.safetensors").unlink()
    refused(no_weights, "no adapter_model.safetensors")
    refused(good, "rank 8, above this engine's max_lora_rank 4", max_rank=4)

    wrong_shape = _copy_adapter(good, tmp_path / "wrong-shape")
    tensors = load_file(str(wrong_shape / "adapter_model.safetensors"))
    key = next(k for k in tensors if "q_proj.lora_A" in k)
    tensors[key] = torch.zeros(8, 96)
    save_file(tensors, str(wrong_shape / "adapter_model.safetensors"))
    refused(wrong_shape, r"q_proj has lora_A \(8, 96\).*needs \(8, 64\)")

    lm_head = _copy_adapter(good, tmp_path / "lm-head")
    tensors = load_file(str(lm_head / "adapter_model.safetensors"))
    tensors["base_model.model.model.layers.0.self_attn.rotary.lora_A.weight"] = torch.zeros(8, 64)
    save_file(tensors, str(lm_head / "adapter_model.safetensors"))
    refused(lm_head, "unsupported target module 'rotary'")

    dora = _copy_adapter(good, tmp_path / "dora")
    settings = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**settings, "use_dora": True}))
    refused(dora, "use_dora=True is not supported")


def test_mixture_of_experts_takes_attention_adapters_and_refuses_expert_ones(
    hf_model_dir: Callable[[str], tuple[Any, Path]],
    hf_greedy: Callable[[Any, list[int], int], list[int]],
    tmp_path: Path,
) -> None:
    """On Qwen3-MoE (its layer 1 dense): an adapter on the attention projections equals its
    merged reference; one on the dense layer's MLP loads; one on an expert layer's gate/up/down
    is refused naming what it may target."""
    from kvfleet.engine.config import ModelConfig

    hf_model, folder = hf_model_dir("qwen3-moe-dense-layer")
    attention = ("q_proj", "k_proj", "v_proj", "o_proj")
    allowed = make_peft_adapter(hf_model, tmp_path / "attn", seed=21, targets=attention)
    llm = _llm(folder, {"attn": (tmp_path / "attn", allowed)})
    prompts = _prompts(3)
    outputs = llm.generate(prompts, GREEDY, lora="attn")
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.outputs[0].token_ids == hf_greedy(allowed, prompt, 12)
    assert any(
        out.outputs[0].token_ids != hf_greedy(hf_model, p, 12)
        for p, out in zip(prompts, outputs, strict=True)
    )
    # the attention adapter's layer-0 and layer-1 q_proj renamed to gate_proj: the dense
    # layer's MLP takes it (B resized), the expert layer's refuses it
    from safetensors.torch import load_file, save_file

    config = ModelConfig.from_hf_config(json.loads((folder / "config.json").read_text()))
    tensors = load_file(str(tmp_path / "attn" / "adapter_model.safetensors"))
    for layer, name in ((1, "dense"), (0, "expert")):
        renamed = _copy_adapter(tmp_path / "attn", tmp_path / name)
        moved = {}
        for key, value in tensors.items():
            if f"layers.{layer}.self_attn.q_proj.lora_" not in key:
                moved[key] = value
                continue
            gate = key.replace("self_attn.q_proj", "mlp.gate_proj")
            moved[gate] = torch.zeros(128, value.shape[1]) if ".lora_B." in key else value
        save_file(moved, str(renamed / "adapter_model.safetensors"))
    assert (1, "gate_proj") in load_adapter("dense", tmp_path / "dense", config, 16).weights
    with pytest.raises(LoRAError, match="layer 0 is a mixture of experts; LoRA on its experts"):
        load_adapter("expert", tmp_path / "expert", config, 16)


def test_phi3_adapters_on_its_fused_projections_equal_the_merged_reference(
    hf_model_dir: Callable[[str], tuple[Any, Path]],
    hf_greedy: Callable[[Any, list[int], int], list[int]],
    tmp_path: Path,
) -> None:
    """Phi-3 adapters target qkv_proj and gate_up_proj as Phi-3 names them (one A, B over the
    fused rows): served as adapters on q, k, v and gate, up, they equal the merged model."""
    hf_model, folder = hf_model_dir("phi3-longrope")
    targets = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    merged = make_peft_adapter(hf_model, tmp_path / "phi", seed=31, targets=targets)
    llm = _llm(folder, {"phi": (tmp_path / "phi", merged)})
    # (past LongRoPE's original 48 positions from the first token, as the engine runs: with
    # shorter prompts transformers would switch from short to long factors mid-generation)
    prompts = [p * 3 for p in _prompts(3) if len(p) * 3 > 48] + [_prompts(8)[4] * 2]
    outputs = llm.generate(prompts, GREEDY, lora="phi")
    changed = 0
    for prompt, output in zip(prompts, outputs, strict=True):
        expected = hf_greedy(merged, prompt, 12)
        assert output.outputs[0].token_ids == expected
        changed += expected != hf_greedy(hf_model, prompt, 12)
    assert changed
