"""How far apart are bf16 runs of SmolLM2? Greedy agreement between attention backends and dtypes.

    bench/device_env.sh python3 bench/bf16_agreement.py      # on the device, SmolLM2 fetched

32 prompts x 32 greedy tokens per configuration; for each pair, how many continuations are
equal, the largest and mean |difference| of first-step logprobs over tokens in both top-20s,
and where they first differ how far from a tie that is (`first_difference`: issue 32's bar for
triton-bf16 against torch-bf16 is each within 0.1, the tokens in each other's top 5).
`hf-*` run Hugging Face transformers `generate` on the same GGUF file and prompt ids (its own
SDPA attention): a second, independent implementation. The `*-mixed` configurations swap one
part at a time (eager, so no graph keeps the old kernels): triton attention with the torch
layer chain, and torch attention with the fused layer kernels, to tell the attention kernels'
share of the difference from the layer kernels'. `torch-bf16-again` checks run-to-run equality.
"""

from __future__ import annotations

import math
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
    tops: list[dict[int, float]]  # each sampled position: token id -> logprob, top 20

    @property
    def first_top(self) -> dict[int, float]:
        return self.tops[0]


def from_engine(output: RequestOutput) -> Run:
    completion = output.outputs[0]
    tops = [
        dict(zip(step.top_token_ids, step.top_logprobs, strict=True))
        for step in completion.logprobs or []
    ]
    return Run(list(completion.token_ids), tops)


def first_difference(a: Run, b: Run, top: int = 5) -> tuple[int, float] | None:
    """Where two greedy continuations of one prompt first differ, and how far from a tie they
    are there: the larger over both runs of the logprob by which a run's own token beats the
    other run's token (inf where that token is outside its top `top`). None: equal."""
    at = next(
        (i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=True)) if x != y), None
    )
    if at is None:
        return None
    gaps = []
    for mine, other in ((a, b), (b, a)):
        ranked = dict(sorted(mine.tops[at].items(), key=lambda kv: -kv[1])[:top])
        theirs = other.token_ids[at]
        gaps.append(ranked[mine.token_ids[at]] - ranked[theirs] if theirs in ranked else math.inf)
    return at, max(gaps)


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
        tops = []
        for logits in out.logits:
            best = torch.topk(torch.log_softmax(logits[0].float(), -1), 20)
            tops.append(dict(zip(best.indices.tolist(), best.values.tolist(), strict=True)))
        runs.append(Run(out.sequences[0, len(ids) :].tolist(), tops))
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
        found = [first_difference(x, y) for x, y in zip(runs[a], runs[b], strict=True)]
        gaps = sorted(f[1] for f in found if f is not None)
        print(
            f"{a:17s} vs {b:12s}: greedy agree {agree}/32, "
            f"first-step |dlogprob| max {worst:.4f} mean {mean:.4f}; where they differ, "
            f"near-ties (<= 0.1) {sum(g <= 0.1 for g in gaps)}/{len(gaps)}, gaps "
            + " ".join(f"{g:.3f}" for g in gaps)
        )
    for i, (x, y) in enumerate(zip(runs["triton-bf16"], runs["torch-bf16"], strict=True)):
        if (found_at := first_difference(x, y)) is not None and found_at[1] > 0.1:
            at = found_at[0]
            print(
                f"prompt {i} ({PROMPTS[i]!r}) step {at}: triton {x.token_ids[at]} "
                f"{_top3(x.tops[at])}, torch {y.token_ids[at]} {_top3(y.tops[at])}"
            )


def _top3(top: dict[int, float]) -> str:
    return ", ".join(f"{t}:{v:.3f}" for t, v in sorted(top.items(), key=lambda kv: -kv[1])[:3])


if __name__ == "__main__":
    main()
