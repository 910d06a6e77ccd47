"""Triton KV write and paged attention against the torch backend, under TRITON_INTERPRET on CPU.

Tolerance: float32 max |difference| 1e-4 (the interpreter's dot is exact float32 math); float16
2e-3. Outputs are poisoned with NaN first, so an unwritten element fails.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

pytest.importorskip("triton")

from kvfleet.engine.attention import metadata as attention_metadata
from kvfleet.engine.attention import (
    torch_backend,
    triton_attention,
    triton_decode,
    triton_prompt,
    triton_tiles,
)
from kvfleet.engine.attention.metadata import SPLIT_DECODES_MIN_KV_TOKENS, decodes_to_split
from kvfleet.engine.attention.torch_backend import TorchAttention
from kvfleet.engine.layers.linear import SplitRows
from kvfleet.engine.layers.triton_gemv import gemv

CASES = {
    "decode-only": ([1, 1, 1], [5, 40, 77]),
    "prefill-with-prefix": ([20, 7], [20, 45]),
    "mixed": ([1, 33, 1, 70], [90, 33, 17, 100]),
}


def test_a_head_major_block_holds_each_head_together(block_layout: str) -> None:
    """Head-major, a token's K at (block, slot, head, dim) sits at [block][head][slot][dim] of
    the K half's bytes and its V at [block][head][dim][slot] of the V half's (token-major, both
    at [block][slot][head][dim]); an FP8 cache is head-major, a bf16 one is not; the Triton
    write stores what the torch one does."""
    gen = torch.Generator().manual_seed(4)
    k, v = torch.randn(2, 3, 2, 32, generator=gen)
    slots = torch.tensor([5, 16 * 2 + 15, 16 * 3])
    cache = torch.zeros(2, 5, 16, 2, 32)
    torch_backend.write_kv_cache(k, v, cache, slots)
    blocks, offsets = slots // 16, slots % 16
    if block_layout == "head-major":
        stored_k = cache[0].reshape(5, 2, 16, 32)[blocks, :, offsets]
        stored_v = cache[1].reshape(5, 2, 32, 16)[blocks, :, :, offsets]
    else:
        stored_k, stored_v = cache[0][blocks, offsets], cache[1][blocks, offsets]
    assert torch.equal(stored_k, k)
    assert torch.equal(stored_v, v)
    written = torch.zeros_like(cache)
    triton_attention.write_kv_cache(k, v, written, slots)
    assert torch.equal(written, cache)


def test_an_fp8_cache_holds_its_blocks_head_major() -> None:
    for dtype, head_major in ((torch.float8_e4m3fn, True), (torch.bfloat16, False)):
        keys, values = attention_metadata.cache_views(torch.zeros(2, 3, 16, 2, 32, dtype=dtype))
        assert keys.shape == values.shape == (3, 16, 2, 32)
        assert keys.stride() == ((1024, 32, 512, 1) if head_major else (1024, 64, 32, 1))
        assert values.stride() == ((1024, 1, 512, 16) if head_major else (1024, 64, 32, 1))


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-4), (torch.float16, 2e-3)])
def test_write_and_attend_match_torch(
    attention_case: Callable[..., dict[str, Any]],
    block_layout: str,
    case: str,
    dtype: torch.dtype,
    tolerance: float,
) -> None:
    query_lens, seq_lens = CASES[case]
    inputs = attention_case(query_lens, seq_lens, dtype=dtype, seed=list(CASES).index(case))
    reference = TorchAttention(4, 2, 32)
    cache_ref = inputs["kv_cache"].clone()
    expected = reference.forward(
        inputs["q"], inputs["k"], inputs["v"], cache_ref, inputs["metadata"]
    )

    cache = inputs["kv_cache"].clone()
    triton_attention.write_kv_cache(
        inputs["k"], inputs["v"], cache, inputs["metadata"].slot_mapping
    )
    assert torch.equal(cache, cache_ref)
    out = torch.full_like(inputs["q"], float("nan"))
    triton_prompt.paged_attention(inputs["q"], cache, inputs["metadata"], reference.scale, out=out)
    assert not out.isnan().any()
    assert (out.float() - expected.float()).abs().max() < tolerance


@pytest.mark.parametrize("kind", ["few", "chunks", "long"])
@pytest.mark.parametrize("sliding_window", [None, 40])
def test_prompt_tiles_of_every_kind_match_torch(
    attention_case: Callable[..., dict[str, Any]],
    block_layout: str,
    monkeypatch: pytest.MonkeyPatch,
    kind: str,
    sliding_window: int | None,
) -> None:
    """Each kind's tile (128 x 128 for long KV, made long here by lowering the threshold;
    "few": no query past 64 tokens), over prompts whose blocks lie below, across and beyond
    the causal diagonal (the tiles below it run unmasked), with and without a window."""
    if kind == "long":
        monkeypatch.setattr(triton_prompt, "LONG_KV_TOKENS", 64)
    query_lens = [1, 64, 37, 20] if kind == "few" else [1, 200, 37, 150]
    inputs = attention_case(query_lens, [90, 200, 300, 260], seed=5)
    assert triton_prompt.prompt_step_kind(inputs["metadata"]) == kind
    reference = TorchAttention(4, 2, 32, sliding_window=sliding_window)
    cache = inputs["kv_cache"].clone()
    expected = reference.forward(inputs["q"], inputs["k"], inputs["v"], cache, inputs["metadata"])
    out = torch.full_like(inputs["q"], float("nan"))
    triton_prompt.paged_attention(
        inputs["q"], cache, inputs["metadata"], reference.scale, sliding_window, out=out
    )
    assert not out.isnan().any()
    assert (out - expected).abs().max() < 1e-4


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("kind", ["short", "long"])
def test_heads_of_256_take_fewer_tokens_a_tile_and_match_torch(
    attention_case: Callable[..., dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
    kind: str,
    fp8: bool,
) -> None:
    """Gemma's heads of 256: a K or V tile holds at most KV_TILE_VALUES values, so the 128 x
    128 prompt tiles and the FP8 decode tile take 64 tokens (128 x 128 FP8 prompt tiles asked
    the H100 for more shared memory than it has); the prompt and decode kernels at those tiles
    match the torch backend reading the same cache (float32 or e4m3)."""
    assert triton_tiles.kv_tile_tokens(128, 128) == 128
    assert triton_tiles.kv_tile_tokens(128, 256) == 64
    assert triton_tiles.kv_tile_tokens(64, 256) == 64
    if kind == "long":
        monkeypatch.setattr(triton_prompt, "LONG_KV_TOKENS", 64)
        assert triton_prompt.prompt_tile(torch.float16, fp8, "long", 256)[:2] == (128, 64)
    query_lens = [1, 1, 1] if kind == "short" else [1, 150, 37]
    inputs = attention_case(query_lens, [90, 200, 150], num_heads=2, num_kv_heads=1,
                            head_dim=256, seed=7)  # fmt: skip
    metadata = inputs["metadata"]
    assert triton_prompt.prompt_step_kind(metadata) == kind
    scales = torch.tensor([0.01, 0.01]) if fp8 else None
    cache = inputs["kv_cache"]
    if scales is not None:  # (the prefix stored as an FP8 cache stores it)
        cache = (cache / 0.01).clamp(-448, 448).to(torch.float8_e4m3fn)
    reference = TorchAttention(2, 1, 256)
    # (the step's keys and values written by the torch backend, which the kernels then read)
    expected = reference.forward(inputs["q"], inputs["k"], inputs["v"], cache, metadata, scales)
    kernels = [triton_prompt.paged_attention]
    if kind == "short":
        kernels.append(triton_decode.decode_attention)
    for kernel in kernels:
        out = torch.full_like(inputs["q"], float("nan"))
        kernel(inputs["q"], cache, metadata, reference.scale, out=out, kv_scales=scales)
        assert not out.isnan().any()
        assert (out - expected).abs().max() < 1e-4, kernel.__name__


@pytest.mark.parametrize("num_splits", [2, 3, 8])
@pytest.mark.parametrize("sliding_window", [None, 100])
def test_prompt_kernel_split_over_the_keys_matches_torch(
    attention_case: Callable[..., dict[str, Any]],
    block_layout: str,
    monkeypatch: pytest.MonkeyPatch,
    num_splits: int,
    sliding_window: int | None,
) -> None:
    """A step with few query blocks over a long KV (a prefix hit's new tokens, a decode row,
    a short prompt) splits the keys across programs and merges them: every split count,
    with and without a window; with `first_seq`, the rows before it are left alone."""
    monkeypatch.setattr(triton_prompt, "key_splits", lambda *_: num_splits)
    inputs = attention_case([1, 5, 40, 3], [300, 700, 40, 260], seed=9)
    reference = TorchAttention(4, 2, 32, sliding_window=sliding_window)
    cache = inputs["kv_cache"].clone()
    expected = reference.forward(inputs["q"], inputs["k"], inputs["v"], cache, inputs["metadata"])
    for first_seq in (0, 1):
        out = torch.full_like(inputs["q"], float("nan"))
        triton_prompt.paged_attention(
            inputs["q"], cache, inputs["metadata"], reference.scale, sliding_window, out=out,
            first_seq=first_seq,
        )  # fmt: skip
        assert out[:first_seq].isnan().all()
        assert (out[first_seq:] - expected[first_seq:]).abs().max() < 1e-4


@pytest.mark.parametrize(("sms", "expected"), [(4, [4, 1, 1, 1]), (64, [5, 8, 3, 1])])
def test_prompt_kernel_splits_the_keys_to_fill_idle_sms_past_few_queries(
    attention_case: Callable[..., dict[str, Any]],
    block_layout: str,
    monkeypatch: pytest.MonkeyPatch,
    sms: int,
    expected: list[int],
) -> None:
    """Few new tokens over a long KV (a prefix hit) split the keys until every SM has four
    programs; longer queries only where their programs would leave half the SMs idle, until
    each has one (two splits of a lone 1,024-token prompt took 90 us a layer on an H200, one
    51), at most a split per 128 keys; the output is attention's, split or not."""
    monkeypatch.setattr(triton_prompt, "num_sms", lambda _: sms)
    monkeypatch.setattr(triton_decode, "num_sms", lambda _: sms)
    chosen: list[int] = []
    plan = triton_prompt.key_splits
    monkeypatch.setattr(
        triton_prompt, "key_splits", lambda *args: chosen.append(plan(*args)) or chosen[-1]
    )
    reference = TorchAttention(4, 2, 32)
    # 8 new tokens after 592: one block of queries, 4 heads: 4 programs; 100 after 1,100: two
    # blocks of 64, 8 programs; a fresh 300: 20 programs; a fresh 600: 40, half of 64 SMs busy.
    for query_lens, seq_lens in (([8], [600]), ([100], [1200]), ([300], [300]), ([600], [600])):
        inputs = attention_case(query_lens, seq_lens, seed=3)
        cache = inputs["kv_cache"].clone()
        reference_out = reference.forward(
            inputs["q"], inputs["k"], inputs["v"], cache, inputs["metadata"]
        )
        out = triton_prompt.paged_attention(inputs["q"], cache, inputs["metadata"], reference.scale)
        assert (out - reference_out).abs().max() < 1e-4
    assert chosen == expected


def test_sliding_window(attention_case: Callable[..., dict[str, Any]], block_layout: str) -> None:
    inputs = attention_case([1, 30], [70, 50], seed=7)
    reference = TorchAttention(4, 2, 32, sliding_window=24)
    cache = inputs["kv_cache"].clone()
    expected = reference.forward(inputs["q"], inputs["k"], inputs["v"], cache, inputs["metadata"])
    out = triton_attention.TritonAttention(4, 2, 32, sliding_window=24).forward(
        inputs["q"], inputs["k"], inputs["v"], inputs["kv_cache"], inputs["metadata"]
    )
    assert (out - expected).abs().max() < 1e-4


@pytest.mark.parametrize("num_splits", [1, 3, 8])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 2), (6, 1), (2, 2)])
def test_decode_kernel_matches_torch(
    attention_case: Callable[..., dict[str, Any]],
    block_layout: str,
    num_splits: int,
    num_heads: int,
    num_kv_heads: int,
) -> None:
    # Lengths around the split and block edges; one sequence far longer than the others.
    seq_lens = [1, 17, 64, 129, 300, 700]
    inputs = attention_case(
        [1] * len(seq_lens), seq_lens, num_heads=num_heads, num_kv_heads=num_kv_heads, seed=11
    )
    reference = TorchAttention(num_heads, num_kv_heads, 32)
    cache = inputs["kv_cache"].clone()
    expected = reference.forward(inputs["q"], inputs["k"], inputs["v"], cache, inputs["metadata"])
    out = torch.full_like(inputs["q"], float("nan"))
    triton_decode.decode_attention(
        inputs["q"], cache, inputs["metadata"], reference.scale, out=out, num_splits=num_splits
    )
    assert not out.isnan().any()
    assert (out - expected).abs().max() < 1e-4


def test_a_mixed_steps_decodes_split_as_a_launch_before_them(
    attention_case: Callable[..., dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
    kernel_launches: Callable[..., list[tuple[tuple[int, ...], dict[str, Any]]]],
) -> None:
    """A mixed step's decodes take a split count the decode kernel was launched with before
    (a decode graph's at startup), the largest up to their own plan, else the smallest, and
    that launch's PRELOAD; a count or flag of their own would compile a new variant
    mid-serving. Their output is the reference's."""
    monkeypatch.setattr(triton_decode, "_LAUNCHED_SPLITS", {})
    planned = iter([5, 7, 3])
    monkeypatch.setattr(triton_decode, "num_splits_for", lambda *args: next(planned))
    launches = kernel_launches(triton_decode, "_DECODE_PARTIAL")
    # (the first launch preloads; the others' own rule would not)
    monkeypatch.setattr(triton_decode, "num_sms", lambda device: 1 if launches else 1 << 10)
    layer = triton_attention.TritonAttention(4, 2, 32)
    reference = TorchAttention(4, 2, 32)
    for query_lens, seq_lens in (([1, 1], [300, 500]), ([1, 1, 30], [300, 500, 50]),
                                 ([1, 1, 30], [300, 500, 50])):  # fmt: skip
        inputs = attention_case(query_lens, seq_lens, num_heads=4, num_kv_heads=2, seed=5)
        cache = inputs["kv_cache"].clone()
        args = (inputs["q"], inputs["k"], inputs["v"])
        expected = reference.forward(*args, cache, inputs["metadata"])
        out = layer.forward(*args, inputs["kv_cache"], inputs["metadata"])
        assert (out - expected).abs().max() < 1e-4
    # (planned 5 alone; 7 and 3 in mixed steps)
    assert [grid[2] for grid, _ in launches] == [5, 5, 5]
    assert [kwargs["PRELOAD"] for _, kwargs in launches] == [True, True, True]


@pytest.mark.parametrize("sliding_window", [None, 150])
@pytest.mark.parametrize("fused_merge", [True, False])
def test_the_splits_merge_in_the_kernel_or_after_it_alike(
    attention_case: Callable[..., dict[str, Any]],
    block_layout: str,
    monkeypatch: pytest.MonkeyPatch,
    fused_merge: bool,
    sliding_window: int | None,
) -> None:
    """The last split of each sequence's KV head merges its heads (FUSED_MERGE) or the merge
    kernel does, to the same result; launched twice, the fused way finds its counters reset
    (a stale count would leave rows unmerged: NaN). Of the 5 splits (64 keys at least) 1, 3,
    5 and 4 hold keys, in a window of 150 at most 3: only those count and merge, one alone
    writes the output itself."""
    monkeypatch.setattr(triton_decode, "FUSED_MERGE", fused_merge)
    seq_lens = [1, 129, 300, 700]
    inputs = attention_case([1] * 4, seq_lens, num_heads=4, num_kv_heads=2, seed=13)
    reference = TorchAttention(4, 2, 32, sliding_window=sliding_window)
    cache = inputs["kv_cache"].clone()
    expected = reference.forward(inputs["q"], inputs["k"], inputs["v"], cache, inputs["metadata"])
    for _ in range(2):
        out = torch.full_like(inputs["q"], float("nan"))
        triton_decode.decode_attention(
            inputs["q"], cache, inputs["metadata"], reference.scale, sliding_window, out=out,
            num_splits=5,
        )  # fmt: skip
        assert not out.isnan().any()
        assert (out - expected).abs().max() < 1e-4
    if fused_merge:
        assert not triton_decode.split_counters(out.device, 8)[:8].any()


@pytest.mark.parametrize("sliding_window", [None, 150])
@pytest.mark.parametrize("eager", [False, True])
def test_splits_left_unmerged_are_merged_by_the_gemv_as_the_kernel_merges_them(
    attention_case: Callable[..., dict[str, Any]],
    block_layout: str,
    sliding_window: int | None,
    eager: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One sequence's decode leaving up to 4 splits holding keys unmerged (`SplitRows`): the
    one-row GEMV merging them as it reads them multiplies the kernel's merged output, and with
    an identity weight gives it back; one split holding keys, the same bits. Past 4 the kernel
    merges into the first row (8 splits: 1, 2, 4 and 6 hold keys at these lengths, at most 3
    in a window of 150), run after and before shorter ones (stale rows must not count, also
    read with the others: `eager`, the GEMV's SPLITS_EAGER)."""
    from kvfleet.engine.layers import triton_gemv

    monkeypatch.setattr(triton_gemv, "SPLITS_EAGER", eager)
    k = 4 * 32
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(48, k, generator=gen)
    for seq_len in (700, 60, 100, 250, 700, 100):
        inputs = attention_case([1], [seq_len], num_heads=4, num_kv_heads=2, seed=seq_len)
        reference = TorchAttention(4, 2, 32, sliding_window=sliding_window)
        cache = inputs["kv_cache"].clone()
        args = (inputs["q"], cache, inputs["metadata"], reference.scale, sliding_window)
        expected = triton_decode.decode_attention(*args, num_splits=8).view(1, k)
        left = triton_decode.decode_leaving_splits(*args, None, 8, None, None, 4)
        assert isinstance(left, SplitRows)
        assert left.parts.shape == (4, k)
        dead = (left.lse[:, :4] == float("-inf")).all(dim=0)
        left.parts[dead] = float("nan")  # (a split holding no keys: its row never used)
        merged = gemv(left, torch.eye(k))
        if seq_len <= 64 or (sliding_window is None and seq_len > 250):
            assert torch.equal(merged, expected)  # (one split's row, or the kernel's merge)
        assert (merged - expected).abs().max() < 1e-5
        product = gemv(left, weight)
        assert (product - gemv(expected, weight)).abs().max() < 1e-4
        in_tiles = gemv(left, weight, tiles=(16, 32, 4, 1))  # (a head a tile, four tiles)
        assert (in_tiles - product).abs().max() < 1e-5


@pytest.mark.parametrize("num_splits", [1, 3])
def test_a_splits_first_tile_loaded_before_the_wait_gives_the_same_output(
    attention_case: Callable[..., dict[str, Any]],
    block_layout: str,
    monkeypatch: pytest.MonkeyPatch,
    kernel_launches: Callable[..., list[tuple[tuple[int, ...], dict[str, Any]]]],
    num_splits: int,
) -> None:
    """A decode step of few programs (PRELOAD: the first tile's earlier tokens loaded before
    the wait for the kernel before, this step's token after) gives, bit for bit, the output of
    every tile loaded after the wait, and the reference's: this step's token in the first tile
    or a later one, alone, windowed or not. Not with V token-minor (head-major blocks), nor
    past PRELOAD_PROGRAMS_PER_SM programs an SM."""
    launches = kernel_launches(triton_decode, "_DECODE_PARTIAL")
    monkeypatch.setattr(triton_decode, "num_sms", lambda device: 1 << 10)
    seq_lens = [1, 5, 64, 65, 300]
    inputs = attention_case([1] * 5, seq_lens, num_heads=4, num_kv_heads=2, seed=21)
    for window in (None, 48):
        reference = TorchAttention(4, 2, 32, sliding_window=window)
        cache = inputs["kv_cache"].clone()
        expected = reference.forward(
            inputs["q"], inputs["k"], inputs["v"], cache, inputs["metadata"]
        )
        outs = []
        for preload in (True, False):
            monkeypatch.setattr(triton_decode, "PRELOAD_FIRST_TILE", preload)
            out = torch.full_like(inputs["q"], float("nan"))
            triton_decode.decode_attention(
                inputs["q"], cache, inputs["metadata"], reference.scale, window, out, num_splits
            )
            outs.append(out)
        assert torch.equal(outs[0], outs[1])
        assert (outs[0] - expected).abs().max() < 1e-4
    preloads = [kwargs["PRELOAD"] for _, kwargs in launches]
    assert preloads == [block_layout != "head-major", False] * 2
    monkeypatch.setattr(triton_decode, "PRELOAD_FIRST_TILE", True)
    # (5 x 2 programs, unsplit: two an SM on 5 SMs, more on 4)
    for sms, preloaded in ((5, block_layout != "head-major"), (4, False)):
        monkeypatch.setattr(triton_decode, "num_sms", lambda device, sms=sms: sms)
        triton_decode.decode_attention(
            inputs["q"], cache, inputs["metadata"], reference.scale, num_splits=1
        )
        assert launches[-1][1]["PRELOAD"] is preloaded


def test_decode_kernel_sliding_window_and_float16(
    attention_case: Callable[..., dict[str, Any]],
    block_layout: str,
) -> None:
    seq_lens = [10, 90, 400]
    inputs = attention_case([1] * 3, seq_lens, dtype=torch.float16, seed=12)
    reference = TorchAttention(4, 2, 32, sliding_window=48)
    cache = inputs["kv_cache"].clone()
    expected = reference.forward(inputs["q"], inputs["k"], inputs["v"], cache, inputs["metadata"])
    for num_splits in (1, 4):
        out = torch.full_like(inputs["q"], float("nan"))
        triton_decode.decode_attention(
            inputs["q"], cache, inputs["metadata"], reference.scale, 48, out, num_splits
        )
        assert (out.float() - expected.float()).abs().max() < 2e-3


@pytest.fixture
def decode_rows(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The rows of each call of the backend's decode kernel, recorded as they come."""
    rows: list[int] = []
    real = triton_attention.decode_attention

    def spy(q: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        rows.append(q.shape[0])
        return real(q, *args, **kwargs)

    monkeypatch.setattr(triton_attention, "decode_attention", spy)
    return rows


def test_backend_sends_decode_steps_to_the_decode_kernel(
    attention_case: Callable[..., dict[str, Any]], decode_rows: list[int]
) -> None:
    """A decode-only step's rows all go to the decode kernel; of a mixed step, the leading
    decodes only (the one after a prompt chunk stays in the varlen kernel)."""
    backend = triton_attention.TritonAttention(4, 2, 32)
    for case in ("decode-only", "mixed", "prefill-with-prefix"):
        inputs = attention_case(*CASES[case])
        backend.forward(
            inputs["q"], inputs["k"], inputs["v"], inputs["kv_cache"], inputs["metadata"]
        )
    assert decode_rows == [3, 1]


def test_a_mixed_step_splits_off_its_leading_decodes_when_their_kv_pays_for_it() -> None:
    least = SPLIT_DECODES_MIN_KV_TOKENS
    assert decodes_to_split([1, 1, 30], [least // 2, least - least // 2, 30]) == 2
    assert decodes_to_split([1, 1, 30], [least // 2, least - least // 2 - 1, 30]) == 0
    assert decodes_to_split([30, 1, 1], [30, least, least]) == 0  # (not in front)
    assert decodes_to_split([1, 7, 1], [least, 30, least]) == 1


@pytest.mark.parametrize("softcap", [None, 2.0])
def test_mixed_step_sends_its_decode_rows_to_the_decode_kernel(
    attention_case: Callable[..., dict[str, Any]], decode_rows: list[int], softcap: float | None
) -> None:
    """A mixed step whose first sequences are decodes (as the runner orders them): those rows
    go to the decode kernel, the prompt chunks to the varlen one from the first chunk on, and
    together they give the torch backend's output, every row written."""
    inputs = attention_case([1, 1, 1, 33, 70, 1], [100, 90, 17, 33, 100, 5], seed=23)
    metadata = inputs["metadata"]
    assert metadata.num_decodes == 3
    reference = TorchAttention(4, 2, 32, softcap=softcap)
    cache_ref = inputs["kv_cache"].clone()
    q = inputs["q"] * 4
    expected = reference.forward(q, inputs["k"], inputs["v"], cache_ref, metadata)
    backend = triton_attention.TritonAttention(4, 2, 32, softcap=softcap)
    out = backend.forward(q, inputs["k"], inputs["v"], inputs["kv_cache"].clone(), metadata)
    assert decode_rows == [3]
    assert not out.isnan().any()
    assert (out - expected).abs().max() < 1e-4


def test_a_mixed_step_reads_q_in_place_from_the_fused_qkv_output(
    attention_case: Callable[..., dict[str, Any]],
) -> None:
    """q as the model hands it over (a strided view of the fused QKV projection's output, K and
    V's columns poisoned with NaN) gives the same bits as a contiguous q, in a contiguous
    output, through both kernels of a mixed step."""
    inputs = attention_case([1, 1, 33, 70], [100, 17, 33, 100], seed=29)
    q = inputs["q"]
    tokens, width = q.shape[0], q.shape[1] * q.shape[2]
    fused = torch.full((tokens, width + 2 * 2 * 32), float("nan"), dtype=q.dtype)
    fused[:, :width] = q.reshape(tokens, width)
    q_view = fused[:, :width].view_as(q)
    assert not q_view.is_contiguous()
    backend = triton_attention.TritonAttention(4, 2, 32)
    expected = backend.forward(q, inputs["k"], inputs["v"], inputs["kv_cache"].clone(),
                               inputs["metadata"])  # fmt: skip
    out = backend.forward(q_view, inputs["k"], inputs["v"], inputs["kv_cache"].clone(),
                          inputs["metadata"])  # fmt: skip
    assert out.is_contiguous()
    assert torch.equal(out, expected)


def test_soft_capped_scores_and_another_scale_match_torch(
    attention_case: Callable[..., dict[str, Any]],
) -> None:
    """Gemma 2's attention: scores scaled by query_pre_attn_scalar^-0.5 (not head_dim^-0.5)
    and soft-capped, in the prompt kernel (a chunk over a cached prefix) and the decode
    kernel (one and four splits), windowed and not; q made large so the cap bites."""
    for window in (None, 24):
        reference = TorchAttention(4, 2, 32, sliding_window=window, scale=0.3, softcap=2.0)
        inputs = attention_case([9, 1, 1], [40, 70, 7], seed=21)
        q = inputs["q"] * 4
        cache = inputs["kv_cache"].clone()
        expected = reference.forward(q, inputs["k"], inputs["v"], cache, inputs["metadata"])
        uncapped = TorchAttention(4, 2, 32, sliding_window=window, scale=0.3)
        plain = uncapped.forward(q, inputs["k"], inputs["v"], cache.clone(), inputs["metadata"])
        assert (plain - expected).abs().max() > 1e-2  # the cap changes the output
        out = triton_prompt.paged_attention(q, cache, inputs["metadata"], 0.3, window, softcap=2.0)
        assert (out - expected).abs().max() < 1e-4
        decodes = attention_case([1] * 3, [10, 90, 400], seed=22)
        q = decodes["q"] * 4
        cache = decodes["kv_cache"].clone()
        expected = reference.forward(q, decodes["k"], decodes["v"], cache, decodes["metadata"])
        for num_splits in (1, 4):
            out = triton_decode.decode_attention(
                q, cache, decodes["metadata"], 0.3, window, None, num_splits, softcap=2.0
            )
            assert (out - expected).abs().max() < 1e-4


def test_the_decode_kernel_splits_only_what_leaves_the_multiprocessors_short() -> None:
    """Splits fill the device (4 programs an SM) for few (sequence, KV head) programs and long
    KV; from 3 programs an SM, or at most 64 KV tokens (a tile), one program each is the plan."""
    cpu = torch.device("cpu")  # the interpreter's device: 4 SMs
    assert triton_decode.num_splits_for(1, 2, 4096, cpu) == 8
    assert triton_decode.num_splits_for(5, 2, 4096, cpu) == 2
    assert triton_decode.num_splits_for(6, 2, 4096, cpu) == 1
    assert triton_decode.num_splits_for(1, 2, 64, cpu) == 1
    assert triton_decode.num_splits_for(1, 2, 65, cpu) == 2
