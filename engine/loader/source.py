"""ModelSource: what a `model` argument names: alias, GGUF file, folder, hub id or config."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from kvfleet.engine.config import ModelConfig
from kvfleet.engine.loader import model_cache

logger = logging.getLogger(__name__)

HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]


@dataclass(frozen=True)
class ModelSource:
    """A resolved model: `format` is "gguf" (path is the file), "hf" (a folder with config.json
    and safetensors) or "dummy" (path is a config.json, or a folder holding one)."""

    format: str
    path: Path
    name: str  # what the user asked for, as served under `model`

    @property
    def folder(self) -> Path:
        return self.path if self.path.is_dir() else self.path.parent

    def read_config(self) -> ModelConfig:
        if self.path.suffix == ".gguf":  # (also "dummy": random weights in a GGUF's shape)
            from kvfleet.engine.loader.gguf import read_gguf_config

            return read_gguf_config(self.path)
        config_path = self.path / "config.json" if self.path.is_dir() else self.path
        try:
            return ModelConfig.from_hf_config(json.loads(config_path.read_text()))
        except FileNotFoundError:
            raise ValueError(f"{self.name}: no config.json in {self.folder}") from None
        except KeyError as exc:
            raise ValueError(f"{config_path}: missing key {exc} in the model config") from None


CONFIGS_DIR = Path(__file__).resolve().parents[1] / "configs"


def builtin_configs() -> list[str]:
    """Model shapes shipped for `load_format="dummy"` (benchmarks at real shapes)."""
    return sorted(p.stem for p in CONFIGS_DIR.glob("*.json"))


def resolve_model_source(model: str, load_format: str = "auto") -> ModelSource:
    """Resolve a `model` argument, fetching a built-in alias or downloading a hub id if needed."""
    path = Path(model).expanduser()
    shipped = CONFIGS_DIR / f"{model}.json"
    if load_format == "dummy" and not path.exists() and shipped.is_file():
        return ModelSource("dummy", shipped, model)
    if model in model_cache.BUILTIN_MODELS and not path.exists():
        builtin = model_cache.BUILTIN_MODELS[model]
        cached, _ = model_cache.ModelCache(model_cache.kvfleet_home()).fetch(builtin)
        path = cached.path
    elif not path.exists():
        if model.count("/") != 1 or model.startswith((".", "/")):
            aliases = ", ".join(model_cache.BUILTIN_MODELS)
            configs = f" or a shipped config ({', '.join(builtin_configs())})"
            raise ValueError(
                f"model {model!r} is not a built-in alias ({aliases}), "
                "an existing file or folder, or a Hugging Face hub id (org/name)"
                + (configs if load_format == "dummy" else "")
            )
        path = _download_from_hub(model)
    if load_format == "dummy":
        return ModelSource("dummy", path, model)
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"{path}: a model file must be a .gguf (or use load_format='dummy')")
        return ModelSource("gguf", path, model)
    ggufs = sorted(path.glob("*.gguf"))
    if (
        load_format != "gguf"
        and (path / "config.json").is_file()
        and any(path.glob("*.safetensors"))
    ):
        return ModelSource("hf", path, model)
    if len(ggufs) == 1:
        return ModelSource("gguf", ggufs[0], model)
    raise ValueError(
        f"{path}: expected config.json with *.safetensors files, or exactly one .gguf file"
        + (f" (found {len(ggufs)})" if ggufs else "")
    )


def _download_from_hub(repo_id: str) -> Path:
    """Download a hub repository's config, weights and tokenizer (needs a network)."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError as exc:  # pragma: no cover - the engine extra installs it
        raise ValueError("huggingface_hub is needed to download models from the hub") from exc
    logger.info("downloading %s from the Hugging Face hub ...", repo_id)
    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_PATTERNS))
    except Exception as exc:
        raise ValueError(
            f"could not download {repo_id!r} from the Hugging Face hub: {exc}"
        ) from exc
