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

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel
from pydantic.config import JsonDict

GROUP, VERSION, KIND, PLURAL, SHORT_NAME = (
    "kvfleet.dev",
    "v1alpha1",
    "LLMDeployment",
    "llmdeployments",
    "llmd",
)
API_VERSION = f"{GROUP}/{VERSION}"
# The longest child name appends "-gateway" (8) and Deployments add a pod-template hash and a
# pod suffix (17) to their pods' names, which stay within a 63-character DNS label.
MAX_NAME_LENGTH = 38

# Kubernetes resource quantity ("500m", "16Gi", "1.5") and duration ("15s", "1m").
QUANTITY_PATTERN = r"^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$"
DURATION_PATTERN = r"^[0-9]+(ms|s|m|h)$"
DNS_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
# alias ("smollm2"), hub id ("org/name", "hf://org/name"), URL, PVC path, or a path in the image.
MODEL_SOURCE_PATTERN = (
    r"^(pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?/.+|https?://[^\s]+|hf://[\w.-]+/[\w.-]+"
    r"|/[^\s]*|[A-Za-z0-9][\w.-]*(/[\w.-]+)?)$"
)
ADAPTER_SOURCE_PATTERN = r"^(pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?/.+|/[^\s]*)$"

Quantity = Annotated[str, Field(pattern=QUANTITY_PATTERN)]
IntOrQuantity = int | Quantity


class CrdModel(BaseModel):
    """camelCase fields in the resource, snake_case in Python; unknown fields are an error."""

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True
    )


def cel_rule(rule: str, message: str, field_path: str) -> ConfigDict:
    """A model's cross-field rule for the API server (CEL, `x-kubernetes-validations`); the
    model enforces the same in a validator with the same message."""
    validation: JsonDict = {"rule": rule, "message": message, "fieldPath": field_path}
    return ConfigDict(json_schema_extra={"x-kubernetes-validations": [validation]})


class LoadFormat(enum.StrEnum):
    AUTO = "auto"
    HF = "hf"
    GGUF = "gguf"
    DUMMY = "dummy"  # random weights at a real shape (benchmarks)


class Dtype(enum.StrEnum):
    AUTO = "auto"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"
    FLOAT32 = "float32"


class KVCacheDtype(enum.StrEnum):
    AUTO = "auto"  # the model's dtype; the engine keeps its KV cache in it


class RoutingPolicy(enum.StrEnum):
    PREFIX = "prefix"
    LEAST_LOAD = "least-load"
    ROUND_ROBIN = "round-robin"


class ServiceType(enum.StrEnum):
    CLUSTER_IP = "ClusterIP"
    NODE_PORT = "NodePort"
    LOAD_BALANCER = "LoadBalancer"


class PullPolicy(enum.StrEnum):
    IF_NOT_PRESENT = "IfNotPresent"
    ALWAYS = "Always"
    NEVER = "Never"


class SecretKeyRef(CrdModel):
    name: str = Field(pattern=DNS_LABEL_PATTERN, max_length=253, description="a Secret's name")
    key: str = Field(min_length=1, description="the key inside the Secret")


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
        default=None, min_length=1, description="the name clients send as `model` (default: source)"
    )
    load_format: LoadFormat = Field(default=LoadFormat.AUTO, description="dummy: random weights")
    tokenizer: str | None = Field(default=None, description="a tokenizer other than the model's")
    sha256: str | None = Field(
        default=None,
        pattern=r"^[0-9a-f]{64}$",
        description="checked after downloading a URL source",
    )
    hub_token_secret: SecretKeyRef | None = Field(
        default=None,
        description="Secret key holding a Hugging Face token (HF_TOKEN) for gated models",
    )
    cache_size: Quantity = Field(default="50Gi", description="size limit of the model cache volume")


class SpeculativeMethod(enum.StrEnum):
    NGRAM = "ngram"
    DRAFT = "draft"


class SpeculativeSpec(CrdModel):
    method: SpeculativeMethod
    num_speculative_tokens: int = Field(default=4, ge=1, le=16)
    draft_model: str | None = Field(default=None, description="draft method: the proposer model")
    prompt_lookup_min: int | None = Field(default=None, ge=1, le=16, description="ngram: min n")
    prompt_lookup_max: int | None = Field(default=None, ge=1, le=16, description="ngram: max n")

    model_config = cel_rule(
        "self.method != 'draft' || has(self.draftModel)",
        "method draft needs draftModel",
        ".draftModel",
    )

    @model_validator(mode="after")
    def _draft_needs_model(self) -> SpeculativeSpec:
        if self.method is SpeculativeMethod.DRAFT and self.draft_model is None:
            raise ValueError("method draft needs draftModel")
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
    dtype: Dtype = Dtype.AUTO
    max_model_len: int | None = Field(default=None, ge=16, le=1 << 20)
    block_size: Literal[8, 16, 32, 64] = 16
    kv_cache_dtype: KVCacheDtype = KVCacheDtype.AUTO
    prefix_caching: bool = True
    max_num_seqs: int = Field(default=256, ge=1, le=4096)
    max_num_batched_tokens: int = Field(default=2048, ge=16, le=1 << 20)
    gpu_memory_utilization: float = Field(default=0.9, ge=0.05, le=0.99)
    speculative: SpeculativeSpec | None = None
    extra_args: list[str] = Field(
        default_factory=list, description="more `kvfleet engine` arguments, passed as given"
    )


class Toleration(CrdModel):
    key: str | None = None
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None


class ResourcesSpec(CrdModel):
    gpus: int | None = Field(
        default=None,
        ge=0,
        le=16,
        description="GPUs per replica (default tensorParallelSize; 0: CPU)",
    )
    gpu_type: str | None = Field(
        default=None,
        description="node label nvidia.com/gpu.product to schedule on (e.g. NVIDIA-H100)",
    )
    gpu_resource: str = Field(default="nvidia.com/gpu", description="the extended resource name")
    cpu: IntOrQuantity | None = Field(default=None, description="CPU request per replica")
    memory: Quantity | None = Field(
        default=None, description="memory request and limit per replica"
    )
    shm_size: Quantity = Field(default="2Gi", description="/dev/shm size (NCCL needs room)")
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[Toleration] = Field(default_factory=list)


class AutoscalingSpec(CrdModel):
    enabled: bool = Field(default=False, description="the gateway scales replicas from engine load")
    min_replicas: int = Field(default=1, ge=0, le=1000)
    max_replicas: int = Field(default=4, ge=1, le=1000)
    target_kv_cache_usage: float = Field(default=0.7, ge=0.05, le=1.0)
    target_queue_length: float = Field(
        default=2.0, ge=0.0, description="waiting requests per replica"
    )
    scale_down_window_seconds: int = Field(default=300, ge=0, le=3600)

    model_config = cel_rule(
        "self.minReplicas <= self.maxReplicas",
        "minReplicas must not exceed maxReplicas",
        ".minReplicas",
    )

    @model_validator(mode="after")
    def _min_not_above_max(self) -> AutoscalingSpec:
        if self.min_replicas > self.max_replicas:
            raise ValueError("minReplicas must not exceed maxReplicas")
        return self


class LoRAAdapterSpec(CrdModel):
    name: str = Field(pattern=r"^[A-Za-z0-9][\w.-]*$", max_length=128)
    source: str = Field(
        pattern=ADAPTER_SOURCE_PATTERN,
        description="a PEFT adapter folder: pvc://CLAIM/PATH or a path in the engine image",
    )


class LoRASpec(CrdModel):
    max_loras: int = Field(default=4, ge=1, le=256, description="adapters in GPU slots at once")
    max_cpu_loras: int | None = Field(default=None, ge=1, le=4096)
    max_lora_rank: Literal[8, 16, 32, 64, 128] = 16
    adapters: list[LoRAAdapterSpec] = Field(default_factory=list, max_length=256)


class RateLimits(CrdModel):
    requests_per_minute: float | None = Field(default=None, ge=0)
    tokens_per_minute: float | None = Field(default=None, ge=0)


class GatewayResources(CrdModel):
    cpu: IntOrQuantity = "1"
    memory: Quantity = "1Gi"


class GatewaySpec(CrdModel):
    replicas: int = Field(default=1, ge=0, le=100)
    routing_policy: RoutingPolicy = RoutingPolicy.PREFIX
    max_imbalance: float = Field(default=8.0, ge=0.0)
    rate_limits: RateLimits = Field(default_factory=RateLimits, description="per API key")
    api_keys_secret: SecretKeyRef | None = Field(
        default=None, description="Secret key holding the hashed API keys file (default: open mode)"
    )
    service_type: ServiceType = ServiceType.CLUSTER_IP
    port: int = Field(default=80, ge=1, le=65535)
    max_inflight_per_replica: int = Field(default=256, ge=1)
    queue_capacity: int = Field(default=4096, ge=0)
    queue_timeout_seconds: float = Field(default=60.0, gt=0)
    resources: GatewayResources = Field(default_factory=GatewayResources)


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
    engine: str | None = Field(default=None, description="default: the operator's engine image")
    gateway: str | None = Field(default=None, description="default: the operator's gateway image")
    pull_policy: PullPolicy = PullPolicy.IF_NOT_PRESENT
    pull_secrets: list[str] = Field(default_factory=list)


class LLMDeploymentSpec(CrdModel):
    model: ModelSpec
    engine: EngineSpec = Field(default_factory=EngineSpec)
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    replicas: int = Field(
        default=1, ge=0, le=1000, description="engine replicas (the scale subresource)"
    )
    autoscaling: AutoscalingSpec = Field(default_factory=AutoscalingSpec)
    lora: LoRASpec | None = Field(default=None, description="serve LoRA adapters (multi-LoRA)")
    gateway: GatewaySpec = Field(default_factory=GatewaySpec)
    monitoring: MonitoringSpec = Field(default_factory=MonitoringSpec)
    images: ImagesSpec = Field(default_factory=ImagesSpec)

    model_config = cel_rule(
        (
            "!has(self.resources.gpus) || self.resources.gpus == 0"
            " || self.resources.gpus >= self.engine.tensorParallelSize"
        ),
        "resources.gpus must be 0 (CPU) or at least tensorParallelSize",
        ".resources.gpus",
    )

    @model_validator(mode="after")
    def _gpus_cover_tensor_parallelism(self) -> LLMDeploymentSpec:
        gpus = self.resources.gpus
        if gpus is not None and 0 < gpus < self.engine.tensor_parallel_size:
            raise ValueError("resources.gpus must be 0 (CPU) or at least tensorParallelSize")
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


class Phase(enum.StrEnum):
    PENDING = "Pending"  # children created, nothing ready yet
    PROGRESSING = "Progressing"  # a rollout or scale is under way
    READY = "Ready"
    DEGRADED = "Degraded"  # serving, with fewer ready replicas than wanted
    SCALED_TO_ZERO = "ScaledToZero"
    FAILED = "Failed"  # the spec is invalid; nothing was changed


class ConditionType(enum.StrEnum):
    READY = "Ready"  # the endpoint answers: engines and gateway available
    SPEC_VALID = "SpecValid"
    ENGINE_AVAILABLE = "EngineAvailable"
    GATEWAY_AVAILABLE = "GatewayAvailable"
    PROGRESSING = "Progressing"


class Condition(CrdModel):
    type: ConditionType
    status: Literal["True", "False", "Unknown"]
    reason: str = Field(pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$", max_length=1024)
    message: str = Field(default="", max_length=32768)
    last_transition_time: str = Field(description="RFC 3339")
    observed_generation: int | None = Field(default=None, ge=0)


class LLMDeploymentStatus(CrdModel):
    phase: Phase | None = None
    replicas: int | None = Field(default=None, ge=0, description="engine pods (scale subresource)")
    ready_replicas: int | None = Field(default=None, ge=0)
    updated_replicas: int | None = Field(default=None, ge=0)
    selector: str | None = Field(default=None, description="engine pods' label selector (scale)")
    endpoint: str | None = Field(default=None, description="the OpenAI base URL inside the cluster")
    observed_generation: int | None = Field(default=None, ge=0)
    conditions: list[Condition] = Field(default_factory=list)


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
