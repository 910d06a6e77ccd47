"""Suite-wide pytest wiring: the `gpu` marker and its skip without CUDA, and shared fixtures:
small random Hugging Face models saved as real folders, and a greedy transformers oracle."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
GPU_TESTS = REPO_ROOT / "tests" / "gpu"


def _cuda_available() -> bool:
    # NOTE: torch is imported only here, lazily: gateway/operator-only environments lack it.
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.is_relative_to(GPU_TESTS):
            item.add_marker(pytest.mark.gpu)
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if gpu_items and not _cuda_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU (run tests/gpu on the device machine)")
        for item in gpu_items:
            item.add_marker(skip)


# NOTE: without CUDA, Triton kernels run in Triton's interpreter. The variable must be set
# before any module defining a kernel is imported, and collecting tests/gpu imports them, so it
# is set here, first, for the whole session.
if not _cuda_available():
    os.environ["TRITON_INTERPRET"] = "1"


def _prometheus_tool(name: str) -> str:
    """promtool or prometheus (Debian package prometheus, which .ci/run installs): a failure in
    CI when missing, a skip elsewhere."""
    import shutil

    found = shutil.which(name)
    if found is None:
        if os.environ.get("CI"):
            pytest.fail(f"{name} is missing: .ci/run installs the Debian package prometheus")
        pytest.skip(f"{name} is not installed (Debian package prometheus)")
    return found


@pytest.fixture(scope="session")
def promtool() -> str:
    return _prometheus_tool("promtool")


@pytest.fixture(scope="session")
def prometheus_binary() -> str:
    return _prometheus_tool("prometheus")


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


HEAVY_MODULES = ("torch", "triton", "transformers")


@pytest.fixture(scope="session")
def heavy_imports_of() -> Callable[..., list[str]]:
    """`heavy_imports_of(*packages)`: which of HEAVY_MODULES a fresh interpreter has loaded after
    importing every module of the given packages (the gateway and operator images lack them)."""

    def heavy_imports_of(*packages: str) -> list[str]:
        code = (
            "import importlib, json, pkgutil, sys\n"
            f"for name in {packages!r}:\n"
            "    path = getattr(importlib.import_module(name), '__path__', [])\n"
            "    for module in pkgutil.walk_packages(path, name + '.'):\n"
            "        importlib.import_module(module.name)\n"
            f"print(json.dumps(sorted(m for m in {HEAVY_MODULES!r} if m in sys.modules)))\n"
        )
        result = subprocess.run(
            [sys.executable, "-c", code],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            check=False,
            timeout=120,
        )
        assert result.returncode == 0, result.stderr
        loaded: list[str] = json.loads(result.stdout)
        return loaded

    return heavy_imports_of


BASE = {
    "vocab_size": 384,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama3-rope-untied": (
        "LlamaConfig",
        {
            "tie_word_embeddings": False,
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    "llama2-tied": ("LlamaConfig", {"tie_word_embeddings": True, "num_key_value_heads": 4}),
    "qwen2-qkv-bias": ("Qwen2Config", {"tie_word_embeddings": True, "rope_theta": 1000000.0}),
    # (head_dim 32, not hidden / heads = 16, as Qwen3's small models have it; YaRN as Qwen's
    # long-context configs turn it on, over an original context the tests' prompts pass)
    "qwen3-qk-norm-yarn": (
        "Qwen3Config",
        {
            "tie_word_embeddings": True,
            "head_dim": 32,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 1000000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 48,
            },
        },
    ),
    # (Mixtral: top 2 of 4 experts, renormalized, in every layer)
    "mixtral-moe": (
        "MixtralConfig",
        {"tie_word_embeddings": False, "num_local_experts": 4, "num_experts_per_tok": 2},
    ),
    # (Qwen3-MoE: top 3 of 8 experts of 32 inner features, not renormalized; layer 1 dense)
    "qwen3-moe-dense-layer": (
        "Qwen3MoeConfig",
        {
            "tie_word_embeddings": True,
            "num_experts": 8,
            "num_experts_per_tok": 3,
            "moe_intermediate_size": 32,
            "norm_topk_prob": False,
            "mlp_only_layers": [1],
        },
    ),
    # (Phi-3: fused qkv_proj and gate_up_proj; LongRoPE over an original context of 48, with
    # the long factors: the tests' prompts pass it, as transformers then switches to them)
    "phi3-longrope": (
        "Phi3Config",
        {
            "tie_word_embeddings": False,
            "original_max_position_embeddings": 48,
            "rope_scaling": {
                "type": "longrope",
                "short_factor": [1.0 + 0.1 * i for i in range(8)],
                "long_factor": [1.0 + 0.5 * i for i in range(8)],
            },
            "pad_token_id": 0,
        },
    ),
    # (Gemma 2: a 24-token window on layer 0, full attention on layer 1; caps low enough to
    # bite on a small random model; the query scaled by 24^-0.5, not head_dim^-0.5)
    "gemma2-softcap-windows": (
        "Gemma2Config",
        {
            "head_dim": 16,
            "query_pre_attn_scalar": 24,
            "sliding_window": 24,
            "attn_logit_softcapping": 2.0,
            "final_logit_softcapping": 3.0,
        },
    ),
    # (Gemma 3: q/k norms, a windowed layer turning at base 10,000, a full one at 10^6 with
    # linear scaling)
    "gemma3-local-global": (
        "Gemma3TextConfig",
        {
            "head_dim": 16,
            "query_pre_attn_scalar": 16,
            "sliding_window": 24,
            "layer_types": ["sliding_attention", "full_attention"],
            "rope_scaling": {"rope_type": "linear", "factor": 4.0},
        },
    ),
    "mistral-sliding-window": (
        "MistralConfig",
        {"tie_word_embeddings": False, "sliding_window": 24, "num_key_value_heads": 1},
    ),
}


def build_hf_model(name: str, seed: int = 0) -> Any:
    """A random transformers model for CONFIGS[name], float32, biases random too."""
    import torch
    import transformers

    class_name, extra = CONFIGS[name]
    config = getattr(transformers, class_name)(**{**BASE, **extra})
    config._attn_implementation = "eager" if "sliding" in name or "gemma" in name else "sdpa"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith(".bias") or param_name.endswith("norm.weight"):
                param.normal_(1.0 if "norm" in param_name else 0.0, 0.1)
    return model.eval()


@pytest.fixture(scope="session")
def hf_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Any, Path]]:
    """`hf_model_dir(name)` -> (the transformers model, the folder it was saved to)."""
    made: dict[str, tuple[Any, Path]] = {}

    def hf_model_dir(name: str) -> tuple[Any, Path]:
        if name not in made:
            model = build_hf_model(name)
            folder = tmp_path_factory.mktemp(name)
            model.save_pretrained(folder)
            made[name] = (model, folder)
        return made[name]

    return hf_model_dir


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "hf_config_name" in metafunc.fixturenames:
        metafunc.parametrize("hf_config_name", list(CONFIGS))


@pytest.fixture(scope="session")
def logprob_gap() -> Callable[[Any, list[int], Any], float]:
    """`logprob_gap(hf_model, prompt, completion)`: run transformers over the prompt and our
    completion (teacher forcing), check each of our greedy tokens is its argmax, and return the
    largest |difference| between our reported top logprobs and its log-softmax."""
    import torch

    def logprob_gap(hf_model: Any, prompt: list[int], completion: Any) -> float:
        device = next(hf_model.parameters()).device
        sequence = torch.tensor([prompt + completion.token_ids], device=device)
        with torch.no_grad():
            reference = hf_model(sequence).logits[0].float().log_softmax(-1).cpu()
        assert completion.logprobs, "ask the engine for logprobs"
        worst = 0.0
        for step, logprobs in enumerate(completion.logprobs):
            row = reference[len(prompt) - 1 + step]
            assert logprobs.token_id == completion.token_ids[step] == int(row.argmax())
            ours = torch.tensor(logprobs.top_logprobs)
            theirs = row[torch.tensor(logprobs.top_token_ids)]
            worst = max(worst, float((ours - theirs).abs().max()))
        return worst

    return logprob_gap


@pytest.fixture(scope="session")
def hf_greedy() -> Callable[[Any, list[int], int], list[int]]:
    """`hf_greedy(model, prompt, n)`: transformers' forward and KV cache, argmax, never
    stopping at EOS. NOTE: not `generate` with eos_token_id=None, which switches on other
    logits processing and changes transformers' own greedy output."""
    import torch

    def hf_greedy(model: Any, prompt: list[int], num_tokens: int) -> list[int]:
        device = next(model.parameters()).device
        tokens: list[int] = []
        with torch.no_grad():
            out = model(torch.tensor([prompt], device=device), use_cache=True)
            for _ in range(num_tokens):
                tokens.append(int(out.logits[0, -1].argmax()))
                out = model(
                    torch.tensor([tokens[-1:]], device=device),
                    past_key_values=out.past_key_values,
                    use_cache=True,
                )
        return tokens

    return hf_greedy


@pytest.fixture
def kernel_launches(
    monkeypatch: pytest.MonkeyPatch,
) -> Callable[[Any, str], list[tuple[tuple[int, ...], dict[str, Any]]]]:
    """`kernel_launches(module, name)`: the Triton kernel `module.name` still launched as before,
    each launch's (grid, keyword arguments) recorded, in order, in the list returned."""

    def spy(module: Any, name: str) -> list[tuple[tuple[int, ...], dict[str, Any]]]:
        real = getattr(module, name)
        launches: list[tuple[tuple[int, ...], dict[str, Any]]] = []

        class Spy:
            def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., Any]:
                def launch(*args: Any, **kwargs: Any) -> Any:
                    launches.append((grid, kwargs))
                    return real[grid](*args, **kwargs)

                return launch

        monkeypatch.setattr(module, name, Spy())
        return launches

    return spy


@pytest.fixture(params=["token-major", "head-major"])
def block_layout(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """A cache block as a bf16 cache holds it ([slot, head, dim]), and head by head as an FP8
    cache does (K [head, slot, dim], V [head, dim, slot]; here in the float32 and float16
    caches the interpreter runs): kernels and the torch reference read and write either
    through `cache_views`."""
    if request.param == "head-major":
        from kvfleet.engine.attention import metadata

        monkeypatch.setattr(metadata, "head_major_blocks", lambda cache: True)
    return str(request.param)


@pytest.fixture(scope="session")
def attention_case() -> Callable[..., Any]:
    """`attention_case(query_lens, seq_lens, ...)`: random q/k/v, a paged KV cache whose blocks
    are shuffled across the pool (prefix tokens already written), and the step's metadata."""
    import torch

    from kvfleet.engine.attention.metadata import AttentionMetadata, leading_decodes

    def attention_case(
        query_lens: list[int],
        seq_lens: list[int],
        num_heads: int = 4,
        num_kv_heads: int = 2,
        head_dim: int = 32,
        block_size: int = 16,
        dtype: Any = None,
        device: str = "cpu",
        seed: int = 0,
    ) -> dict[str, Any]:
        dtype = dtype or torch.float32
        gen = torch.Generator().manual_seed(seed)
        blocks_per_seq = [-(-n // block_size) for n in seq_lens]
        num_blocks = sum(blocks_per_seq) + 3
        order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()  # block 0 is null
        tables, slots, taken = [], [], 0
        for query_len, seq_len, count in zip(query_lens, seq_lens, blocks_per_seq, strict=True):
            table = order[taken : taken + count]
            taken += count
            tables.append(table + [0] * (max(blocks_per_seq) - count))
            for pos in range(seq_len - query_len, seq_len):
                slots.append(table[pos // block_size] * block_size + pos % block_size)
        num_tokens = sum(query_lens)

        def randn(*shape: int) -> Any:
            return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

        kv_cache = randn(2, num_blocks, block_size, num_kv_heads, head_dim)  # prefix + junk
        cu = [0]
        for n in query_lens:
            cu.append(cu[-1] + n)
        metadata = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            max_seqlen_q=max(query_lens),
            max_seqlen_k=max(seq_lens),
            query_lens_cpu=list(query_lens),
            seq_lens_cpu=list(seq_lens),
            num_decodes=leading_decodes(query_lens),  # (as the step message counts them)
        )
        return {
            "q": randn(num_tokens, num_heads, head_dim),
            "k": randn(num_tokens, num_kv_heads, head_dim),
            "v": randn(num_tokens, num_kv_heads, head_dim),
            "kv_cache": kv_cache,
            "metadata": metadata,
        }

    return attention_case


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_peft_adapter(
    hf_model: Any,
    folder: Path,
    seed: int,
    rank: int = 8,
    targets: tuple[str, ...] = LORA_TARGETS,
    alpha: float | None = None,
    use_rslora: bool = False,
    strength: float = 0.5,
) -> Any:
    """Write a random (non-zero) PEFT LoRA adapter for `hf_model` to `folder`; return the
    reference: a copy of the model with the adapter merged into its weights."""
    import copy

    import peft
    import torch

    torch.manual_seed(seed)
    config = peft.LoraConfig(
        r=rank,
        lora_alpha=alpha if alpha is not None else 2 * rank,
        target_modules=list(targets),
        init_lora_weights=False,  # random B as well as A: the adapter changes the output
        use_rslora=use_rslora,
    )
    wrapped = peft.get_peft_model(copy.deepcopy(hf_model), config)
    with torch.no_grad():
        for name, param in wrapped.named_parameters():
            if "lora_" in name:
                param.mul_(strength)  # large enough to change outputs, small enough to stay sane
    wrapped.save_pretrained(str(folder))
    return wrapped.merge_and_unload().eval()


# A small Llama shape: random weights from it with load_format="dummy" (fast on the CPU).
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": False,
}


@pytest.fixture(scope="session")
def tiny_config(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`tiny_config(**changes)`: a config.json of TINY_LLAMA with those keys changed, written
    to a fresh folder; its path."""

    def write(**changes: Any) -> Path:
        path = tmp_path_factory.mktemp("tiny") / "config.json"
        path.write_text(json.dumps({**TINY_LLAMA, **changes}))
        return path

    return write
