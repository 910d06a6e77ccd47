"""The attention kernels compile for the H100 (sm_90) in every variant the engine launches.

The interpreter that runs the other kernel tests on CPU skips Triton's compiler front end, whose
rules it does not check (e.g. a function whose returns differ in type): the FP8 cache under a
float32 model failed to compile on the device only. Triton compiles for a target without a GPU
(its ptxas ships in the wheel), so each variant is compiled here, in a subprocess free of
TRITON_INTERPRET, with the signature its launch passes: the decode kernel in six query/cache
variants, and the prompt kernel in those times each kind of step with its shipped tile, its keys
whole and split, whose shared memory must fit the H100's 227 KB a program (the interpreter has
no such limit).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

_COMPILE = """
import json, sys
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kvfleet.engine.attention import triton_attention, triton_decode, triton_prompt

DTYPES = {"*fp32": torch.float32, "*bf16": torch.bfloat16, "*fp16": torch.float16}
SHARED_LIMIT = 227 * 1024
# (the one-row GEMVs' norm arguments)
NORM_TYPES = {"residual_ptr": "*bf16", "norm_w_ptr": "*bf16", "residual_out_ptr": "*bf16",
              "eps": "fp32"}


def compile_for_sm90(kernel, types, constants, warps, stages):
    # (returns the kernel's PTX; constexprs not given take their defaults, as a launch does)
    constants = {param.name: param.default for param in kernel.params
                 if param.is_constexpr and param.has_default} | constants
    signature = {name: "constexpr" if name in constants else types.get(name, "i32")
                 for name in kernel.arg_names}
    source = ASTSource(
        fn=kernel, signature=signature,
        constexprs={(kernel.arg_names.index(k),): v for k, v in constants.items()},
    )
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps, "num_stages": stages})
    assert compiled.asm["cubin"]
    assert compiled.metadata.shared <= SHARED_LIMIT, f"{compiled.metadata.shared} B shared"
    return compiled.asm["ptx"]


def decode(q_type, cache_type, leave=0, raw=False):
    fp8 = cache_type == "*fp8e4nv"
    if raw and fp8:  # (`takes_raw_token`: unquantized caches only)
        return
    types = {"q_ptr": q_type, "out_ptr": q_type, "k_cache_ptr": cache_type,
             "v_cache_ptr": cache_type, "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32",
             "acc_ptr": "*fp32", "max_ptr": "*fp32", "sum_ptr": "*fp32", "count_ptr": "*i32",
             "kv_scales_ptr": "*fp32", "new_ptr": q_type, "positions_ptr": "*i64",
             "cos_ptr": "*fp32", "sin_ptr": "*fp32", "scale": "fp32", "softcap": "fp32"}
    block_n, warps, stages, _ = triton_decode.DECODE_TILES[fp8]
    constants = dict(GROUP=4, GROUP_PAD=16, NUM_SPLITS=2, MIN_SPLIT=256, BLOCK_SIZE=16,
                     HEAD_DIM=128, BLOCK_D=128, BLOCK_N=block_n, FP8=fp8, V_TOKEN_MINOR=fp8,
                     DOT_PRECISION="ieee" if q_type == "*fp32" else "tf32", SOFTCAP=False,
                     MERGE=True, LEAVE=leave, SPLITS_PAD=2, PRELOAD=not fp8, RAW_NEW=raw,
                     PDL=True)
    compile_for_sm90(triton_decode._decode_partial_kernel, types, constants, warps, stages)


COMPILED = set()


def prompt(q_type, cache_type, kind, split):
    fp8 = cache_type == "*fp8e4nv"
    tile = triton_prompt.prompt_tile(DTYPES[q_type], fp8, kind)
    if (q_type, cache_type, tile, split) in COMPILED:  # (float32: "long" takes "chunks" tiles)
        return
    COMPILED.add((q_type, cache_type, tile, split))
    types = {"q_ptr": q_type, "out_ptr": q_type, "k_cache_ptr": cache_type,
             "v_cache_ptr": cache_type, "block_tables_ptr": "*i32",
             "cu_seqlens_q_ptr": "*i32", "seq_lens_ptr": "*i32", "kv_scales_ptr": "*fp32",
             "scale": "fp32", "softcap": "fp32"}
    # (partial results: float32 when split, else the launch's int32 stand-in)
    partial = "*fp32" if split else "*i32"
    types |= {"acc_ptr": partial, "max_ptr": partial, "sum_ptr": partial}
    block_m, block_n, warps, stages = triton_prompt.prompt_tile(DTYPES[q_type], fp8, kind)
    constants = dict(QUERIES_PER_KV=4, BLOCK_SIZE=16, HEAD_DIM=128, BLOCK_D=128,
                     BLOCK_M=block_m, BLOCK_N=block_n, FP8=fp8, V_TOKEN_MINOR=fp8,
                     DOT_PRECISION="ieee" if q_type == "*fp32" else "tf32", SOFTCAP=False,
                     SPLIT=split, E4M3_OPERANDS=False, E4M3=False)
    compile_for_sm90(triton_prompt._paged_attention_kernel, types, constants, warps, stages)


def dependent_launch():
    # Each kernel launched dependent (PDL=True) waits (griddepcontrol.wait) and lets its
    # successor start; the GEMVs load weights before the wait, the others nothing.
    from kvfleet.engine.layers import (
        triton_gemv,
        triton_layers,
        triton_moe,
        triton_moe_gemv,
        triton_route,
        triton_rope,
    )
    from kvfleet.engine.layers.quantization import triton_fp8, triton_packed, triton_packed_rows
    cache = {"k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16"}
    mma_types = {"x_ptr": "*bf16", "x_scales_ptr": "*fp32", "w_ptr": "*fp8e4nv",
                 "w_scale_ptr": "*fp32", "x_scale_ptr": "*fp32", "bias_ptr": "*fp32",
                 "partial_ptr": "*fp32", "count_ptr": "*i32", "out_ptr": "*bf16",
                 "fp8_max": "fp32", "min_scale": "fp32"} | NORM_TYPES
    no_norm = dict(NORM=False, HAS_RESIDUAL=False, OFFSET=False)
    bf16_gemv_types = {"x_ptr": "*bf16", "w_ptr": "*bf16", "w_scale_ptr": "*bf16",
                       "x_scale_ptr": "*bf16", "bias_ptr": "*bf16", "out_ptr": "*bf16",
                       "fp8_max": "fp32", "min_scale": "fp32"} | NORM_TYPES
    norm = dict(NORM=True, HAS_RESIDUAL=True, OFFSET=False)
    no_rotary = dict(ROTARY=False, HALF=1, CACHE_BLOCK=1, FP8_CACHE=False, QK_NORM=False,
                     QK_OFFSET=False)
    no_splits = dict(SPLITS=0, SPLIT_HEAD_DIM=1, EAGER=False)
    rotary_only = {"cos_ptr": "*fp32", "sin_ptr": "*fp32", "positions_ptr": "*i64",
                   "slot_mapping_ptr": "*i64", "k_cache_ptr": "*fp8e4nv",
                   "v_cache_ptr": "*fp8e4nv", "kv_scales_ptr": "*fp32", "q_norm_ptr": "*bf16",
                   "k_norm_ptr": "*bf16", "head_count_ptr": "*i32", "qk_eps": "fp32"}
    rotary_types = bf16_gemv_types | rotary_only | {"count_ptr": "*i32"}
    rotary = dict(ROTARY=True, HALF=64, CACHE_BLOCK=16, FP8_CACHE=True, QK_OFFSET=False)
    packed_types = {"x_ptr": "*bf16", "lse_ptr": "*fp32", "perm_ptr": "*i32",
                    "qweight_ptr": "*i32", "scales_ptr": "*bf16", "zeros_ptr": "*bf16",
                    "bias_ptr": "*bf16", "partial_ptr": "*fp32", "count_ptr": "*i32",
                    "out_ptr": "*bf16"}
    packed = dict(BITS=4, HAS_PERM=False, HAS_BIAS=False, SPLIT=16, BLOCK_N=64, BLOCK_K=128,
                  STEPS=2, GROUP=128)
    rows = dict(HAS_BIAS=False, SPLIT=16, ROWS=32, GROUP=128, EVEN=True)
    moe_gemv_types = {"x_ptr": "*bf16", "logits_ptr": "*bf16", "w13_ptr": "*bf16",
                      "h_ptr": "*bf16", "weights_ptr": "*fp32", "ids_ptr": "*i64",
                      "residual_ptr": "*bf16", "norm_w_ptr": "*bf16", "eps": "fp32"}
    kernels = {
        "norm": (triton_layers._add_rms_norm_kernel, {"x_ptr": "*bf16", "residual_ptr": "*bf16",
                 "weight_ptr": "*bf16", "out_ptr": "*bf16", "residual_out_ptr": "*bf16",
                 "scale_ptr": "*fp32", "eps": "fp32", "fp8_max": "fp32", "min_scale": "fp32"},
                 dict(HAS_RESIDUAL=True, OFFSET=False, QUANTIZE=False, BLOCK=4096), 1),
        "norm, quantized": (triton_layers._add_rms_norm_kernel, {"x_ptr": "*bf16",
                            "residual_ptr": "*bf16", "weight_ptr": "*bf16", "out_ptr": "*fp8e4nv",
                            "residual_out_ptr": "*bf16", "scale_ptr": "*fp32", "eps": "fp32",
                            "fp8_max": "fp32", "min_scale": "fp32"},
                            dict(HAS_RESIDUAL=True, OFFSET=False, QUANTIZE=True, BLOCK=4096), 1),
        "rotary": (triton_rope._rotary_write_kv_kernel, {"q_ptr": "*bf16", "k_ptr": "*bf16",
                   "v_ptr": "*bf16", "cos_ptr": "*fp32", "sin_ptr": "*fp32",
                   "positions_ptr": "*i64", "slot_mapping_ptr": "*i64",
                   "kv_scales_ptr": "*fp32"} | cache,
                   dict(HALF=64, HALF_PAD=64, BLOCK_H=32, BLOCK_KV=8, BLOCK_SIZE=16, FP8=False,
                        QK_NORM=False, OFFSET=False), 0),
        "rotary, heads of 96": (triton_rope._rotary_write_kv_kernel, {"q_ptr": "*bf16",
                                "k_ptr": "*bf16", "v_ptr": "*bf16", "cos_ptr": "*fp32",
                                "sin_ptr": "*fp32", "positions_ptr": "*i64",
                                "slot_mapping_ptr": "*i64", "kv_scales_ptr": "*fp32"} | cache,
                                dict(HALF=48, HALF_PAD=64, BLOCK_H=32, BLOCK_KV=32,
                                BLOCK_SIZE=16, FP8=False, QK_NORM=False, OFFSET=False), 0),
        "rotary, q/k norms": (triton_rope._rotary_write_kv_kernel, {"q_ptr": "*bf16",
                              "k_ptr": "*bf16", "v_ptr": "*bf16", "cos_ptr": "*fp32",
                              "sin_ptr": "*fp32", "positions_ptr": "*i64",
                              "slot_mapping_ptr": "*i64", "kv_scales_ptr": "*fp32",
                              "q_norm_ptr": "*bf16", "k_norm_ptr": "*bf16", "eps": "fp32"}
                              | cache, dict(HALF=64, HALF_PAD=64, BLOCK_H=32, BLOCK_KV=8,
                              BLOCK_SIZE=16,
                              FP8=False, QK_NORM=True, OFFSET=False), 0),
        "head norm": (triton_layers._rms_norm_heads_kernel, {"x_ptr": "*bf16",
                      "weight_ptr": "*bf16", "out_ptr": "*bf16", "eps": "fp32"},
                      dict(OFFSET=False, BLOCK=128), 1),
        "quantize rows": (triton_fp8._quantize_rows_kernel, {"x_ptr": "*bf16",
                          "out_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "fp8_max": "fp32",
                          "min_scale": "fp32"}, dict(BLOCK=4096), 0),
        "route": (triton_route._route_kernel, {"logits_ptr": "*bf16", "weights_ptr": "*fp32",
                  "ids_ptr": "*i64"}, dict(TOP_K=8, K_PAD=8, E_PAD=128, RENORMALIZE=True), 0),
        "align": (triton_route._align_kernel, {"ids_ptr": "*i64", "sorted_rows_ptr": "*i32",
                  "run_ends_ptr": "*i32", "scratch_ptr": "*i32", "logits_ptr": "*i32",
                  "weights_ptr": "*i32"}, dict(BLOCK_M=16, E_PAD=128, CHUNK=256, ROUTE=False,
                  TOP_K=8, K_PAD=8, T_PAD=16, RENORMALIZE=False, VALID=False), 0),
        "align, real tokens": (triton_route._align_kernel, {"ids_ptr": "*i64",
                               "sorted_rows_ptr": "*i32", "run_ends_ptr": "*i32",
                               "scratch_ptr": "*i32", "logits_ptr": "*i32",
                               "weights_ptr": "*i32", "valid_ptr": "*i32"},
                               dict(BLOCK_M=16, E_PAD=128, CHUNK=256, ROUTE=False, TOP_K=8,
                               K_PAD=8, T_PAD=16, RENORMALIZE=False, VALID=True), 0),
        "route + align": (triton_route._align_kernel, {"ids_ptr": "*i64",
                          "sorted_rows_ptr": "*i32", "run_ends_ptr": "*i32",
                          "scratch_ptr": "*i32", "logits_ptr": "*bf16",
                          "weights_ptr": "*fp32", "valid_ptr": "*i32"},
                          dict(BLOCK_M=16, E_PAD=128, CHUNK=256,
                          ROUTE=True, TOP_K=8, K_PAD=8, T_PAD=16, RENORMALIZE=True,
                          VALID=True), 0),
        "combine": (triton_moe._combine_kernel, {"rows_ptr": "*bf16", "out_ptr": "*bf16"},
                    dict(TOP_K=8, BLOCK=1024, VALID=False), 0),
        "combine, real tokens": (triton_moe._combine_kernel, {"rows_ptr": "*bf16",
                                 "out_ptr": "*bf16", "valid_ptr": "*i32"},
                                 dict(TOP_K=8, BLOCK=1024, VALID=True), 0),
        "experts gate_up": (triton_moe._gate_up_kernel, {"x_ptr": "*bf16", "w13_ptr": "*bf16",
                            "out_ptr": "*bf16", "sorted_rows_ptr": "*i32",
                            "run_ends_ptr": "*i32"}, dict(TOP_K=8, E_PAD=128, BLOCK_M=16,
                            BLOCK_N=32, BLOCK_K=128, DOT_PRECISION="tf32"), 0),
        "experts down": (triton_moe._down_kernel, {"h_ptr": "*bf16", "w2_ptr": "*bf16",
                         "weights_ptr": "*fp32", "out_ptr": "*bf16", "sorted_rows_ptr": "*i32",
                         "run_ends_ptr": "*i32"}, dict(E_PAD=128, BLOCK_M=16, BLOCK_N=32,
                         BLOCK_K=128, DOT_PRECISION="tf32"), 0),
        "one token's gate_up": (triton_moe_gemv._gate_up_gemv_kernel, moe_gemv_types,
                                dict(TOP_K=8, K_PAD=8, E_PAD=128, RENORMALIZE=True, BLOCK_N=8,
                                BLOCK_K=256, ROW_BLOCK=1) | no_norm, 0),
        "one token's gate_up, norm": (triton_moe_gemv._gate_up_gemv_kernel, moe_gemv_types,
                                      dict(TOP_K=8, K_PAD=8, E_PAD=128, RENORMALIZE=True,
                                      BLOCK_N=8, BLOCK_K=256, ROW_BLOCK=2048) | norm, 0),
        "one token's gate_up, few experts": (triton_moe_gemv._gate_up_gemv_kernel,
                                             moe_gemv_types, dict(TOP_K=2, K_PAD=2, E_PAD=8,
                                             RENORMALIZE=True, BLOCK_N=4, BLOCK_K=512,
                                             ROW_BLOCK=4096) | norm, 0),
        "one token's down": (triton_moe_gemv._down_gemv_kernel, {"h_ptr": "*bf16",
                             "w2_ptr": "*bf16", "weights_ptr": "*fp32", "ids_ptr": "*i64",
                             "partial_ptr": "*fp32", "count_ptr": "*i32", "out_ptr": "*bf16"},
                             dict(TOP_K=8, BLOCK_N=8, BLOCK_K=256), 0),
        # (ranked by the router's GEMV: gate_up lets down start only after its wait, the router
        # then complete, whose choices down reads before its own, with its first weights)
        "one token's gate_up, ranked": (triton_moe_gemv._gate_up_gemv_kernel, moe_gemv_types,
                                        dict(TOP_K=8, K_PAD=8, E_PAD=128, RENORMALIZE=True,
                                             BLOCK_N=8, BLOCK_K=256, ROW_BLOCK=2048,
                                             RANKED=True) | norm, 0, "after"),
        "one token's down, ranked": (triton_moe_gemv._down_gemv_kernel, {"h_ptr": "*bf16",
                                     "w2_ptr": "*bf16", "weights_ptr": "*fp32",
                                     "ids_ptr": "*i64", "partial_ptr": "*fp32",
                                     "count_ptr": "*i32", "out_ptr": "*bf16"},
                                     dict(TOP_K=8, BLOCK_N=8, BLOCK_K=256, RANKED=True), 1),
        "one token's down, all experts": (triton_moe_gemv._down_all_gemv_kernel,
                                          {"h_ptr": "*bf16", "w2_ptr": "*bf16",
                                           "weights_ptr": "*fp32", "ids_ptr": "*i64",
                                           "out_ptr": "*bf16"},
                                          dict(TOP_K=2, BLOCK_N=4, BLOCK_K=512), 0),
        "act": (triton_layers._act_and_mul_kernel, {"gate_up_ptr": "*bf16", "out_ptr": "*bf16",
                "scale_ptr": "*fp32", "fp8_max": "fp32", "min_scale": "fp32"},
                dict(GELU_TANH=False, QUANTIZE=False, BLOCK=1024), 0),
        "act, quantized": (triton_layers._act_and_mul_kernel, {"gate_up_ptr": "*bf16",
                           "out_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "fp8_max": "fp32",
                           "min_scale": "fp32"}, dict(GELU_TANH=False, QUANTIZE=True,
                           BLOCK=16384), 0),
        "merge": (triton_decode._decode_merge_kernel, {"acc_ptr": "*fp32", "max_ptr": "*fp32",
                  "sum_ptr": "*fp32", "out_ptr": "*bf16"},
                  dict(SPLITS_PAD=32, HEAD_DIM=128, BLOCK_D=128), 0),
        "fp8 gemv": (triton_gemv._gemv_kernel, {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv",
                     "w_scale_ptr": "*fp32", "x_scale_ptr": "*fp32", "bias_ptr": "*fp32",
                     "out_ptr": "*bf16", "fp8_max": "fp32", "min_scale": "fp32"} | NORM_TYPES,
                     dict(QUANTIZE=True, STATIC=False, HAS_BIAS=False, BLOCK_N=16,
                          BLOCK_K=512, ROW_BLOCK=16384)
                     | no_norm | no_rotary | no_splits, 1),
        "fp8 gemv, the row as it is, norm": (
            triton_gemv._gemv_kernel, bf16_gemv_types | {"w_ptr": "*fp8e4nv",
                                                         "w_scale_ptr": "*fp32"},
            dict(QUANTIZE=False, SCALED=True, STATIC=False, HAS_BIAS=False, BLOCK_N=16,
                 BLOCK_K=256, ROW_BLOCK=4096) | norm | no_rotary | no_splits, 1),
        "fp8 gemv, the row as it is, products in pairs": (
            triton_gemv._gemv_kernel, bf16_gemv_types | {"w_ptr": "*fp8e4nv",
                                                         "w_scale_ptr": "*fp32"},
            dict(QUANTIZE=False, SCALED=True, STATIC=False, HAS_BIAS=False, BLOCK_N=16,
                 BLOCK_K=512, ROW_BLOCK=1, GROUP=2) | no_norm | no_rotary | no_splits, 1),
        "fp8 gemv, tensor cores": (triton_gemv._fp8_gemv_mma_kernel, mma_types,
                                   dict(STATIC=False, HAS_BIAS=False, SPLIT=4, STEPS=4,
                                        BLOCK_N=64, BLOCK_K=256, ROW_BLOCK=4096,
                                        QUANTIZED=False, COLS=16, SPAN=128)
                                   | no_norm | no_rotary, 1),
        "fp8 gemv, tensor cores, norm": (triton_gemv._fp8_gemv_mma_kernel, mma_types,
                                         dict(STATIC=False, HAS_BIAS=False, SPLIT=4, STEPS=4,
                                              BLOCK_N=64, BLOCK_K=512, ROW_BLOCK=4096,
                                              QUANTIZED=False, COLS=16, SPAN=128)
                                         | norm | no_rotary, 1),
        "fp8 gemv, tensor cores, norm, q/k norms, rotary": (
            triton_gemv._fp8_gemv_mma_kernel, mma_types | rotary_only,
            dict(STATIC=False, HAS_BIAS=False, SPLIT=4, STEPS=4, BLOCK_N=64, BLOCK_K=512,
                 ROW_BLOCK=4096, QUANTIZED=False, COLS=16, SPAN=128, QK_NORM=True)
            | norm | rotary, 1),
        "fp8 rows, tensor cores": (triton_gemv._fp8_gemv_mma_kernel,
                                   mma_types | {"x_ptr": "*fp8e4nv", "bias_ptr": "*bf16"},
                                   dict(STATIC=False, HAS_BIAS=True, SPLIT=4, STEPS=4,
                                        BLOCK_N=64, BLOCK_K=256, ROW_BLOCK=1,
                                        QUANTIZED=True, COLS=32, SPAN=128)
                                   | no_norm | no_rotary, 1),
        "bf16 gemv": (triton_gemv._gemv_kernel, bf16_gemv_types,
                      dict(QUANTIZE=False, STATIC=False, HAS_BIAS=True, BLOCK_N=8,
                           BLOCK_K=512, ROW_BLOCK=1) | no_norm | no_rotary | no_splits, 1),
        "bf16 gemv, split rows": (triton_gemv._gemv_kernel,
                                  bf16_gemv_types | {"lse_ptr": "*fp32"},
                                  dict(QUANTIZE=False, STATIC=False, HAS_BIAS=False, BLOCK_N=8,
                                       BLOCK_K=2048, ROW_BLOCK=1)
                                  | no_norm | no_rotary
                                  | dict(SPLITS=4, SPLIT_HEAD_DIM=128, EAGER=False), 1),
        "bf16 gemv, split rows, eager": (
            triton_gemv._gemv_kernel, bf16_gemv_types | {"lse_ptr": "*fp32"},
            dict(QUANTIZE=False, STATIC=False, HAS_BIAS=False, BLOCK_N=8, BLOCK_K=1024,
                 ROW_BLOCK=1)
            | no_norm | no_rotary | dict(SPLITS=4, SPLIT_HEAD_DIM=128, EAGER=True), 1),
        "bf16 gemv, norm": (triton_gemv._gemv_kernel, bf16_gemv_types,
                            dict(QUANTIZE=False, STATIC=False, HAS_BIAS=False, BLOCK_N=16,
                                 BLOCK_K=256, ROW_BLOCK=4096)
                            | norm | no_rotary | no_splits, 1),
        "bf16 gemv, norm, ranking a router's logits": (
            triton_gemv._gemv_kernel, bf16_gemv_types | {"count_ptr": "*i32",
            "choice_weights_ptr": "*fp32", "choice_ids_ptr": "*i64"},
            dict(QUANTIZE=False, STATIC=False, HAS_BIAS=False, BLOCK_N=16, BLOCK_K=256,
                 ROW_BLOCK=2048, TOP_K=8, K_PAD=8, E_PAD=128, RENORMALIZE=True)
            | norm | no_rotary | no_splits, 1),
        "bf16 gemv, norm, rotary into an FP8 cache": (
            triton_gemv._gemv_kernel, rotary_types,
            dict(QUANTIZE=False, STATIC=False, HAS_BIAS=False, BLOCK_N=16, BLOCK_K=256,
                 ROW_BLOCK=4096, QK_NORM=False) | norm | rotary | no_splits, 1),
        "bf16 gemv, norm, q/k norms, rotary into an FP8 cache": (
            triton_gemv._gemv_kernel, rotary_types,
            dict(QUANTIZE=False, STATIC=False, HAS_BIAS=False, BLOCK_N=16, BLOCK_K=256,
                 ROW_BLOCK=4096, QK_NORM=True) | norm | rotary | no_splits, 1),
        "packed gemv": (triton_packed._packed_gemv_kernel, packed_types,
                        packed | dict(SPLITS=0, HEAD_DIM=1), 1),
        "packed gemv, split rows": (triton_packed._packed_gemv_kernel, packed_types,
                                    packed | dict(SPLITS=4, HEAD_DIM=128), 1),
        "packed gemv, whole columns, named rows": (
            triton_packed_rows._packed_gemv_rows_kernel, packed_types,
            rows | dict(BLOCK_N=256), 1),
        "packed gemv, whole columns, tiles": (
            triton_packed_rows._packed_gemv_tile_kernel, packed_types,
            rows | dict(BLOCK_N=512, CHUNK=8), 1),
    }
    for name, (kernel, types, constants, loads_first, *lets_start) in kernels.items():
        ptx = compile_for_sm90(kernel, types, constants | {"PDL": True}, 4, 3)
        before, wait, after = ptx.partition("griddepcontrol.wait")
        assert wait, f"{name}: no griddepcontrol.wait"
        lets = after if lets_start == ["after"] else before
        assert "griddepcontrol.launch_dependents" in lets, f"{name}: successor not let start"
        assert "griddepcontrol.launch_dependents" not in (before if lets is after else after)
        assert ("ld.global" in before) == bool(loads_first), f"{name}: loads before the wait"
        assert "st.global" not in before, f"{name}: stores before the wait"
        plain = compile_for_sm90(kernel, types, constants | {"PDL": False}, 4, 3)
        assert "griddepcontrol" not in plain, f"{name}: PDL=False still waits"


def e4m3():
    # The FP8 cache's decode kernel with e4m3 products, at heads of 128 and 256, whole and
    # split: both products e4m3 tensor-core ones, K and V never upcast (the only e4m3 -> f16
    # conversions: the softmax weights' sum, a few a tile; the upcasting kernel has ~130).
    from kvfleet.engine.attention import triton_decode_e4m3, triton_tiles
    types = {"q_ptr": "*bf16", "out_ptr": "*bf16", "k_cache_ptr": "*fp8e4nv",
             "v_cache_ptr": "*fp8e4nv", "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32",
             "acc_ptr": "*fp32", "max_ptr": "*fp32", "sum_ptr": "*fp32", "count_ptr": "*i32",
             "kv_scales_ptr": "*fp32", "scale": "fp32"}
    block_n, warps, stages = triton_decode_e4m3.E4M3_TILE
    for head_dim in (128, 256):
        for splits in (1, 2):
            ptx = compile_for_sm90(
                triton_decode_e4m3._decode_e4m3_kernel, types,
                dict(GROUP=4, GROUP_PAD=16, NUM_SPLITS=splits, MIN_SPLIT=128, BLOCK_SIZE=16,
                     HEAD_DIM=head_dim, BLOCK_D=head_dim,
                     BLOCK_N=triton_tiles.kv_tile_tokens(block_n, head_dim),
                     MERGE=splits > 1, SPLITS_PAD=splits, E4M3=True, PDL=True), warps, stages)
            products = [line for line in ptx.splitlines() if "wgmma.mma_async" in line]
            assert products and all(".e4m3.e4m3" in line for line in products), head_dim
            upcasts = ptx.count("cvt.rn.f16x2.e4m3x2")
            assert upcasts <= 16, f"head {head_dim}: {upcasts} e4m3 upcasts"
    # ... and the prompt kernel's E4M3_OPERANDS at the FP8 tiles of 64 query rows and more:
    # e4m3 products, at most half the upcasting kernel's conversions (the weights' sum only)
    types |= {"cu_seqlens_q_ptr": "*i32", "softcap": "fp32"}
    whole = {"acc_ptr": "*i32", "max_ptr": "*i32", "sum_ptr": "*i32"}
    for kind in ("few", "chunks", "long"):
        for split in (False, True):
            block_m, block_n, warps, stages = triton_prompt.prompt_tile(torch.bfloat16, True, kind)
            ptx = {}
            for e4m3 in (False, True):
                ptx[e4m3] = compile_for_sm90(
                    triton_prompt._paged_attention_kernel, types | ({} if split else whole),
                    dict(QUERIES_PER_KV=4, BLOCK_SIZE=16, HEAD_DIM=128, BLOCK_D=128,
                         BLOCK_M=block_m, BLOCK_N=block_n, FP8=True, V_TOKEN_MINOR=True,
                         DOT_PRECISION="tf32", SOFTCAP=False, SPLIT=split, E4M3_OPERANDS=e4m3,
                         E4M3=e4m3), warps, stages)
            products = [line for line in ptx[True].splitlines() if "wgmma.mma_async" in line]
            assert products and all(".e4m3.e4m3" in line for line in products), kind
            upcasts = [ptx[e4m3].count("cvt.rn.f16x2.e4m3x2") for e4m3 in (False, True)]
            assert 2 * upcasts[1] <= upcasts[0], f"prompt {kind}: {upcasts} e4m3 upcasts"


def fp8_gemm():
    # The Triton FP8 GEMM at each of its shipped tilings, whole and with K split.
    from kvfleet.engine.layers.quantization import triton_fp8
    types = {"a_ptr": "*fp8e4nv", "a_scale_ptr": "*fp32", "b_ptr": "*fp8e4nv",
             "b_scale_ptr": "*fp32", "bias_ptr": "*bf16", "partial_ptr": "*fp32",
             "count_ptr": "*i32", "c_ptr": "*bf16"}
    tilings = [t for _, t in triton_fp8.FP8_GEMM_TILES] + [triton_fp8.FP8_GEMM_LARGE]
    for block_m, block_n, block_k, warps, stages in tilings:
        for split in (1, 2):
            compile_for_sm90(triton_fp8._fp8_gemm_kernel, types,
                             dict(HAS_BIAS=True, BLOCK_M=block_m, BLOCK_N=block_n,
                                  BLOCK_K=block_k, SPLIT=split), warps, stages)


def lora():
    # The LoRA shrink and expand at a decode step's and a prefill's blocks.
    from kvfleet.engine.lora import triton_ops
    indices = {"token_order_ptr": "*i32", "slot_starts_ptr": "*i32"}
    for block_m, split in ((16, 8), (64, 1)):
        compile_for_sm90(triton_ops._shrink_kernel, {"x_ptr": "*bf16", "a_ptr": "*bf16",
                         "partial_ptr": "*fp32"} | indices, dict(BLOCK_M=block_m, BLOCK_R=64,
                         BLOCK_K=64, NUM_R_BLOCKS=1, SLOTS_PAD=8, DOT_PRECISION="tf32"), 4, 3)
        compile_for_sm90(triton_ops._expand_kernel, {"partial_ptr": "*fp32", "b_ptr": "*bf16",
                         "out_ptr": "*bf16", "slice_starts_ptr": "*i32"} | indices,
                         dict(SPLIT_K=split, NUM_SLICES=3, BLOCK_M=block_m, BLOCK_N=128,
                         BLOCK_R=16, SLOTS_PAD=8, DOT_PRECISION="tf32"), 4, 3)


failed = {}
if sys.argv[1:] == ["lora"]:
    try:
        lora()
    except Exception as exc:
        failed["lora"] = f"{type(exc).__name__}: {exc}"[-1500:]
if sys.argv[1:] == ["e4m3"]:
    try:
        e4m3()
    except Exception as exc:
        failed["e4m3"] = f"{type(exc).__name__}: {exc}"[-1500:]
if sys.argv[1:] == ["fp8-gemm"]:
    try:
        fp8_gemm()
    except Exception as exc:
        failed["fp8 gemm"] = f"{type(exc).__name__}: {exc}"[-1500:]
if sys.argv[1:] == ["dependent-launch"]:
    try:
        dependent_launch()
    except Exception as exc:
        failed["dependent launch"] = f"{type(exc).__name__}: {exc}"[-1500:]
modes = (["dependent-launch"], ["e4m3"], ["fp8-gemm"], ["lora"])
for variant in sys.argv[1:] if sys.argv[1:] not in modes else []:
    q_type, cache_type = variant.split(",")
    for name, build in [("decode", lambda: decode(q_type, cache_type)),
                        ("decode leaving splits", lambda: decode(q_type, cache_type, 4)),
                        ("decode of a raw token", lambda: decode(q_type, cache_type, 4, True))] + [
        (f"prompt {kind}{' split' if split else ''}",
         lambda kind=kind, split=split: prompt(q_type, cache_type, kind, split))
        for kind in ("short", "few", "chunks", "long") for split in (False, True)
    ]:
        try:
            build()
        except Exception as exc:
            failed[f"{name} {variant}"] = f"{type(exc).__name__}: {exc}"[-1500:]
print(json.dumps(failed))
"""

# (float16 takes bfloat16's code paths and tiles: not compiled again)
VARIANTS = [f"{q},{cache}" for q in ("*fp32", "*bf16") for cache in (q, "*fp8e4nv")]


def test_attention_kernels_compile_for_sm90_in_every_variant() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # (two processes, a variant pair each: the compiles take a core apiece)
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", _COMPILE, *VARIANTS[half::2]],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for half in (0, 1)
    ]
    failed = {}
    for run in runs:
        out, err = run.communicate(timeout=600)
        assert run.returncode == 0, err[-3000:]
        failed |= json.loads(out.strip().splitlines()[-1])
    assert failed == {}


def _failed_compiles(mode: str) -> dict[str, str]:
    """The compile script run in `mode` in a process of its own: what failed, by name."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-c", _COMPILE, mode],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    failed: dict[str, str] = json.loads(run.stdout.strip().splitlines()[-1])
    return failed


def test_dependent_launch_kernels_wait_before_reading_what_came_before() -> None:
    """engine/layers/dependent_launch.py's rule, on the compiled code: before its
    griddepcontrol.wait a kernel stores nothing and loads only its weights (the GEMVs)."""
    assert _failed_compiles("dependent-launch") == {}


def test_the_e4m3_attention_paths_multiply_e4m3_without_upcasts() -> None:
    assert _failed_compiles("e4m3") == {}


def test_the_fp8_gemm_compiles_for_sm90_whole_and_split() -> None:
    assert _failed_compiles("fp8-gemm") == {}


def test_the_lora_kernels_compile_for_sm90() -> None:
    assert _failed_compiles("lora") == {}
