"""How far apart are bf16 runs of SmolLM2? Greedy agreement between attention backends and dtypes.

    bench/device_env.sh python3 bench/bf16_agreement.py      # on the device, SmolLM2 fetched

32 prompts x 32 greedy tokens per configuration; for each pair, how many continuations are
equal, and the largest and mean |difference| of first-step logprobs over tokens in both top-20s.
`hf-*` run Hugging Face transformers `generate` on the same GGUF file and prompt ids (its own
SDPA attention): a second, independent implementation. The `*-mixed` configurations swap one
part at a time (eager, so no graph keeps the old kernels): triton attention with the torch
layer chain, and torch attention with the fused layer kernels, to tell the attention kernels'
share of the difference from the layer kernels'. `torch-bf16-again` checks run-to-run equality.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvfleet.engine.llm import LLM
from kvfleet.engine.loader import model_cache
from kvfleet.engine.output.request_output import RequestOutput
from kvfleet.engine.sampling_params import SamplingParams

TOPICS = ["rivers", "chess", "volcanoes", "bread", "satellites", "owls", "glass", "jazz"]
PROMPTS = [f"{kind} about {t}:" for t in TOPICS for kind in ("A poem", "Facts", "A story", "Notes")]
# name: (attention backend, dtype, fused layer kernels or None for the backend's default)
CONFIGS: dict[str, tuple[str, str, bool | None]] = {
    "torch-f32": ("torch", "float32", None),
    "triton-f32": ("triton", "float32", None),
    "torch-bf16": ("torch", "bfloat16", None),
    "triton-bf16": ("triton", "bfloat16", None),
    "triton-attn-mixed": ("triton", "bfloat16", False),
    "torch-attn-mixed": ("torch", "bfloat16", True),
    "torch-bf16-again": ("torch", "bfloat16", None),
}
PAIRS = [
    ("triton-f32", "torch-f32"),
    ("torch-bf16", "torch-f32"),
    ("triton-bf16", "torch-f32"),
    ("triton-bf16", "torch-bf16"),
    ("triton-attn-mixed", "torch-bf16"),
    ("torch-attn-mixed", "torch-bf16"),
    ("torch-bf16-again", "torch-bf16"),
    ("hf-f32", "torch-f32"),
    ("hf-bf16", "hf-f32"),
    ("hf-bf16", "torch-bf16"),
    ("hf-bf16", "triton-bf16"),
]
HF_CONFIGS = {"hf-f32": torch.float32, "hf-bf16": torch.bfloat16}


@dataclass
class Run:
    token_ids: list[int]
    first_top: dict[int, float]  # first sampled position: token id -> logprob, top 20


def from_engine(output: RequestOutput) -> Run:
    first = (output.outputs[0].logprobs or [])[0]
    top = dict(zip(first.top_token_ids, first.top_logprobs, strict=True))
    return Run(list(output.outputs[0].token_ids), top)


def hf_runs(prompt_ids: list[list[int]], dtype: torch.dtype) -> list[Run]:
    from transformers import AutoModelForCausalLM

    path = (
        model_cache.ModelCache(model_cache.kvfleet_home())
        .fetch(model_cache.BUILTIN_MODELS["smollm2"], progress=False)[0]
        .path
    )
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    model = model.to(device="cuda", dtype=dtype)  # type: ignore[call-arg]
    model.generation_config.eos_token_id = None  # as ignore_eos: EOS may be chosen, no stop
    runs = []
    for ids in prompt_ids:
        inputs = torch.tensor([ids], device="cuda")
        with torch.inference_mode():
            out = model.generate(
                inputs,
                attention_mask=torch.ones_like(inputs),
                max_new_tokens=32,
                pad_token_id=0,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
            )
        logprobs = torch.log_softmax(out.logits[0][0].float(), -1)
        top = torch.topk(logprobs, 20)
        first_top = dict(zip(top.indices.tolist(), top.values.tolist(), strict=True))
        runs.append(Run(out.sequences[0, len(ids) :].tolist(), first_top))
    del model
    torch.cuda.empty_cache()
    return runs


def compare(a: list[Run], b: list[Run]) -> tuple[int, float, float]:
    agree = sum(x.token_ids == y.token_ids for x, y in zip(a, b, strict=True))
    gaps = [
        abs(v - y.first_top[t])
        for x, y in zip(a, b, strict=True)
        for t, v in x.first_top.items()
        if t in y.first_top
    ]
    return agree, max(gaps), sum(gaps) / len(gaps)


def set_fused(llm: LLM, fused: bool) -> None:
    for module in llm.engine.runner.model.modules():
        if hasattr(module, "fused"):
            setattr(module, "fused", fused)  # noqa: B010 (a plain attribute, not a tensor)


def main() -> None:
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=20)
    runs: dict[str, list[Run]] = {}
    for name, (backend, dtype, fused) in CONFIGS.items():
        llm = LLM(
            "smollm2",
            device="cuda",
            dtype=dtype,
            attention_backend=backend,
            max_model_len=1024,
            num_blocks=1024,
            enforce_eager=fused is not None,
        )
        if fused is not None:
            set_fused(llm, fused)
        outputs = llm.generate(PROMPTS, params)
        runs[name] = [from_engine(o) for o in outputs]
        prompt_ids = [o.prompt_token_ids for o in outputs]
        del llm
        torch.cuda.empty_cache()
    for name, hf_dtype in HF_CONFIGS.items():
        runs[name] = hf_runs(prompt_ids, hf_dtype)
    for a, b in PAIRS:
        agree, worst, mean = compare(runs[a], runs[b])
        print(
            f"{a:17s} vs {b:12s}: greedy agree {agree}/32, "
            f"first-step |dlogprob| max {worst:.4f} mean {mean:.4f}"
        )


if __name__ == "__main__":
    main()
