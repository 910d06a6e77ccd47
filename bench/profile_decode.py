"""Where a decode step's time goes: torch profiler over steady-state decode steps.

    bench/device_env.sh python3 bench/profile_decode.py     # on the device

Prints the step time, then the top operators by host (CPU) time and by GPU time.
"""

import time

import torch
from torch.profiler import ProfilerActivity, profile

from kvfleet.engine.llm import LLM
from kvfleet.engine.sampling_params import SamplingParams


def main() -> None:
    llm = LLM("llama-3-8b", load_format="dummy", dtype="bfloat16", max_model_len=512)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    engine.add_request("p", list(range(1000, 1128)), params)
    for _ in range(20):
        engine.step()
    torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(20):
        engine.step()
    torch.cuda.synchronize()
    print(f"ms/step {(time.perf_counter() - began) / 20 * 1e3:.2f}")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            engine.step()
        torch.cuda.synchronize()
    averages = prof.key_averages()
    print(averages.table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=60))
    print(averages.table(sort_by="self_cuda_time_total", row_limit=10, max_name_column_width=60))


if __name__ == "__main__":
    main()
