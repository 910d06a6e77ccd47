"""Multi-LoRA on the GPU: Triton shrink/expand at Llama-3-8B shapes, and the engine's Triton path
(CUDA graphs included) against its torch reference path on a mixed batch.

Kernels: bf16, 8 adapters of rank 16, compared with the reference computed in float32 on the
same inputs; ||ours - reference|| / ||reference LoRA change|| under 2e-2 (bf16 rounding of the
shrunk activations and of the output), base-only rows bit-identical.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvfleet.bench.lora_adapters import write_random_adapters  # noqa: E402
from kvfleet.engine.config import ModelConfig  # noqa: E402
from kvfleet.engine.llm import LLM  # noqa: E402
from kvfleet.engine.lora import triton_ops  # noqa: E402
from kvfleet.engine.lora.ops import LoRABatch, add_lora_reference  # noqa: E402
from kvfleet.engine.sampling_params import SamplingParams  # noqa: E402

MAX_LORAS, RANK = 8, 16
LAYERS = {  # Llama-3-8B: in_features, slice widths
    "qkv_proj": (4096, (4096, 1024, 1024)),
    "gate_up_proj": (4096, (14336, 14336)),
    "down_proj": (14336, (4096,)),
}
STEPS = {
    # 64 decode rows: 7 per adapter, 8 base-only
    "decode-64": [i % (MAX_LORAS + 1) for i in range(64)],
    # prefill chunks of 3 adapters and the base model, 512 tokens
    "prefill-512": [2] * 200 + [MAX_LORAS] * 100 + [5] * 150 + [7] * 62,
}


@pytest.mark.parametrize("layer", list(LAYERS))
@pytest.mark.parametrize("step", list(STEPS))
def test_kernels_match_reference_at_real_shapes(layer: str, step: str) -> None:
    in_features, widths = LAYERS[layer]
    slots = STEPS[step]
    bounds = [0, *np.cumsum(widths).tolist()]
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(len(slots), in_features, generator=gen).cuda().bfloat16()
    a = (torch.randn(MAX_LORAS, len(widths) * RANK, in_features, generator=gen) / 64).cuda()
    b = (torch.randn(MAX_LORAS, bounds[-1], RANK, generator=gen) / 4).cuda()
    a, b = a.bfloat16(), b.bfloat16()
    out = torch.randn(len(slots), bounds[-1], generator=gen).cuda().bfloat16()
    batch = LoRABatch.build(np.array(slots), MAX_LORAS, torch.device("cuda"))
    assert batch is not None
    expected = out.float()
    add_lora_reference(expected, x.float(), a.float(), b.float(), batch, bounds)
    ours = out.clone()
    starts = torch.tensor(bounds, dtype=torch.int32, device="cuda")
    triton_ops.add_lora(ours, x, a, b, batch, bounds, starts)
    torch.cuda.synchronize()
    base_rows = torch.tensor(slots, device="cuda") == MAX_LORAS
    assert torch.equal(ours[base_rows], out[base_rows])
    change = (expected - out.float())[~base_rows]
    error = (ours.float() - expected)[~base_rows]
    relative = float(error.norm() / change.norm())
    print(f"{layer} {step}: relative error {relative:.2e}")
    assert relative < 2e-2, relative


def test_engine_triton_path_with_graphs_equals_torch_path(
    hf_model_dir: Callable[[str], tuple[Any, Path]], tmp_path: Path
) -> None:
    import json

    _, folder = hf_model_dir("llama3-rope-untied")
    config = ModelConfig.from_hf_config(json.loads((folder / "config.json").read_text()))
    modules = write_random_adapters(config, tmp_path, count=3, rank=8, seed=4)
    for module in modules.values():  # make them matter at this model's scale
        from safetensors.torch import load_file, save_file

        path = f"{module}/adapter_model.safetensors"
        save_file({k: v * 30 if "lora_B" in k else v for k, v in load_file(path).items()}, path)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 384, (n,), generator=gen).tolist() for n in (5, 30, 12, 44, 9, 21)]
    names = [None, "adapter-0", "adapter-1", "adapter-2", "adapter-0", None]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
    results = {}
    for backend in ("triton", "torch"):
        llm = LLM(
            str(folder),
            device="cuda",
            dtype="float32",
            attention_backend=backend,
            skip_tokenizer_init=True,
            num_blocks=256,
            max_model_len=256,
            enable_lora=True,
            max_loras=2,  # three adapters rotate through two slots
            max_lora_rank=8,
            lora_modules=modules,
        )
        outputs = llm.generate(prompts, params, lora=names)
        base = llm.generate(prompts[1:2], params)[0]
        results[backend] = ([o.outputs[0].token_ids for o in outputs], base.outputs[0].token_ids)
        if backend == "triton":
            graphs = llm.engine.runner.decode_graphs
            assert graphs is not None
            assert any(with_lora for _, _, with_lora in graphs.graphs)
            pieces = llm.engine.runner.prefill_graphs  # (the prompt steps with adapters too)
            assert pieces is not None
            assert any(with_lora for _, with_lora in pieces.pieces)
    assert results["triton"] == results["torch"]
    tokens, base_tokens = results["torch"]
    assert tokens[1] != base_tokens  # the adapter changes the output


def test_shrink_beside_the_matmul_equals_in_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """The shrink on a side stream beside the base matmul gives the bits of the shrink in line,
    eager and replayed from a CUDA graph, with the shrink held back ~1 ms on its stream (an
    expand that did not wait for it would read its output unwritten)."""
    from kvfleet.engine.lora.layers import LoRAContext, LoRALinear

    in_features, widths = LAYERS["qkv_proj"]
    context = LoRAContext(use_triton=True)
    gen = torch.Generator().manual_seed(3)
    base = torch.nn.Linear(in_features, sum(widths), bias=False).cuda().bfloat16()
    targets = ("q_proj", "k_proj", "v_proj")
    layer = LoRALinear(base, 0, targets, widths, MAX_LORAS, RANK, context)
    layer.lora_a.copy_(torch.randn(layer.lora_a.shape, generator=gen) / 64)
    layer.lora_b.copy_(torch.randn(layer.lora_b.shape, generator=gen) / 4)
    slots = np.array(STEPS["decode-64"])
    context.batch = LoRABatch.build(slots, MAX_LORAS, torch.device("cuda"))
    x = torch.randn(len(slots), in_features, generator=gen).cuda().bfloat16()

    def in_line(x: torch.Tensor) -> torch.Tensor:
        context.overlap_shrink = False
        try:
            return layer(x)  # type: ignore[no-any-return]
        finally:
            context.overlap_shrink = True

    shrink = triton_ops.shrink

    def held_back(*args: Any) -> None:
        torch.cuda._sleep(2_000_000)  # type: ignore[no-untyped-call]
        shrink(*args)

    monkeypatch.setattr(triton_ops, "shrink", held_back)
    with torch.inference_mode():
        expected = in_line(x)
        assert torch.equal(layer(x), expected)
        assert context._side_streams  # (it ran beside)
        static_x = x.clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            layer(static_x)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = layer(static_x)
        for seed in range(3):
            static_x.copy_(torch.randn(x.shape, generator=gen.manual_seed(seed)).bfloat16())
            graph.replay()
            assert torch.equal(static_out, in_line(static_x)), seed
