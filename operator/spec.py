"""The `LLMDeployment` custom resource (`kvfleet.dev/v1alpha1`): spec and status as pydantic models.

These models are the single source of truth: `crd.py` turns them into the checked-in CRD's
structural schema, and the operator parses every object through them before it builds anything.
Field names are the CRD's (camelCase through aliases); Python code uses snake_case.

NOTE: a rule the API server must enforce across fields goes in `x-kubernetes-validations` (CEL)
*and* in a pydantic validator with the same message, so `kubectl apply` and the operator agree.
"""

from __future__ import annotations

import enum
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from kvfleet.operator.grammar import (
    DNS_SUBDOMAIN_PATTERN,
    DURATION_PATTERN,
)
from kvfleet.operator.spec_base import (
    ADAPTER_SOURCE_PATTERN,
    MODEL_SOURCE_PATTERN,
    CrdModel,
    Dtype,
    IntOrQuantity,
    KVCacheDtype,
    LoadFormat,
    PullPolicy,
    Quantity,
    Quantization,
    RoutingPolicy,
    ServiceType,
    cel_rules,
)
from kvfleet.operator.spec_pods import (
    AutoscalingSpec,
    ResourcesSpec,
)


class SecretKeyRef(CrdModel):
    name: str = Field(pattern=DNS_SUBDOMAIN_PATTERN, max_length=253, description="Secret name")
    key: str = Field(min_length=1, max_length=253, description="the key inside the Secret")


class ModelSpec(CrdModel):
    source: str = Field(
        pattern=MODEL_SOURCE_PATTERN,
        description=(
            "What to serve: a built-in alias (smollm2), a Hugging Face hub id (org/name or "
            "hf://org/name), an http(s) URL of a .gguf file, pvc://CLAIM/PATH, or a path in the "
            "engine image. With loadFormat dummy: a shipped config (llama-3-8b, llama-3-70b)."
        ),
    )
    served_model_name: str | None = Field(
        default=None,
        min_length=1,
        max_length=256,
        description="the name clients send as `model` (default: source)",
    )
    load_format: LoadFormat = Field(
        default=LoadFormat.AUTO,
        description="auto (from the source), hf, gguf, or dummy (random weights at a real shape)",
    )
    tokenizer: str | None = Field(
        default=None, description="a tokenizer other than the model's (hub id or path)"
    )
    sha256: str | None = Field(
        default=None,
        pattern=r"^[0-9a-f]{64}$",
        description="checked after downloading a URL source",
    )
    hub_token_secret: SecretKeyRef | None = Field(
        default=None,
        description="Secret key holding a Hugging Face token (HF_TOKEN) for gated models",
    )
    cache_size: Quantity = Field(
        default="50Gi", description="size limit of the model cache volume (a quantity)"
    )


class SpeculativeMethod(enum.StrEnum):
    NGRAM = "ngram"
    DRAFT = "draft"


DRAFT_NEEDS_MODEL = "method draft needs draftModel"


class SpeculativeSpec(CrdModel):
    method: SpeculativeMethod = Field(
        description="ngram (prompt lookup) or draft (a smaller model of the same tokenizer)"
    )
    num_speculative_tokens: int = Field(
        default=4, ge=1, le=16, description="draft tokens proposed per step at most"
    )
    draft_model: str | None = Field(
        default=None, description="method draft: the proposer model (alias, hub id or path)"
    )
    prompt_lookup_min: int | None = Field(
        default=None, ge=1, le=16, description="method ngram: the shortest n-gram looked up"
    )
    prompt_lookup_max: int | None = Field(
        default=None, ge=1, le=16, description="method ngram: the longest n-gram looked up"
    )

    model_config = cel_rules(
        ("self.method != 'draft' || has(self.draftModel)", DRAFT_NEEDS_MODEL, ".draftModel")
    )

    @model_validator(mode="after")
    def _draft_needs_model(self) -> SpeculativeSpec:
        if self.method is SpeculativeMethod.DRAFT and self.draft_model is None:
            raise ValueError(DRAFT_NEEDS_MODEL)
        return self

    def engine_config(self) -> dict[str, Any]:
        """The engine's `--speculative-config` JSON (snake_case keys, as vLLM takes them; the
        draft model under "model")."""
        config = self.model_dump(mode="json", exclude_none=True)
        if "draft_model" in config:
            config["model"] = config.pop("draft_model")
        return config


class EngineSpec(CrdModel):
    tensor_parallel_size: Literal[1, 2, 4, 8] = Field(
        default=1, description="GPUs one replica spans (a power of two)"
    )
    dtype: Dtype = Field(
        default=Dtype.AUTO, description="weights and activations: auto (the checkpoint's) or one"
    )
    max_model_len: int | None = Field(
        default=None,
        ge=16,
        le=1 << 20,
        description="longest prompt + output in tokens (default: the model's context)",
    )
    block_size: Literal[8, 16, 32, 64] = Field(
        default=16, description="tokens per KV-cache block (also the prefix cache's unit)"
    )
    quantization: Quantization | None = Field(
        default=None,
        description="fp8: quantize a bf16/fp16 checkpoint at load (GPUs of compute capability "
        "8.9+); rtn: INT4 weights rounded at load; gguf: a GGUF file's Q4_0/Q4_1/Q4_K layers kept "
        "4-bit and Q8_0 layers 8-bit; awq, gptq: must agree with the checkpoint; "
        "unset: the checkpoint's own quantization, if any",
    )
    kv_cache_dtype: KVCacheDtype = Field(
        default=KVCacheDtype.AUTO,
        description="KV-cache element type (auto: the model's dtype; fp8: e4m3, twice the tokens)",
    )
    prefix_caching: bool = Field(
        default=True, description="reuse the KV cache of prompts' shared prefixes"
    )
    max_num_seqs: int = Field(
        default=256, ge=1, le=4096, description="requests batched in one step at most"
    )
    max_num_batched_tokens: int = Field(
        default=2048,
        ge=16,
        le=1 << 20,
        description="tokens per step at most (the chunked-prefill budget)",
    )
    gpu_memory_utilization: float = Field(
        default=0.9,
        ge=0.05,
        le=0.99,
        description="share of GPU memory for weights, activations and the KV cache",
    )
    speculative: SpeculativeSpec | None = Field(
        default=None, description="speculative decoding: draft tokens verified in one forward"
    )
    extra_args: list[str] = Field(
        default_factory=list, description="more `kvfleet engine` arguments, passed as given"
    )


class LoRAAdapterSpec(CrdModel):
    name: str = Field(
        pattern=r"^[A-Za-z0-9][\w.-]*$",
        max_length=128,
        description="the name clients send as `model` to use the adapter",
    )
    source: str = Field(
        pattern=ADAPTER_SOURCE_PATTERN,
        description="a PEFT adapter folder: pvc://CLAIM/PATH or a path in the engine image",
    )


class LoRASpec(CrdModel):
    max_loras: int = Field(default=4, ge=1, le=256, description="adapters in GPU slots at once")
    max_cpu_loras: int | None = Field(
        default=None, ge=1, le=4096, description="adapters kept in host memory (default maxLoras)"
    )
    max_lora_rank: Literal[8, 16, 32, 64, 128] = Field(
        default=16, description="the largest adapter rank the engine accepts"
    )
    adapters: list[LoRAAdapterSpec] = Field(
        default_factory=list,
        max_length=256,
        description="adapters the gateway loads onto a replica when a request names one",
    )


class RateLimits(CrdModel):
    requests_per_minute: float | None = Field(
        default=None, ge=0, description="requests per API key per minute, for the whole gateway"
    )
    tokens_per_minute: float | None = Field(
        default=None,
        ge=0,
        description="prompt + max_tokens per API key per minute, for the whole gateway",
    )


class GatewayResources(CrdModel):
    cpu: IntOrQuantity = Field(default="1", description="CPU request per gateway pod")
    memory: Quantity = Field(default="1Gi", description="memory request and limit per gateway pod")


class GatewaySpec(CrdModel):
    replicas: int = Field(default=1, ge=0, le=100, description="gateway pods")
    routing_policy: RoutingPolicy = Field(
        default=RoutingPolicy.PREFIX,
        description="prefix (the replica holding the prompt's prefix), least-load, round-robin",
    )
    max_imbalance: float = Field(
        default=8.0,
        ge=0.0,
        description="requests by which a prefix choice may exceed the least-loaded replica's load",
    )
    rate_limits: RateLimits = Field(
        default_factory=RateLimits, description="default limits per API key"
    )
    api_keys_secret: SecretKeyRef | None = Field(
        default=None, description="Secret key holding the hashed API keys file (default: open mode)"
    )
    service_type: ServiceType = Field(
        default=ServiceType.CLUSTER_IP, description="the endpoint Service's type"
    )
    port: int = Field(default=80, ge=1, le=65535, description="the endpoint Service's port")
    max_inflight_per_replica: int = Field(
        default=256, ge=1, description="requests proxied at once per engine replica"
    )
    queue_capacity: int = Field(
        default=4096, ge=0, description="requests waiting at the gateway at most (then 503)"
    )
    queue_timeout_seconds: float = Field(
        default=60.0, gt=0, description="how long a request may wait in the queue (then 503)"
    )
    activation_timeout_seconds: float = Field(
        default=300.0,
        gt=0,
        le=3600,
        description=(
            "autoscaling: how long a request waits for an engine when none is ready (at zero "
            "replicas the gateway scales to one); then 503"
        ),
    )
    resources: GatewayResources = Field(
        default_factory=GatewayResources, description="CPU and memory of each gateway pod"
    )


# TTFT thresholds a latency SLO can use: bounds of the gateway's TTFT histogram buckets, so the
# share of requests under the threshold is read off one bucket exactly.
TTFT_THRESHOLDS = {"100ms": 0.1, "250ms": 0.25, "500ms": 0.5, "1s": 1.0, "2.5s": 2.5, "5s": 5.0}


class SLOSpec(CrdModel):
    availability: float = Field(
        default=0.999, ge=0.9, le=0.99999, description="objective: share of non-5xx answers"
    )
    latency: float = Field(
        default=0.99, ge=0.5, le=0.99999, description="objective: share of streams under the TTFT"
    )
    ttft_threshold: Literal["100ms", "250ms", "500ms", "1s", "2.5s", "5s"] = Field(
        default="1s", description="time to first token a stream must beat (a histogram bucket)"
    )

    @property
    def ttft_threshold_seconds(self) -> float:
        return TTFT_THRESHOLDS[self.ttft_threshold]


class MonitoringSpec(CrdModel):
    enabled: bool = Field(
        default=True,
        description="PodMonitor/ServiceMonitor and PrometheusRule, when their CRDs exist",
    )
    interval: str = Field(default="15s", pattern=DURATION_PATTERN, description="scrape interval")
    slo: SLOSpec = Field(default_factory=SLOSpec, description="SLOs with burn-rate alerts")


class ImagesSpec(CrdModel):
    engine: str | None = Field(
        default=None, min_length=1, description="default: the operator's engine image"
    )
    gateway: str | None = Field(
        default=None, min_length=1, description="default: the operator's gateway image"
    )
    pull_policy: PullPolicy = Field(
        default=PullPolicy.IF_NOT_PRESENT, description="the containers' imagePullPolicy"
    )
    pull_secrets: list[Annotated[str, Field(pattern=DNS_SUBDOMAIN_PATTERN, max_length=253)]] = (
        Field(default_factory=list, description="names of Secrets to pull the images with")
    )


GPUS_COVER_TP = "resources.gpus must be 0 (CPU) or at least tensorParallelSize"
LORA_NEEDS_TP1 = (
    "lora needs tensorParallelSize 1: the engine does not combine LoRA with tensor parallelism yet"
)


class LLMDeploymentSpec(CrdModel):
    model: ModelSpec = Field(description="the model to serve and where it comes from")
    engine: EngineSpec = Field(default_factory=EngineSpec, description="engine settings")
    resources: ResourcesSpec = Field(
        default_factory=ResourcesSpec, description="GPUs, CPU, memory and placement per replica"
    )
    replicas: int = Field(
        default=1, ge=0, le=1000, description="engine replicas (the scale subresource)"
    )
    autoscaling: AutoscalingSpec = Field(
        default_factory=AutoscalingSpec, description="the gateway scales replicas from engine load"
    )
    lora: LoRASpec | None = Field(default=None, description="serve LoRA adapters (multi-LoRA)")
    gateway: GatewaySpec = Field(
        default_factory=GatewaySpec, description="the OpenAI endpoint in front of the engines"
    )
    monitoring: MonitoringSpec = Field(
        default_factory=MonitoringSpec, description="scraping, SLOs and alerts"
    )
    images: ImagesSpec = Field(
        default_factory=ImagesSpec, description="container images (default: the operator's)"
    )

    model_config = cel_rules(
        (
            "!has(self.resources.gpus) || self.resources.gpus == 0"
            " || self.resources.gpus >= self.engine.tensorParallelSize",
            GPUS_COVER_TP,
            ".resources.gpus",
        ),
        ("!has(self.lora) || self.engine.tensorParallelSize == 1", LORA_NEEDS_TP1, ".lora"),
    )

    @model_validator(mode="after")
    def _cross_field_rules(self) -> LLMDeploymentSpec:
        gpus = self.resources.gpus
        if gpus is not None and 0 < gpus < self.engine.tensor_parallel_size:
            raise ValueError(GPUS_COVER_TP)
        if self.lora is not None and self.engine.tensor_parallel_size != 1:
            raise ValueError(LORA_NEEDS_TP1)
        return self

    @property
    def gpus(self) -> int:
        """GPUs per engine replica."""
        if self.resources.gpus is None:
            return self.engine.tensor_parallel_size
        return self.resources.gpus

    @property
    def served_model_name(self) -> str:
        return self.model.served_model_name or self.model.source.removeprefix("hf://")

    @property
    def engine_replicas(self) -> int:
        """What the engine Deployment runs: spec.replicas, kept within the autoscaling bounds."""
        if not self.autoscaling.enabled:
            return self.replicas
        low, high = self.autoscaling.min_replicas, self.autoscaling.max_replicas
        return min(max(self.replicas, low), high)


class InvalidSpecError(ValueError):
    """The object's spec does not parse; the message names each bad field."""


def parse_spec(spec: Any) -> LLMDeploymentSpec:
    """The spec of an LLMDeployment, or InvalidSpecError with one line per bad field."""
    from pydantic import ValidationError

    try:
        return LLMDeploymentSpec.model_validate(spec)
    except ValidationError as exc:
        lines = []
        for error in exc.errors():
            where = ".".join(["spec", *(str(p) for p in error["loc"])])
            lines.append(f"{where}: {error['msg']}")
        raise InvalidSpecError("; ".join(lines)) from None
