"""Where and how many engine pods run: tolerations, resources (GPUs, CPU, memory), autoscaling."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from kvfleet.operator.grammar import (
    QUALIFIED_NAME_PATTERN,
    RESOURCE_NAME_PATTERN,
)
from kvfleet.operator.spec_base import (
    CrdModel,
    IntOrQuantity,
    LabelValue,
    Quantity,
    cel_items,
    cel_rules,
)

EXISTS_HAS_NO_VALUE = "a toleration with operator Exists must have no value"


class Toleration(CrdModel):
    key: str | None = Field(
        default=None,
        pattern=QUALIFIED_NAME_PATTERN,
        max_length=317,
        description="the taint key (a label key); empty with Exists: every taint",
    )
    operator: Literal["Exists", "Equal"] | None = Field(
        default=None, description="Equal (the default) or Exists"
    )
    value: LabelValue | None = Field(default=None, description="the taint value, with Equal")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None, description="the taint effect to tolerate (empty: all)"
    )
    toleration_seconds: int | None = Field(
        default=None, description="NoExecute: how long the pod stays bound after the taint"
    )

    model_config = cel_rules(
        (
            "!has(self.operator) || self.operator != 'Exists' || !has(self.value)"
            " || self.value == ''",
            EXISTS_HAS_NO_VALUE,
            ".value",
        )
    )

    @model_validator(mode="after")
    def _exists_has_no_value(self) -> Toleration:
        if self.operator == "Exists" and self.value:
            raise ValueError(EXISTS_HAS_NO_VALUE)
        return self


NODE_SELECTOR_KEYS = "every nodeSelector key must be a label key (prefix/name)"


class ResourcesSpec(CrdModel):
    gpus: int | None = Field(
        default=None,
        ge=0,
        le=16,
        description="GPUs per replica (default tensorParallelSize; 0: CPU)",
    )
    gpu_type: LabelValue | None = Field(
        default=None,
        description=(
            "a value of the node label nvidia.com/gpu.product to schedule on, as the GPU feature "
            "discovery writes it (e.g. NVIDIA-H100-80GB-HBM3: a label value, no spaces)"
        ),
    )
    gpu_resource: str = Field(
        default="nvidia.com/gpu",
        pattern=RESOURCE_NAME_PATTERN,
        max_length=317,
        description="the extended resource name of the GPUs (domain/name)",
    )
    cpu: IntOrQuantity | None = Field(
        default=None, description="CPU request per replica (cores, or a quantity: 500m)"
    )
    memory: Quantity | None = Field(
        default=None, description="memory request and limit per replica (a quantity: 64Gi)"
    )
    shm_size: Quantity = Field(
        default="2Gi", description="/dev/shm size (NCCL needs room; a quantity)"
    )
    node_selector: dict[str, LabelValue] = Field(
        default_factory=dict,
        description="node labels the engine pods must match (keys label keys, values label values)",
        json_schema_extra=cel_items(
            f"self.all(k, size(k) <= 317 && k.matches('{QUALIFIED_NAME_PATTERN}'))",
            NODE_SELECTOR_KEYS,
        ),
    )
    tolerations: list[Toleration] = Field(
        default_factory=list, max_length=64, description="taints the engine pods tolerate"
    )

    @field_validator("node_selector")
    @classmethod
    def _label_keys(cls, selector: dict[str, str]) -> dict[str, str]:
        if not all(re.match(QUALIFIED_NAME_PATTERN, k) and len(k) <= 317 for k in selector):
            raise ValueError(NODE_SELECTOR_KEYS)
        return selector


MIN_ABOVE_MAX = "minReplicas must not exceed maxReplicas"


class AutoscalingSpec(CrdModel):
    enabled: bool = Field(default=False, description="the gateway scales replicas from engine load")
    min_replicas: int = Field(
        default=1,
        ge=0,
        le=1000,
        description=(
            "fewest engine replicas the autoscaler keeps (0: none after an idle down window; "
            "the next request brings one back)"
        ),
    )
    max_replicas: int = Field(default=4, ge=1, le=1000, description="most engine replicas")
    target_kv_cache_usage: float = Field(
        default=0.7, ge=0.05, le=1.0, description="mean KV-cache usage of ready replicas to keep"
    )
    target_queue_length: float = Field(
        default=2.0, ge=0.0, description="waiting requests per replica"
    )
    scale_down_window_seconds: int = Field(
        default=300,
        ge=0,
        le=3600,
        description=(
            "a scale-down happens only after every recommendation in this window agreed, and "
            "never before a gateway has watched the load for a whole window"
        ),
    )

    model_config = cel_rules(
        (
            "!has(self.minReplicas) || !has(self.maxReplicas)"
            " || self.minReplicas <= self.maxReplicas",
            MIN_ABOVE_MAX,
            ".minReplicas",
        )
    )

    @model_validator(mode="after")
    def _min_not_above_max(self) -> AutoscalingSpec:
        if self.min_replicas > self.max_replicas:
            raise ValueError(MIN_ABOVE_MAX)
        return self
