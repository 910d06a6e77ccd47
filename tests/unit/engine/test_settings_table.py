"""One settings table (kvfleet/engine/config): every engine setting is a `kvfleet engine` flag
and an `LLM` keyword, `kvfleet serve` forwards each to its engines, and the operator's engine
arguments read back as the same settings."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from kvfleet.cli import serve
from kvfleet.cli.main import build_parser
from kvfleet.engine.config import (
    CacheConfig,
    EngineConfig,
    LoRAConfig,
    SchedulerConfig,
    SpeculativeConfig,
    engine_settings,
)
from kvfleet.engine.server import commands as engine_commands


def engine_config(argv: list[str]) -> EngineConfig:
    args = build_parser().parse_args(["engine", *argv])
    config: EngineConfig = engine_commands._settings(args, args.model).engine
    return config


def test_every_config_field_is_a_setting() -> None:
    names = {(s.section, s.name) for s in engine_settings()}
    sections = {"cache": CacheConfig, "scheduler": SchedulerConfig, "lora": LoRAConfig}
    for item in dataclasses.fields(EngineConfig):
        if item.name in sections:
            nested = {f.name for f in dataclasses.fields(sections[item.name])}
            assert {(item.name, n) for n in nested} <= names
        elif item.name != "model":
            assert (None, item.name) in names


def test_every_command_line_setting_is_an_engine_flag() -> None:
    parser = build_parser()
    engine = next(
        choice
        for action in parser._actions
        if isinstance(action, argparse._SubParsersAction)
        for name, choice in action.choices.items()
        if name == "engine"
    )
    flags = {option for action in engine._actions for option in action.option_strings}
    for s in engine_settings():
        assert (s.flag in flags) == s.command_line, s.flag
    assert "--no-prefix-caching" in flags  # (a switch on by default is turned off)
    assert "--enable-lora" in flags


NON_DEFAULT = [
    "--dtype=float32",
    "--seed=7",
    "--max-model-len=512",
    "--block-size=32",
    "--num-blocks=64",
    "--no-prefix-caching",
    "--max-num-batched-tokens=256",
    "--max-num-seqs=8",
    "--max-prefill-seqs=4",
    "--long-prefill-token-threshold=64",
    "--no-chunked-prefill",
    "--no-async-scheduling",
    "--attention-backend=torch",
    "--enforce-eager",
    "--prefill-graph-tokens=64",
    "--enable-lora",
    "--max-loras=2",
    "--max-cpu-loras=3",
    "--max-lora-rank=8",
    "--lora-modules",
    "sql=/a/sql",
    "chat=/a/chat",
    '--speculative-config={"method": "ngram", "num_speculative_tokens": 3}',
]


def test_flags_and_keywords_make_the_same_config() -> None:
    from_flags = engine_config(["--model=smollm2", *NON_DEFAULT])
    from_keywords = EngineConfig.from_kwargs(
        "smollm2",
        {
            "dtype": "float32",
            "seed": 7,
            "max_model_len": 512,
            "block_size": 32,
            "num_blocks": 64,
            "enable_prefix_caching": False,
            "max_num_batched_tokens": 256,
            "max_num_seqs": 8,
            "max_prefill_seqs": 4,
            "long_prefill_token_threshold": 64,
            "enable_chunked_prefill": False,
            "async_scheduling": False,
            "attention_backend": "torch",
            "enforce_eager": True,
            "prefill_graph_tokens": 64,
            "enable_lora": True,
            "max_loras": 2,
            "max_cpu_loras": 3,
            "max_lora_rank": 8,
            "lora_modules": {"sql": "/a/sql", "chat": "/a/chat"},
            "speculative_config": {"method": "ngram", "num_speculative_tokens": 3},
            "enable_kv_events": True,  # (the server turns them on)
        },
    )
    assert from_flags == from_keywords
    assert from_flags.speculative == SpeculativeConfig("ngram", 3)
    assert from_flags.lora.lora_modules == (("sql", "/a/sql"), ("chat", "/a/chat"))


def test_serve_forwards_every_engine_setting() -> None:
    args = build_parser().parse_args(["serve", "smollm2", *NON_DEFAULT, "--replicas=2"])
    forwarded = serve._forwarded_engine_arguments(args)
    assert engine_config(["--model=smollm2", *forwarded]) == engine_config(
        ["--model=smollm2", *NON_DEFAULT]
    )
    assert engine_config(
        [
            "--model=smollm2",
            *serve._forwarded_engine_arguments(build_parser().parse_args(["serve"])),
        ]
    ) == engine_config(["--model=smollm2"])


def test_unknown_or_bad_keywords_are_refused() -> None:
    with pytest.raises(TypeError, match=r"unknown engine settings \['max_num_seq'\]"):
        EngineConfig.from_kwargs("smollm2", {"max_num_seq": 8})
    with pytest.raises(ValueError, match=r"long_prefill_token_threshold must be 0"):
        EngineConfig.from_kwargs("smollm2", {"long_prefill_token_threshold": -5})
    for tokens in (-1, 2049):
        with pytest.raises(ValueError, match=r"prefill_graph_tokens must be between 0 and 2048"):
            EngineConfig.from_kwargs("smollm2", {"prefill_graph_tokens": tokens})
    with pytest.raises(SystemExit, match=r"prefill_graph_tokens must be between 0 and 2048"):
        engine_config(["--prefill-graph-tokens=-4"])
    for swap_space in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"swap_space_gib must be a finite number of GiB"):
            EngineConfig.from_kwargs("smollm2", {"swap_space_gib": swap_space})
    with pytest.raises(ValueError, match=r"speculative_config: .*not valid JSON"):
        EngineConfig.from_kwargs("smollm2", {"speculative_config": "{bad"})
    with pytest.raises(SystemExit, match=r"--speculative-config: .*not valid JSON"):
        engine_config(["--speculative-config={bad"])
