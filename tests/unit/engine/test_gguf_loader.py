"""GGUF loading: all tested quant types, name mapping and the Q/K un-permutation, against
transformers' own GGUF loader on a small random model written here."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter
from gguf.quants import quantize

from kvfleet.engine.llm import LLM
from kvfleet.engine.loader.gguf import gguf_to_hf_name, read_gguf_config, reverse_permute_qk
from kvfleet.engine.sampling_params import SamplingParams

HIDDEN, INTER, HEADS, KV_HEADS, LAYERS, VOCAB = 256, 512, 4, 2, 2, 320
# Each of the eight tested types appears in every layer, in a different place per layer.
LAYER_TYPES = [Q.Q4_K, Q.Q6_K, Q.Q4_0, Q.Q4_1, Q.F16, Q.BF16, Q.Q8_0]
LAYER_TENSORS = ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"]


def raw_k_quant(rows: int, cols: int, kind: Q, rng: np.random.Generator) -> np.ndarray:
    """Random Q4_K / Q6_K blocks (gguf cannot quantize to them) with small, finite scales."""
    block_bytes = {Q.Q4_K: 144, Q.Q6_K: 210}[kind]
    blocks = rng.integers(0, 256, size=(rows, cols // 256, block_bytes), dtype=np.uint8)
    if kind == Q.Q4_K:  # d and dmin lead the block
        blocks[..., 0:2] = np.frombuffer(np.float16(0.004).tobytes(), np.uint8)
        blocks[..., 2:4] = np.frombuffer(np.float16(0.002).tobytes(), np.uint8)
    else:  # d ends the block
        blocks[..., 208:210] = np.frombuffer(np.float16(0.0005).tobytes(), np.uint8)
    return blocks.reshape(rows, -1)


def encode(weights: np.ndarray, kind: Q, rng: np.random.Generator) -> np.ndarray:
    if kind in (Q.Q4_K, Q.Q6_K):
        return raw_k_quant(*weights.shape, kind, rng)
    if kind == Q.F32:
        return weights
    if kind == Q.F16:
        return weights.astype(np.float16)
    return quantize(weights, kind)


# (768: transformers' GGUF reader takes Qwen3-MoE's default, not expert_feed_forward_length)
EXPERTS, EXPERT_INTER = 4, 768


def write_model(path: Path, tied: bool, arch: str = "llama") -> None:
    """A random model of `arch` (llama, or qwen3: with its per-head q and k norms, and heads of
    128, transformers' Qwen3 default: its GGUF reader does not take the head size from the
    file; qwen3moe: that, with four experts per layer, top 2, in llama.cpp's stacked
    tensors)."""
    heads, kv_heads = (HEADS, KV_HEADS) if arch == "llama" else (HIDDEN // 128, 1)
    rng = np.random.default_rng(0)
    writer = GGUFWriter(path, arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTER)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(VOCAB)
    writer.add_rope_dimension_count(HIDDEN // heads)
    if arch in ("qwen3", "qwen3moe"):
        writer.add_key_length(HIDDEN // heads)
        writer.add_value_length(HIDDEN // heads)
    if arch == "qwen3moe":
        writer.add_expert_count(EXPERTS)
        writer.add_expert_used_count(2)
        writer.add_expert_feed_forward_length(EXPERT_INTER)

    def add(name: str, shape: tuple[int, ...], kind: Q, scale: float = 0.05) -> None:
        weights = (rng.standard_normal(shape) * scale).astype(np.float32)
        writer.add_tensor(name, encode(weights, kind, rng), raw_dtype=kind)

    add("token_embd.weight", (VOCAB, HIDDEN), Q.Q8_0, 1.0)
    kv = kv_heads * HIDDEN // heads
    shapes = {
        "attn_q": (HIDDEN, HIDDEN),
        "attn_k": (kv, HIDDEN),
        "attn_v": (kv, HIDDEN),
        "attn_output": (HIDDEN, HIDDEN),
        "ffn_gate": (INTER, HIDDEN),
        "ffn_up": (INTER, HIDDEN),
        "ffn_down": (HIDDEN, INTER),
    }
    for layer in range(LAYERS):
        for i, tensor in enumerate(LAYER_TENSORS):
            kind = LAYER_TYPES[(i + 3 * layer) % len(LAYER_TYPES)]
            if arch == "qwen3moe" and tensor.startswith("ffn_"):
                rows, inputs = shapes[tensor]
                rows, inputs = (EXPERT_INTER, HIDDEN) if rows == INTER else (HIDDEN, EXPERT_INTER)
                kind = [Q.Q8_0, Q.Q4_0, Q.F16][i % 3]
                add(f"blk.{layer}.{tensor}_exps.weight", (EXPERTS, rows, inputs), kind, 0.1)
                continue
            add(f"blk.{layer}.{tensor}.weight", shapes[tensor], kind)
        if arch == "qwen3moe":
            add(f"blk.{layer}.ffn_gate_inp.weight", (EXPERTS, HIDDEN), Q.F32, 0.2)
        writer.add_tensor(
            f"blk.{layer}.attn_norm.weight",
            1 + 0.1 * rng.standard_normal(HIDDEN).astype(np.float32),
        )
        writer.add_tensor(
            f"blk.{layer}.ffn_norm.weight", 1 + 0.1 * rng.standard_normal(HIDDEN).astype(np.float32)
        )
        if arch in ("qwen3", "qwen3moe"):
            for name in ("attn_q_norm", "attn_k_norm"):
                norm = 1 + 0.3 * rng.standard_normal(HIDDEN // heads).astype(np.float32)
                writer.add_tensor(f"blk.{layer}.{name}.weight", norm)
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    if not tied:
        add("output.weight", (VOCAB, HIDDEN), Q.Q6_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize(
    ("tied", "arch"), [(False, "llama"), (True, "llama"), (False, "qwen3"), (False, "qwen3moe")],
    ids=["untied", "tied", "qwen3", "qwen3moe"],
)  # fmt: skip
def test_quantized_gguf_matches_transformers(
    tmp_path: Path, tied: bool, arch: str, logprob_gap: Callable[..., float]
) -> None:
    from transformers import AutoModelForCausalLM

    path = tmp_path / "tiny.gguf"
    write_model(path, tied, arch)
    config = read_gguf_config(path)
    assert (config.hidden_size, config.num_key_value_heads, config.tie_word_embeddings) == (
        HIDDEN,
        KV_HEADS if arch == "llama" else 1,
        tied,
    )
    assert config.qk_norm == (arch != "llama")
    assert config.moe_layers == (tuple(range(LAYERS)) if arch == "qwen3moe" else ())

    prompt = [5 + (11 * i) % 300 for i in range(40)]
    llm = LLM(
        str(path),
        dtype="float32",
        skip_tokenizer_init=True,
        num_blocks=64,
        max_num_batched_tokens=16,
        block_size=8,
    )
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=5, ignore_eos=True)
    (output,) = llm.generate(prompt, params)
    completion = output.outputs[0]

    hf = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32)
    with torch.no_grad():
        largest_logit = float(hf(torch.tensor([prompt])).logits.abs().max())
    assert logprob_gap(hf, prompt, completion) < float32_bound(largest_logit)


def float32_bound(largest_logit: float) -> float:
    """How far two float32 runs of this model may differ in a logprob: rounding errors of a
    length-K sum grow as the unit roundoff (2^-24) times sqrt(K) (they are as likely up as
    down), so: 2^-24 x sqrt(INTER, the longest reduction) for each matmul on the way to a
    logit (two per layer and the LM head), at the logits' scale. Kernels that sum in another
    order (another CPU, another BLAS) stay within it; a dequantization error does not."""
    return 2**-24 * math.sqrt(INTER) * (2 * LAYERS + 1) * max(largest_logit, 1.0)


def test_reverse_permute_undoes_llama_cpp() -> None:
    weight = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)  # 2 heads of head_dim 4
    # llama.cpp's convert_hf_to_gguf permute, written out.
    permuted = weight.reshape(2, 2, 2, 3).swapaxes(1, 2).reshape(8, 3)
    assert np.array_equal(reverse_permute_qk(permuted, 2), weight)


def test_names_and_bad_files(tmp_path: Path) -> None:
    assert gguf_to_hf_name("blk.3.ffn_down.weight") == "model.layers.3.mlp.down_proj.weight"
    assert gguf_to_hf_name("blk.0.attn_q.bias") == "model.layers.0.self_attn.q_proj.bias"
    assert gguf_to_hf_name("output_norm.weight") == "model.norm.weight"
    with pytest.raises(ValueError, match=r"unknown GGUF tensor 'blk\.0\.ssm_x\.weight'"):
        gguf_to_hf_name("blk.0.ssm_x.weight")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        read_gguf_config(junk)


@pytest.mark.parametrize(
    ("kind", "bits"), [(Q.Q4_0, 4), (Q.Q4_1, 4), (Q.Q4_K, 4), (Q.Q8_0, 8), (Q.Q4_K, 8)]
)
def test_gguf_blocks_repack_into_the_packed_layout(kind: Q, bits: int) -> None:
    """Q4_0 / Q4_1 / Q4_K / Q8_0 rows read into kvfleet's packed layout (4-bit words, or 8-bit
    ones: a Q4 part of a fused layer with a Q8_0 part) dequantize to what gguf's own
    dequantizer gives (to float32 rounding: the zero is -m / d or dmin m / (d sc)), a
    constant Q4_1 block too (Q4_K: random super-blocks, gguf cannot write them); Q8_0 does not
    fit 4-bit words."""
    from gguf.quants import dequantize

    from kvfleet.engine.layers.quantization.packed import PackedWeights
    from kvfleet.engine.loader.gguf import gguf_to_packed

    rng = np.random.default_rng(1)
    weights = (rng.standard_normal((48, 256)) * 0.05).astype(np.float32)
    weights[3, 64:96] = 0.25  # (one block of equal values: Q4_1 stores d = 0)
    data = encode(weights, kind, rng)
    qweight, scales, zeros = gguf_to_packed(data, kind, bits)
    assert qweight.shape == (256 * bits // 32, 48)
    got = PackedWeights(qweight, scales, zeros, 32, bits=bits).dequantize()
    want = torch.from_numpy(dequantize(data, kind)).t()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    if kind == Q.Q8_0:
        with pytest.raises(ValueError, match="8-bit words"):
            gguf_to_packed(data, kind, 4)


def test_a_q4_gguf_keeps_its_projections_4_bit(tmp_path: Path) -> None:
    """The projections whose fused layer is all Q4_0 / Q4_1 / Q4_K load as 4-bit layers, those
    with a Q8_0 part (and the rest Q4 or Q8_0) as 8-bit ones (a fused layer with a part of
    another type is dequantized whole), and the model computes what the dequantized model
    computes (CPU, float32). `quantization="gguf"` asks for it; a file
    without Q4 layers, or another format, is refused; `quantization="rtn"` rounds every
    projection from the dequantized weights instead."""
    from kvfleet.engine.layers.quantization.packed import PackedLinear, quantize_rtn
    from kvfleet.engine.loader.gguf import gguf_packed_scheme
    from kvfleet.engine.loader.model_loader import load_model
    from kvfleet.engine.loader.source import ModelSource
    from kvfleet.engine.worker.setup import _attention_factory
    from tests.unit.engine.quantization.test_fp8_checkpoints import _logits

    global LAYER_TYPES  # noqa: PLW0603  (write_model reads it)
    saved = LAYER_TYPES
    # (layer l takes LAYER_TYPES[(i + 3 l) % 7] for q, k, v, o, gate, up, down: layer 0 q Q4_K,
    # k Q4_0 and v Q8_0 (so q, k, v 8-bit), o Q4_1, gate F16 and up Q4_0 (dequantized), down
    # Q4_K; layer 1 q Q4_1, k F16, v Q4_0 (dequantized), o Q4_K, gate Q4_K, up Q4_0, down Q8_0)
    LAYER_TYPES = [Q.Q4_K, Q.Q4_0, Q.Q8_0, Q.Q4_1, Q.F16, Q.Q4_0, Q.Q4_K]
    try:
        path = tmp_path / "q4.gguf"
        write_model(path, tied=False)
    finally:
        LAYER_TYPES = saved
    scheme = gguf_packed_scheme(path)
    assert scheme is not None
    assert scheme.describe() == (
        "int4 weight-only (gguf checkpoint; group 32; 4 projections 8-bit)"
    )
    source = ModelSource("gguf", path, "q4")
    config = source.read_config()

    def load(quantization: object) -> torch.nn.Module:
        return load_model(source, config, torch.float32, torch.device("cpu"),
                          _attention_factory("torch"), quantization=quantization)  # fmt: skip

    from kvfleet.engine.worker.setup import pick_quantization

    assert pick_quantization("gguf", source, config, torch.device("cpu")) == scheme
    assert pick_quantization(None, source, config, torch.device("cpu")) is None
    with pytest.raises(ValueError, match="not a GGUF file"):
        pick_quantization("gguf", ModelSource("hf", tmp_path, "t"), config, torch.device("cpu"))
    LAYER_TYPES = [Q.F16, Q.Q6_K] * 3 + [Q.F16]
    try:
        other = tmp_path / "f16.gguf"
        write_model(other, tied=True)
    finally:
        LAYER_TYPES = saved
    with pytest.raises(ValueError, match="no Q4_0 / Q4_1 / Q4_K / Q8_0 projection layers"):
        pick_quantization("gguf", ModelSource("gguf", other, "t"), config, torch.device("cpu"))
    ours, plain = load(scheme), load(None)
    packed = {n: m.bits for n, m in ours.named_modules() if isinstance(m, PackedLinear)}
    assert packed == {
        "layers.0.self_attn.qkv_proj": 8, "layers.0.self_attn.o_proj": 4,
        "layers.0.mlp.down_proj": 4, "layers.1.self_attn.o_proj": 4,
        "layers.1.mlp.gate_up_proj": 4, "layers.1.mlp.down_proj": 8,
    }  # fmt: skip
    got, want = _logits(ours, True), _logits(plain, True)
    assert (got - want).abs().max() < float32_bound(float(want.abs().max()))
    # 'rtn' rounds the dequantized weights, as it does any checkpoint's (the Q4 blocks are not
    # read as they are: that is 'gguf')
    rounded = load(pick_quantization("rtn", source, config, torch.device("cpu")))
    layers = {n: m for n, m in rounded.named_modules() if isinstance(m, PackedLinear)}
    assert len(layers) == 4 * LAYERS
    dense = dict(plain.named_modules())
    for name, layer in layers.items():
        want_weight = quantize_rtn(dense[name].weight, 128, torch.float32).dequantize()
        torch.testing.assert_close(layer.weights().dequantize(), want_weight, rtol=0, atol=0)


def test_a_gguf_gives_its_shape_to_random_weights(tmp_path: Path) -> None:
    # (`kvfleet bench latency --model smollm2` loads dummy weights: the alias is a GGUF file,
    # whose header, not a JSON config, holds the shape)
    from kvfleet.engine.loader.source import resolve_model_source

    path = tmp_path / "tiny.gguf"
    write_model(path, tied=True)
    source = resolve_model_source(str(path), "dummy")
    assert source.format == "dummy"
    assert source.read_config() == read_gguf_config(path)
