"""The engine's torch path on CUDA: against transformers on the same GPU, and at Llama-3-8B shape.

Float32 on CUDA with TF32 off: the same tolerance as on the CPU applies within rounding of the
GPU's kernels (stated below). bf16 runs check shape handling and finiteness, not equality.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from kvfleet.engine.llm import LLM  # noqa: E402
from kvfleet.engine.sampling_params import SamplingParams  # noqa: E402

TOLERANCE = 1e-4  # max |logprob difference| against transformers, float32 on CUDA


@pytest.fixture(autouse=True)
def _no_tf32() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def test_random_models_match_transformers_on_cuda(
    hf_config_name: str,
    hf_model_dir: Callable[[str], tuple[Any, Path]],
    logprob_gap: Callable[..., float],
) -> None:
    hf_model, folder = hf_model_dir(hf_config_name)
    hf_model = hf_model.to("cuda")
    prompt = torch.randint(3, 384, (70,), generator=torch.Generator().manual_seed(1)).tolist()
    llm = LLM(
        str(folder),
        device="cuda",
        dtype="float32",
        skip_tokenizer_init=True,
        block_size=8,
        max_num_batched_tokens=32,
        num_blocks=64,
        max_model_len=256,
    )
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=20, ignore_eos=True)
    (output,) = llm.generate(prompt, params)
    completion = output.outputs[0]
    worst = logprob_gap(hf_model, prompt, completion)
    hf_model.to("cpu")
    assert worst < TOLERANCE, f"max |logprob difference| {worst:.2e}"


def test_smollm2_greedy_matches_transformers_on_cuda(
    hf_greedy: Callable[..., list[int]], smollm2: Path
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = smollm2
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    hf_model = (
        AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
        .to("cuda")
        .eval()
    )
    texts = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time,", "1, 2, 3,"]
    prompts = [tokenizer.encode(t) for t in texts]
    llm = LLM(
        "smollm2",
        device="cuda",
        dtype="float32",
        max_model_len=1024,
        num_blocks=512,
        max_num_batched_tokens=16,
    )
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.outputs[0].token_ids == hf_greedy(hf_model, prompt, 32)

    bf16 = LLM("smollm2", device="cuda", dtype="bfloat16", max_model_len=1024, num_blocks=512)
    (answer,) = bf16.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=16),
    )
    assert "Paris" in answer.outputs[0].text


def test_llama3_8b_shape_dummy_bf16() -> None:
    llm = LLM(
        "llama-3-8b",  # the shipped config
        load_format="dummy",
        device="cuda",
        dtype="bfloat16",
        max_model_len=4096,
        num_blocks=2048,
    )
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=1)
    for batch in (1, 8):
        prompts = [[128000 + i, *range(1000 + i, 1500 + i)] for i in range(batch)]
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - start
        for out in outputs:
            completion = out.outputs[0]
            assert len(completion.token_ids) == 32
            assert all(torch.isfinite(torch.tensor(lp.logprob)) for lp in completion.logprobs or [])
        # Information, not a bar: the torch reference path; targets are for the Triton path.
        print(f"llama-3-8b dummy bf16, batch {batch}, 500 in / 32 out: {elapsed:.2f} s")


def test_no_kernel_compiles_mid_serving() -> None:
    """From the engine's first requests on (a lone greedy prompt and a lone sampled one: one
    row's logits and the vocabulary race, warmed at startup), steps of other shapes (odd and
    even token counts, batch sizes, a prefix-cache hit leaving 5 prompt tokens to compute, one
    and then three at once leaving 40 after 4k cached, whose keys the prompt kernel splits 17
    and 6 ways, a 4.2k-token prompt of its "long" tiles, eight 7k prompts at once: the chunks
    of the last ones beside five to seven decodes of 35-49k KV tokens, which the decode kernel
    takes with 14, 11 and 10 splits planned where the decode graphs of 4 and 8 took 17 and 9)
    meet no new Triton kernel variant:
    none stalls its batch for a compile (0.2-1.2 s each, seen on the H100 when the packed step
    inputs' alignment followed the token count, at the first split prefix hit before the
    warm-up took one, and on the H200 at each new split count's merge and at a server's first
    request)."""
    from kvfleet.engine.layers.compile_watch import CompileWatch

    llm = LLM(
        "llama-3.2-1b",
        load_format="dummy",
        device="cuda",
        dtype="bfloat16",
        max_model_len=8192,
        num_blocks=4096,
        max_num_seqs=8,
    )
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, seed=3, max_tokens=8, ignore_eos=True)
    watch = CompileWatch()  # (what a server counts in kvfleet:kernel_compiles_while_serving)
    assert watch.start()
    try:
        first = list(range(1000, 1100))
        llm.generate(first, greedy)
        llm.generate(list(range(2000, 2064)), sampled)
        llm.generate([first, list(range(2100, 2164))], [greedy, sampled])
        llm.generate([*first[:96], 7, 8, 9, 10, 11], greedy)  # (96 cached, 5 computed)
        long = list(range(5000, 9200))
        llm.generate(long, greedy)
        llm.generate([*long[:4096], *range(40)], greedy)  # (4,096 cached, 40 computed)
        hits = [[*long[:4096], *range(100 * i, 100 * i + 40)] for i in range(1, 4)]
        llm.generate(hits, greedy)  # (three such hits in one step)
        for count, length in ((3, 37), (5, 50), (2, 51), (7, 18)):
            prompts = [list(range(3000 + 100 * i, 3000 + 100 * i + length)) for i in range(count)]
            llm.generate(prompts, [greedy, sampled] * (count // 2) + [greedy] * (count % 2))
        sevens = [list(range(10000 + 7000 * i, 17000 + 7000 * i)) for i in range(8)]
        llm.generate(sevens, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))
    finally:
        watch.stop()
    assert watch.compiled == []


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_preempted_requests_swapped_out_and_back_keep_their_outputs(
    hf_model_dir: Callable[[str], tuple[Any, Path]], kv_cache_dtype: str
) -> None:
    """A pool too small for six growing requests (EOS not ignored: their end is unknown):
    preempted ones are swapped out to pinned host blocks and copied back (Triton kernels,
    decode graphs), and each output equals its output alone; with no swap space they are
    recomputed, to the same outputs."""
    _, folder = hf_model_dir("llama2-tied")
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 300, (30 + 5 * i,), generator=gen).tolist() for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=40)

    def run(num_blocks: int, swap_space_gib: float) -> tuple[list[list[int]], Any]:
        llm = LLM(
            str(folder),
            device="cuda",
            dtype="float32",
            skip_tokenizer_init=True,
            block_size=16,
            num_blocks=num_blocks,
            max_model_len=128,
            max_num_batched_tokens=64,
            kv_cache_dtype=kv_cache_dtype,
            swap_space_gib=swap_space_gib,
        )
        outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        return outputs, llm.engine.scheduler.stats()

    alone, _ = run(256, 0.0)
    swapped, stats = run(13, 1.0)
    assert stats.num_preemptions_swapped == stats.num_preemptions > 0
    recomputed, stats = run(13, 0.0)
    assert stats.num_preemptions > 0
    assert stats.num_preemptions_swapped == 0
    assert swapped == alone
    assert recomputed == alone
