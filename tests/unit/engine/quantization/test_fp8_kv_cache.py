"""The FP8 KV cache on the CPU (the torch backend is the reference the Triton kernels are held
to on the GPU): K and V stored as e4m3 over their layer's scale and read back times it; twice
the blocks of a bf16 cache in the same memory; chunked prefill, prefix hits and preemption
read the same cached values as a plain run; a checkpoint's k_scale / v_scale are used."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvfleet.engine.attention.torch_backend import _gather, write_kv_cache
from kvfleet.engine.llm import LLM
from kvfleet.engine.sampling_params import SamplingParams
from tests.unit.engine.quantization.checkpoints import TINY, random_llama

FP8 = torch.float8_e4m3fn


def test_stored_values_are_the_scaled_e4m3_values() -> None:
    generator = torch.Generator().manual_seed(0)
    k = torch.randn(5, 2, 8, generator=generator) * 3
    v = torch.randn(5, 2, 8, generator=generator)
    k[0, 0, 0] = 1e4  # (saturates at 448 x the scale)
    scales = torch.tensor([0.5, 0.25])
    cache = torch.zeros(2, 3, 4, 2, 8, dtype=FP8)
    slots = torch.tensor([4, 5, 6, 7, 8])  # block 1 whole, block 2's first slot
    write_kv_cache(k, v, cache, slots, scales)
    keys, values = _gather(cache, torch.tensor([[1, 2]]), 5, scales)
    want_k = (k / 0.5).clamp(-448, 448).to(FP8).float() * 0.5
    want_v = (v / 0.25).to(FP8).float() * 0.25
    assert torch.equal(keys[0], want_k)
    assert torch.equal(values[0], want_v)
    assert keys[0, 0, 0, 0] == 448 * 0.5
    assert torch.equal(cache[0, 0].float(), torch.zeros(4, 2, 8))  # (the null block untouched)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny")
    (folder / "config.json").write_text(json.dumps({**TINY, "torch_dtype": "bfloat16"}))
    return folder


def test_the_pool_holds_twice_the_tokens(tiny: Path) -> None:
    blocks = {}
    for kv in ("auto", "fp8"):
        llm = LLM(str(tiny), load_format="dummy", dtype="bfloat16", kv_cache_dtype=kv,
                  skip_tokenizer_init=True, cpu_kv_cache_gib=0.01)  # fmt: skip
        blocks[kv] = llm.engine.kv_cache_manager.block_pool.num_blocks
        assert llm.engine.runner.kv_caches[0].dtype == (FP8 if kv == "fp8" else torch.bfloat16)
        llm.engine.close()
    assert blocks["fp8"] == 2 * blocks["auto"]


def test_chunks_prefix_hits_and_preemption_read_what_a_plain_run_reads(tiny: Path) -> None:
    generator = torch.Generator().manual_seed(3)
    shared = torch.randint(3, 300, (40,), generator=generator).tolist()
    prompts = [shared + torch.randint(3, 300, (n,), generator=generator).tolist()
               for n in (5, 9, 13, 17)]  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=False, logprobs=5)

    def run(**engine: object) -> list[tuple[list[int], list[list[float]]]]:
        llm = LLM(str(tiny), load_format="dummy", dtype="float32", kv_cache_dtype="fp8",
                  skip_tokenizer_init=True, block_size=8, max_model_len=96, **engine)  # fmt: skip
        outputs = llm.generate(prompts, params)
        stats = llm.engine.stats()
        llm.engine.close()
        result = [
            (list(o.outputs[0].token_ids), [s.top_logprobs for s in o.outputs[0].logprobs or []])
            for o in outputs
        ]
        return result, stats.num_preemptions  # type: ignore[return-value]

    plain, _ = run(num_blocks=256, max_num_batched_tokens=1024)
    tight, preemptions = run(num_blocks=20, max_num_batched_tokens=24)  # (chunks of 24 tokens)
    assert preemptions > 0  # (their ends unknown: EOS may stop them, so they start by prompt)
    assert all(len(ids) == 24 for ids, _ in plain)  # (no EOS came: they all grew)
    for (ids_a, lps_a), (ids_b, lps_b) in zip(plain, tight, strict=True):
        assert ids_a == ids_b
        # (float32: the same cached values, attention summed in other chunks; seen 5e-6 relative)
        torch.testing.assert_close(torch.tensor(lps_a), torch.tensor(lps_b), rtol=2e-5, atol=1e-5)


def test_a_checkpoints_kv_scales_are_used(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    state = random_llama()
    for i in range(TINY["num_hidden_layers"]):
        state[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(0.5 + i)
        state[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(0.25)
    save_file(state, str(tmp_path / "model.safetensors"))
    kv_scheme = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
                 "symmetric": True}  # fmt: skip
    config = {**TINY, "quantization_config": {
        "quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {},
        "kv_cache_scheme": kv_scheme, "ignore": []}}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    llm = LLM(str(tmp_path), kv_cache_dtype="fp8", skip_tokenizer_init=True, num_blocks=64)
    assert llm.engine.quantization is None  # (weights as they are)
    scales = [layer.self_attn.kv_scales.tolist() for layer in llm.engine.runner.model.layers]
    assert scales == [[0.5, 0.25], [1.5, 0.25]]
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4))
    assert len(out[0].outputs[0].token_ids) == 4
    state["model.layers.1.self_attn.v_scale"] = torch.tensor(0.0)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"layers\.1\.self_attn\.v_scale' is no positive scale"):
        LLM(str(tmp_path), kv_cache_dtype="fp8", skip_tokenizer_init=True, num_blocks=64)


def test_an_unknown_kv_cache_dtype_is_refused() -> None:
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of \('auto', 'fp8'"):
        LLM("unused", kv_cache_dtype="int4")


def test_scales_are_measured_on_the_first_prompt_when_asked(tiny: Path) -> None:
    from kvfleet.engine.models.llama import KV_CALIBRATION_RANGE

    llm = LLM(str(tiny), load_format="dummy", dtype="float32", kv_cache_dtype="fp8",
              calculate_kv_scales=True, skip_tokenizer_init=True, num_blocks=64)  # fmt: skip
    model = llm.engine.runner.model
    seen: list[tuple[float, float]] = []

    def record(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        hidden = args[1]
        if len(seen) < len(model.layers) and hidden.shape[0] > 1:
            sizes = [module.q_size, module.kv_size, module.kv_size]
            _, k, v = module.qkv_proj(hidden).split(sizes, dim=-1)
            seen.append((k.abs().amax().item(), v.abs().amax().item()))

    hooks = [layer.self_attn.register_forward_pre_hook(record) for layer in model.layers]
    params = SamplingParams(temperature=0, max_tokens=3)
    llm.generate([[5, 9, 30, 200, 7, 1]], params)
    first = [layer.self_attn.kv_scales.tolist() for layer in model.layers]
    want = [[k / KV_CALIBRATION_RANGE, v / KV_CALIBRATION_RANGE] for k, v in seen]
    torch.testing.assert_close(torch.tensor(first), torch.tensor(want), rtol=1e-6, atol=0)
    assert first != [[1.0, 1.0]] * len(model.layers)
    llm.generate([[int(t) for t in range(20, 60)]], params)  # (measured once: kept)
    assert [layer.self_attn.kv_scales.tolist() for layer in model.layers] == first
    for hook in hooks:
        hook.remove()
    with pytest.raises(ValueError, match=r"calculate_kv_scales needs an FP8 KV cache"):
        LLM(str(tiny), load_format="dummy", calculate_kv_scales=True)
