"""Call 130's diagnostic (session 48): `tests/gpu/test_fp8_cuda.py`'s norms-in-GEMV test under
FP8 with `triton_gemv.FP8_BF16_ROW` on parted at token 20 of 24: where each prompt's two runs
first differ and by how much (`bf16_agreement.first_difference`, top 5), bf16 and FP8 (W8A16 and
W8A8).

    bench/device_env.sh python3 bench/next/norms_fp8_diag.py
"""

from __future__ import annotations

import torch

from kvfleet.bench.bf16_agreement import Run, first_difference, from_engine
from kvfleet.engine.layers import linear, triton_gemv
from kvfleet.engine.llm import LLM
from kvfleet.engine.sampling_params import SamplingParams


def runs(quantization: str | None) -> list[Run]:
    llm = LLM("llama-3.2-1b", load_format="dummy", device="cuda", dtype="bfloat16",
              quantization=quantization, max_model_len=1024, num_blocks=256,
              max_num_seqs=4)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=5)
    prompts = [[128000 + i, *range(1000 + 7 * i, 1040 + 9 * i)] for i in range(3)]
    out = [from_engine(llm.generate([p], params)[0]) for p in prompts]
    llm.engine.close()
    del llm
    torch.cuda.empty_cache()
    return out


for label, quantization, as_is in (("bf16", None, False), ("fp8 W8A16", "fp8", True),
                                   ("fp8 W8A8", "fp8", False)):  # fmt: skip
    triton_gemv.FP8_BF16_ROW = as_is
    both = []
    for in_gemv in (True, False):
        linear.NORM_IN_GEMV = in_gemv
        both.append(runs(quantization))
    print(label, [first_difference(a, b, top=5) for a, b in zip(*both, strict=True)], flush=True)
