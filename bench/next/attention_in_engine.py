"""The decode kernel on the engine's own inputs: an FP8 Llama-3-8B engine (random weights, eager)
decodes `--batch-size` sequences of `--prompt-len` tokens; the first layer's decode-attention
call of a step is captured and timed alone (a CUDA graph of 32 calls), then with each of its
inputs replaced by a bench-made one: the cache's values, q and out contiguous, the block
tables made anew, so that what makes the kernel slower in the engine than in
bench/decode_layers.py shows by elimination.

    bench/device_env.sh python3 bench/next/attention_in_engine.py --batch-size 512 --prompt-len 1500
"""

import argparse
import dataclasses
import functools
from typing import Any

import torch

from kvfleet.bench.attention_steps import graph_us, kv_bytes
from kvfleet.bench.ceilings import measure_ceilings
from kvfleet.bench.decode_layers import block_tables, random_cache
from kvfleet.engine.attention import triton_attention, triton_decode
from kvfleet.engine.llm import LLM
from kvfleet.engine.sampling_params import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--prompt-len", type=int, default=1500)
    args = parser.parse_args()
    llm = LLM("llama-3-8b", load_format="dummy", dtype="bfloat16", quantization="fp8",
              kv_cache_dtype="fp8", enforce_eager=True, max_model_len=args.prompt_len + 900,
              max_num_seqs=args.batch_size)  # fmt: skip
    engine = llm.engine
    params = SamplingParams(temperature=1.0, max_tokens=800, ignore_eos=True)
    for i in range(args.batch_size):
        engine.add_request(f"p{i}", list(range(1000 + i, 1000 + i + args.prompt_len)), params)
    while engine.scheduler.waiting or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running
    ):
        engine.step()
    calls: list[dict[str, Any]] = []
    real = triton_decode.decode_attention

    def spy(*a: Any, **kw: Any) -> torch.Tensor:
        if not calls:
            names = ("q", "kv_cache", "metadata", "scale", "sliding_window", "out")
            calls.append(dict(zip(names, a, strict=False)) | kw)
        return real(*a, **kw)

    setattr(triton_attention, "decode_attention", spy)  # noqa: B010  (the name it calls)
    engine.step()
    setattr(triton_attention, "decode_attention", real)  # noqa: B010
    torch.cuda.synchronize()
    call = calls[0]
    meta = call["metadata"]
    lens = meta.seq_lens_cpu
    copy_gbps = measure_ceilings(torch.device("cuda"), torch.bfloat16).copy_gbps
    floor_us = kv_bytes(lens, True) / (copy_gbps * 1e3)
    q, cache = call["q"], call["kv_cache"]
    out = call["out"]
    print(f"{len(lens)} sequences of {min(lens)}-{max(lens)} tokens; floor {floor_us:.1f} us; "
          f"q {tuple(q.shape)}, cache {tuple(cache.shape)} {cache.dtype}, "
          f"tables {tuple(meta.block_tables.shape)}, kv_scales {call.get('kv_scales')}, "
          f"sliding_window {call['sliding_window']}, softcap {call.get('softcap')}")  # fmt: skip
    used = int(meta.block_tables.max()) + 1
    sample = cache[0, 1 : min(used, 4096)].view(torch.uint8)  # (the first 4k blocks' K)
    print(f"K bytes of the first blocks: zero {(sample == 0).float().mean().item():.3f}, NaN "
          f"{((sample & 0x7F) == 0x7F).float().mean().item():.2e}, |K| mean "
          f"{sample.view(cache.dtype).float().abs().mean().item():.3f}")  # fmt: skip
    for name, t in (
        ("q", q),
        ("out", out),
        ("k/v", cache),
        ("seq_lens", meta.seq_lens),
        ("block_tables", meta.block_tables),
        ("kv_scales", call.get("kv_scales")),
    ):
        if t is not None:
            print(f"  {name}: data_ptr % 16 = {t.data_ptr() % 16}, strides {t.stride()}")
    tables = block_tables(lens, "engine", cache.shape[1], args.prompt_len).cuda()
    new_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    variants = {
        "as the engine calls it": {},
        "q and out contiguous": {"q": q.contiguous(), "out": torch.empty_like(q.contiguous())},
        "random cache values": {"kv_cache": random_cache(used, True)},
        "block tables made anew": {"metadata": dataclasses.replace(meta, block_tables=tables)},
        "seq lens made anew": {"metadata": dataclasses.replace(meta, seq_lens=new_lens)},
    }
    for name, change in variants.items():
        run = functools.partial(real, **(call | change))
        us = graph_us(run, replays=32)
        print(f"{name:28s} {us:7.1f} us ({floor_us / us:5.1%} of floor)")
    engine.close()


if __name__ == "__main__":
    main()
