"""Speculative decoding on CUDA (Triton attention, decode graphs, the vocabulary race between
drafted steps): greedy output with drafts, from either proposer, is the output without them, and
so is seeded sampling's."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from kvfleet.engine.llm import LLM  # noqa: E402
from kvfleet.engine.sampling_params import SamplingParams  # noqa: E402

DOC = (
    "A paged KV cache stores the keys and values of every token in fixed-size blocks, so a "
    "sequence's cache need not be contiguous. A block table maps each sequence's logical "
    "blocks to physical ones."
)
MESSAGES = [
    f"Repeat the following text exactly:\n\n{DOC}",
    f"Summarize this in one sentence:\n\n{DOC}",
    "Count from one to thirty.",
    "Write a haiku about the sea.",
]
SPECULATIVE = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False},
    "draft": {
        "method": "draft",
        "model": "smollm2",
        "num_speculative_tokens": 4,
        "adaptive": False,
    },
}


def outputs(llm: LLM, params: SamplingParams) -> list[Any]:
    done = [llm.chat([{"role": "user", "content": m}], params)[0] for m in MESSAGES]
    done += llm.chat([[{"role": "user", "content": m}] for m in MESSAGES], params)  # batched
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in done]


@pytest.mark.parametrize("method", sorted(SPECULATIVE))
def test_greedy_output_with_drafts_on_cuda(method: str, smollm2: Path) -> None:
    params = SamplingParams(temperature=0, max_tokens=96)
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=64)
    plain = LLM("smollm2", device="cuda", dtype="float32", gpu_memory_utilization=0.3)
    want = outputs(plain, params)
    want_seeded = outputs(plain, seeded)
    plain.engine.close()
    del plain
    gc.collect()  # (its KV cache freed before the next engine sizes its own)
    torch.cuda.empty_cache()
    llm = LLM(
        "smollm2",
        device="cuda",
        dtype="float32",
        gpu_memory_utilization=0.3,
        speculative_config=SPECULATIVE[method],
    )
    graphs = llm.engine.runner.decode_graphs
    assert graphs is not None
    assert graphs.max_query_len == 5
    query_lens: list[int] = []  # of the steps replayed from graphs
    run = graphs.run

    def counted(*args: Any, **kwargs: Any) -> Any:
        query_lens.append(args[2].max_seqlen_q)
        return run(*args, **kwargs)

    graphs.run = counted  # type: ignore[method-assign]
    assert outputs(llm, params) == want
    assert any(q > 1 for q in query_lens)  # verification steps ran from graphs
    stats = llm.engine.scheduler.spec_decode_stats
    assert stats.num_accepted_tokens > 0
    assert outputs(llm, seeded) == want_seeded  # (coupled: each position's own draw)
