"""The LLMDeployment's status as the CRD declares it: its phases, condition types, conditions.
`status.py` builds it from the children; `crd.py` turns it into the status schema."""

from __future__ import annotations

import enum
from typing import Literal

from pydantic import Field

from kvfleet.operator.spec_base import CrdModel


class Phase(enum.StrEnum):
    PENDING = "Pending"  # nothing serves yet: pods are being scheduled, pulled or loaded
    PROGRESSING = "Progressing"  # serving while a rollout or scale-up is under way
    READY = "Ready"
    DEGRADED = "Degraded"  # serving, with fewer ready replicas than wanted, or a rollout stalled
    SCALED_TO_ZERO = "ScaledToZero"
    # the spec is invalid or the API server refused a child (nothing was changed), or nothing
    # serves and the rollout passed its progress deadline
    FAILED = "Failed"


class ConditionType(enum.StrEnum):
    READY = "Ready"  # the endpoint answers: engines and gateway available
    SPEC_VALID = "SpecValid"
    ENGINE_AVAILABLE = "EngineAvailable"
    GATEWAY_AVAILABLE = "GatewayAvailable"
    PROGRESSING = "Progressing"
    SCALING_LIMITED = "ScalingLimited"  # spec.replicas is outside the autoscaling bounds


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
