"""How far apart are bf16 runs of SmolLM2? Greedy agreement between attention backends and dtypes.

    bench/device_env.sh python3 bench/bf16_agreement.py      # on the device, SmolLM2 fetched

32 prompts x 32 greedy tokens per configuration; for each pair, how many continuations are
equal, and the largest and mean |difference| of first-step logprobs over tokens in both top-20s.
"""

from __future__ import annotations

import torch

from kvfleet.engine.llm import LLM
from kvfleet.engine.outputs import RequestOutput
from kvfleet.engine.sampling_params import SamplingParams

TOPICS = ["rivers", "chess", "volcanoes", "bread", "satellites", "owls", "glass", "jazz"]
PROMPTS = [f"{kind} about {t}:" for t in TOPICS for kind in ("A poem", "Facts", "A story", "Notes")]
CONFIGS = {
    "torch-f32": ("torch", "float32"),
    "triton-f32": ("triton", "float32"),
    "torch-bf16": ("torch", "bfloat16"),
    "triton-bf16": ("triton", "bfloat16"),
}
PAIRS = [
    ("triton-f32", "torch-f32"),
    ("torch-bf16", "torch-f32"),
    ("triton-bf16", "torch-f32"),
    ("triton-bf16", "torch-bf16"),
]


def compare(a: list[RequestOutput], b: list[RequestOutput]) -> tuple[int, float, float]:
    agree = sum(x.outputs[0].token_ids == y.outputs[0].token_ids for x, y in zip(a, b, strict=True))
    gaps = []
    for x, y in zip(a, b, strict=True):
        first_x, first_y = (x.outputs[0].logprobs or [])[0], (y.outputs[0].logprobs or [])[0]
        lookup = dict(zip(first_y.top_token_ids, first_y.top_logprobs, strict=True))
        pairs = zip(first_x.top_token_ids, first_x.top_logprobs, strict=True)
        gaps += [abs(v - lookup[t]) for t, v in pairs if t in lookup]
    return agree, max(gaps), sum(gaps) / len(gaps)


def main() -> None:
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=20)
    runs = {}
    for name, (backend, dtype) in CONFIGS.items():
        llm = LLM(
            "smollm2",
            device="cuda",
            dtype=dtype,
            attention_backend=backend,
            max_model_len=1024,
            num_blocks=1024,
        )
        runs[name] = llm.generate(PROMPTS, params)
        del llm
        torch.cuda.empty_cache()
    for a, b in PAIRS:
        agree, worst, mean = compare(runs[a], runs[b])
        print(
            f"{a:12s} vs {b:12s}: greedy agree {agree}/32, "
            f"first-step |dlogprob| max {worst:.4f} mean {mean:.4f}"
        )


if __name__ == "__main__":
    main()
