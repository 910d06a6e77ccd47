"""What quantization costs in quality: a quantized engine against the same model unquantized,
greedy continuations and perplexity on a fixed text.

    bench/device_env.sh python3 -m kvfleet.bench.quality --model smollm2 --quantization fp8

32 prompts (bench/bf16_agreement.py's) x 32 greedy tokens: how many continuations are equal;
where they first differ, the two tokens' logprob gap under the unquantized model. Perplexity of
tests/data/perplexity.txt (one forward over the whole text, the engine's own model and
attention kernels); with `--decode-perplexity` also through the decode kernels, the text fed a
token a step as decode steps are (what a decode-only change, such as
`triton_decode.E4M3_PRODUCTS`, costs).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
from pathlib import Path
from typing import Any

import torch

from kvfleet.bench.bf16_agreement import PROMPTS
from kvfleet.engine.attention.metadata import AttentionMetadata
from kvfleet.engine.llm import LLM
from kvfleet.engine.models.llama import LlamaForCausalLM
from kvfleet.engine.sampling_params import SamplingParams

TEXT = Path(__file__).resolve().parents[1] / "tests" / "data" / "perplexity.txt"
_BLOCK = 16


def _scratch_cache(
    model: LlamaForCausalLM, blocks: int, device: torch.device, dtype: torch.dtype | None
) -> list[torch.Tensor]:
    """Each layer's KV cache of `blocks` blocks after the null block 0, in `dtype` (None: the
    model's)."""
    config = model.config
    dtype = dtype or model.embed_tokens.weight.dtype
    return [
        torch.zeros(2, blocks + 1, _BLOCK, config.num_key_value_heads, config.head_dim,
                    dtype=dtype, device=device)
        for _ in model.layers
    ]  # fmt: skip


def perplexity(
    model: LlamaForCausalLM,
    token_ids: list[int],
    device: torch.device,
    kv_cache_dtype: torch.dtype | None = None,
) -> float:
    """exp(mean negative log-likelihood) of each token after the ones before it: one prompt
    forward through `model` over a scratch KV cache (of `kv_cache_dtype`: the engine's)."""
    n = len(token_ids)
    blocks = -(-n // _BLOCK)
    kv = _scratch_cache(model, blocks, device, kv_cache_dtype)
    metadata = AttentionMetadata.one_prompt(  # (in blocks 1..; block 0 is the null block)
        torch.arange(_BLOCK, _BLOCK + n, device=device),
        torch.arange(1, blocks + 1, dtype=torch.int32, device=device),
    )
    ids = torch.tensor(token_ids, device=device)
    with torch.inference_mode():
        hidden = model(ids, torch.arange(n, device=device), kv, metadata)
        logits = model.compute_logits(hidden[:-1])
        nll = torch.nn.functional.cross_entropy(logits, ids[1:])
    return math.exp(nll.item())


def decode_perplexity(
    model: LlamaForCausalLM,
    token_ids: list[int],
    device: torch.device,
    kv_cache_dtype: torch.dtype | None = None,
) -> float:
    """`perplexity` with the text fed one token a step, each step a decode step (one query
    token over the tokens before it in the cache): the decode attention kernels' perplexity."""
    n = len(token_ids)
    blocks = -(-n // _BLOCK)
    kv = _scratch_cache(model, blocks, device, kv_cache_dtype)
    table = torch.arange(1, blocks + 1, dtype=torch.int32, device=device)[None]
    ids = torch.tensor(token_ids, device=device)
    one_query = torch.tensor([0, 1], dtype=torch.int32, device=device)
    logprobs = []  # (on the device: one sync at the end, none a step)
    with torch.inference_mode():
        for t in range(n - 1):
            metadata = AttentionMetadata(
                slot_mapping=torch.tensor([_BLOCK + t], device=device),
                block_tables=table,
                cu_seqlens_q=one_query,
                seq_lens=torch.tensor([t + 1], dtype=torch.int32, device=device),
                max_seqlen_q=1,
                max_seqlen_k=t + 1,
                query_lens_cpu=[1],
                seq_lens_cpu=[t + 1],
            )
            hidden = model(ids[t : t + 1], torch.tensor([t], device=device), kv, metadata)
            logits = model.compute_logits(hidden).float()
            logprobs.append(torch.log_softmax(logits[0], -1)[ids[t + 1]])
    nll = -float(torch.stack(logprobs).double().sum())
    return math.exp(nll / (n - 1))


def evaluate(model: str, decoding: bool = False, **engine_args: Any) -> dict[str, Any]:
    """Greedy continuations (ids, and the first 20 logprobs of each step) and perplexity (and,
    `decoding`, its `decode_perplexity`)."""
    llm = LLM(model, max_model_len=2048, **engine_args)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=20)
    outputs = llm.generate(PROMPTS, params)
    engine = llm.engine
    assert engine.tokenizer is not None
    text_ids = engine.tokenizer.encode(TEXT.read_text())
    result = {
        "continuations": [list(o.outputs[0].token_ids) for o in outputs],
        "logprobs": [
            [
                dict(zip(step.top_token_ids, step.top_logprobs, strict=True))
                for step in o.outputs[0].logprobs or []
            ]
            for o in outputs
        ],
        "perplexity": perplexity(
            engine.runner.model, text_ids, engine.device, engine.runner.kv_cache_dtype
        ),
        "decode_perplexity": (
            decode_perplexity(
                engine.runner.model, text_ids, engine.device, engine.runner.kv_cache_dtype
            )
            if decoding
            else None
        ),
        "text_tokens": len(text_ids),
        "describe": engine.quantization.describe() if engine.quantization else "none",
    }
    engine.close()
    del llm, engine
    gc.collect()
    torch.cuda.empty_cache()
    return result


def compare(base: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """Equal continuations; at each first difference, the gap between the two tokens'
    logprobs under `base` (a near-tie when small; None when the other's token is not in
    base's top 20)."""
    equal, gaps = 0, []
    for ids_a, ids_b, steps in zip(
        base["continuations"], other["continuations"], base["logprobs"], strict=True
    ):
        if ids_a == ids_b:
            equal += 1
            continue
        at = next(i for i, (a, b) in enumerate(zip(ids_a, ids_b, strict=True)) if a != b)
        top = steps[at]
        other_lp = top.get(ids_b[at])
        gaps.append(None if other_lp is None else round(top[ids_a[at]] - other_lp, 4))
    decoded = {}
    if base["decode_perplexity"] is not None and other["decode_perplexity"] is not None:
        decoded = {
            "decode_perplexity": round(other["decode_perplexity"], 4),
            "decode_perplexity_base": round(base["decode_perplexity"], 4),
            "decode_perplexity_rise_pct": round(
                100 * (other["decode_perplexity"] / base["decode_perplexity"] - 1), 2
            ),
        }
    return {
        "equal_continuations": equal,
        "prompts": len(base["continuations"]),
        "first_difference_logprob_gaps": gaps,
        "perplexity": round(other["perplexity"], 4),
        "perplexity_base": round(base["perplexity"], 4),
        "perplexity_rise_pct": round(100 * (other["perplexity"] / base["perplexity"] - 1), 2),
    } | decoded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--quantization", default=None, help="fp8, rtn, gguf, or none")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--calculate-kv-scales", action="store_true")
    parser.add_argument(
        "--decode-perplexity",
        action="store_true",
        help="also the perplexity through the decode kernels, a token a step",
    )
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args()
    base = evaluate(args.model, args.decode_perplexity, dtype=args.dtype)
    quantized = evaluate(
        args.model,
        args.decode_perplexity,
        dtype=args.dtype,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        calculate_kv_scales=args.calculate_kv_scales,
    )
    result = {
        "model": args.model,
        "dtype": args.dtype,
        "quantization": quantized["describe"],
        "kv_cache_dtype": args.kv_cache_dtype,
        "calculate_kv_scales": args.calculate_kv_scales,
        "text_tokens": base["text_tokens"],
        **compare(base, quantized),
    }
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
