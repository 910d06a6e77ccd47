"""Engine configuration, the front door: the engine's settings (config/engine.py, one table
from which the `kvfleet engine` flags, `LLM(**kwargs)` and the operator's engine arguments
derive, config/settings.py) and the model's shape (config/model.py). Torch-free."""

from kvfleet.engine.config.engine import (
    ATTENTION_BACKENDS,
    DTYPES,
    LOAD_FORMATS,
    SPECULATIVE_METHODS,
    CacheConfig,
    EngineConfig,
    LoRAConfig,
    SchedulerConfig,
    SpeculativeConfig,
    engine_settings,
)
from kvfleet.engine.config.model import ROPE_TYPES, SUPPORTED_ARCHITECTURES, ModelConfig

__all__ = [
    "ATTENTION_BACKENDS",
    "DTYPES",
    "LOAD_FORMATS",
    "ROPE_TYPES",
    "SPECULATIVE_METHODS",
    "SUPPORTED_ARCHITECTURES",
    "CacheConfig",
    "EngineConfig",
    "LoRAConfig",
    "ModelConfig",
    "SchedulerConfig",
    "SpeculativeConfig",
    "engine_settings",
]
