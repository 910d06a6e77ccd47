"""Tensor parallelism agrees with one GPU: the same prompts through TP=1 and TP=N (each in its
own process, so each gets the GPUs' whole memory), compared token by token and logprob by
logprob at the first generated position (same inputs on both sides), each beside a float32
run on one GPU: the spread the dtype alone causes.

    python3 bench/tp_agreement.py --model llama-3-8b --tp 2 [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any


def generate(args: argparse.Namespace) -> None:
    import torch

    from kvfleet.engine.llm import LLM
    from kvfleet.engine.sampling_params import SamplingParams

    llm = LLM(
        args.model,
        load_format=args.load_format,
        dtype=args.dtype,
        max_model_len=1024,
        tensor_parallel_size=args.size,
    )
    vocab = llm.engine.model_config.vocab_size
    generator = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(100, vocab - 100, (64 + 16 * i,), generator=generator).tolist()
        for i in range(8)
    ]
    params = SamplingParams(temperature=0, max_tokens=32, logprobs=5, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    rows = []
    for output in outputs:
        completion = output.outputs[0]
        assert completion.logprobs is not None
        first = completion.logprobs[0]
        rows.append(
            {
                "tokens": completion.token_ids,
                "first_top_ids": first.top_token_ids,
                "first_top_logprobs": first.top_logprobs,
            }
        )
    Path(args.out).write_text(json.dumps(rows))
    llm.engine.close()


def compare(args: argparse.Namespace) -> None:
    """Three runs: float32 on one GPU (the reference), `--dtype` on one GPU, `--dtype` on
    `--tp` GPUs. Tensor parallelism is within the dtype's tolerance when it strays from the
    float32 reference about as far as one GPU in that dtype does."""
    runs = {
        "fp32_tp1": (1, "float32"),
        "tp1": (1, args.dtype),
        f"tp{args.tp}": (args.tp, args.dtype),
    }
    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        for name, (size, dtype) in runs.items():
            out = Path(scratch) / f"{name}.json"
            command = [sys.executable, __file__, "--model", args.model, "--dtype", dtype]
            command += ["--load-format", args.load_format, "--size", str(size), "--out", str(out)]
            subprocess.run(command, check=True)
            results[name] = json.loads(out.read_text())
    many = f"tp{args.tp}"
    report = {
        "model": args.model,
        "dtype": args.dtype,
        "tensor_parallel_size": args.tp,
        "prompts": len(results["tp1"]),
        f"tp1_{args.dtype}_vs_fp32": agreement(results["fp32_tp1"], results["tp1"]),
        f"{many}_{args.dtype}_vs_fp32": agreement(results["fp32_tp1"], results[many]),
        f"{many}_vs_tp1_{args.dtype}": agreement(results["tp1"], results[many]),
    }
    print(json.dumps(report))


def agreement(one: list[Any], many: list[Any]) -> dict[str, Any]:
    """First generated token, first-step top logprobs, and how long greedy outputs stay equal."""
    same_first = sum(
        a["first_top_ids"][0] == b["first_top_ids"][0] for a, b in zip(one, many, strict=True)
    )
    # the same token's logprob on both sides, over the tokens both top lists hold
    worst = max(
        abs(x - dict(zip(b["first_top_ids"], b["first_top_logprobs"], strict=True))[t])
        for a, b in zip(one, many, strict=True)
        for t, x in zip(a["first_top_ids"], a["first_top_logprobs"], strict=True)
        if t in b["first_top_ids"]
    )
    prefix = [
        next(
            (i for i, (x, y) in enumerate(zip(a["tokens"], b["tokens"], strict=False)) if x != y),
            len(a["tokens"]),
        )
        for a, b in zip(one, many, strict=True)
    ]
    return {
        "first_token_agreement": f"{same_first}/{len(one)}",
        "first_step_max_abs_logprob_diff": round(worst, 5),
        "identical_greedy_tokens": prefix,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tp", type=int, default=2, help="the tensor-parallel size to compare")
    parser.add_argument("--size", type=int, help=argparse.SUPPRESS)  # one run (a child)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--files", nargs=2, metavar="JSON", help="compare two runs' files")
    args = parser.parse_args()
    if args.files:
        one, many = (json.loads(Path(f).read_text()) for f in args.files)
        print(json.dumps(agreement(one, many)))
    elif args.size is not None:
        generate(args)
    else:
        compare(args)


if __name__ == "__main__":
    main()
