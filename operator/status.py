"""The one status builder: an LLMDeployment's status from its children's status.

Conditions keep their `lastTransitionTime` while their status stays the same, so building the
status again from unchanged children yields the same object (no write, no event).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from kvfleet.operator.common import ENGINE, OperatorConfig, Owner
from kvfleet.operator.conditions import Condition, ConditionType, LLMDeploymentStatus, Phase
from kvfleet.operator.spec import LLMDeploymentSpec

ConditionStatus = Literal["True", "False", "Unknown"]


@dataclass(frozen=True)
class RolloutState:
    """What a Deployment's status says, read defensively (a new Deployment has no status)."""

    replicas: int
    ready: int
    updated: int
    complete: bool  # the controller saw the newest template and its rollout finished
    stalled: str | None  # the Deployment's Progressing message when its deadline passed

    @classmethod
    def of(cls, deployment: Mapping[str, Any] | None, want: int) -> RolloutState:
        if deployment is None:
            return cls(0, 0, 0, False, None)
        status = deployment.get("status") or {}
        generation = deployment.get("metadata", {}).get("generation", 0)
        replicas = int(status.get("replicas", 0))
        updated = int(status.get("updatedReplicas", 0))
        ready = int(status.get("availableReplicas", 0))
        seen = int(status.get("observedGeneration", 0)) >= generation
        progress = {}
        for condition in status.get("conditions") or []:
            if condition.get("type") == "Progressing":
                progress = condition
        stalled = None
        if progress.get("reason") == "ProgressDeadlineExceeded":
            stalled = str(progress.get("message") or "the rollout passed its progress deadline")
        # The controller's own verdict where it gave one: NewReplicaSetAvailable stays after a
        # finished rollout even if a pod is lost later (that is Degraded, not Progressing).
        finished = progress.get("reason") == "NewReplicaSetAvailable" if progress else ready == want
        return cls(
            replicas=replicas,
            ready=ready,
            updated=updated,
            complete=seen and updated == want and replicas == want and finished,
            stalled=stalled,
        )


def _condition(
    kind: ConditionType,
    status: ConditionStatus,
    reason: str,
    message: str,
    generation: int,
    previous: Sequence[Mapping[str, Any]],
    now: str,
) -> Condition:
    since = now
    for old in previous:
        if old.get("type") == kind and old.get("status") == status:
            since = str(old.get("lastTransitionTime", now))
    return Condition(
        type=kind,
        status=status,
        reason=reason,
        message=message,
        last_transition_time=since,
        observed_generation=generation,
    )


def _phase(want: int, serving: bool, rolling: bool, stalled: bool, all_ready: bool) -> Phase:
    """The one-word summary; it never contradicts the conditions (a test checks every case)."""
    if want == 0:
        return Phase.SCALED_TO_ZERO
    if stalled:
        return Phase.DEGRADED if serving else Phase.FAILED
    if rolling:
        return Phase.PROGRESSING if serving else Phase.PENDING
    return Phase.READY if all_ready else Phase.DEGRADED


def scaling_limited(spec: LLMDeploymentSpec) -> tuple[bool, str, str]:
    """(limited, reason, message): whether spec.replicas (`kubectl scale`, HPA) lies outside
    the autoscaling bounds, so the engines run a clamped count."""
    scaling, replicas = spec.autoscaling, spec.replicas
    if not scaling.enabled:
        return False, "AutoscalingDisabled", f"spec.replicas {replicas} runs as asked"
    if replicas > scaling.max_replicas:
        return (
            True,
            "AboveMaxReplicas",
            f"spec.replicas {replicas} is above autoscaling.maxReplicas "
            f"{scaling.max_replicas}: {scaling.max_replicas} engine replicas run",
        )
    if replicas < scaling.min_replicas:
        return (
            True,
            "BelowMinReplicas",
            f"spec.replicas {replicas} is below autoscaling.minReplicas "
            f"{scaling.min_replicas}: {scaling.min_replicas} engine replicas run",
        )
    return False, "WithinBounds", f"spec.replicas {replicas} is within the autoscaling bounds"


def build_status(
    owner: Owner,
    config: OperatorConfig,
    engine: Mapping[str, Any] | None,
    gateway: Mapping[str, Any] | None,
    previous: Sequence[Mapping[str, Any]],
    now: str,
) -> dict[str, Any]:
    """Status from the engine and gateway Deployments (None: not created yet)."""
    spec, generation = owner.spec, owner.generation
    want = spec.engine_replicas
    engines = RolloutState.of(engine, want)
    gateways = RolloutState.of(gateway, spec.gateway.replicas)

    def condition(kind: ConditionType, ok: bool, reason: str, message: str) -> Condition:
        return _condition(
            kind, "True" if ok else "False", reason, message, generation, previous, now
        )

    if want == 0:
        engine_ok, engine_reason = False, "ScaledToZero"
    elif engines.ready > 0:
        engine_ok, engine_reason = True, "MinimumReplicasAvailable"
    else:
        engine_ok, engine_reason = False, "NoReplicaReady"
    engine_message = f"{engines.ready}/{want} engine replicas ready"
    gateway_ok = gateways.ready > 0
    gateway_message = f"{gateways.ready}/{spec.gateway.replicas} gateway replicas ready"
    stalled = engines.stalled or gateways.stalled
    rolling = not (engines.complete and gateways.complete)
    serving = engine_ok and gateway_ok
    if stalled:
        progress = condition(ConditionType.PROGRESSING, False, "ProgressDeadlineExceeded", stalled)
    elif rolling:
        progress = condition(
            ConditionType.PROGRESSING,
            True,
            "RollingOut",
            "engine or gateway pods are being updated or started",
        )
    else:
        progress = condition(
            ConditionType.PROGRESSING, False, "RolloutComplete", "every pod runs the current spec"
        )
    all_ready = engines.ready >= want and gateways.ready >= spec.gateway.replicas
    phase = _phase(want, serving, rolling, stalled is not None, all_ready)
    if serving:
        ready_reason = "Serving"
    elif want == 0:
        ready_reason = "ScaledToZero"
    elif stalled:
        ready_reason = "ProgressDeadlineExceeded"
    else:
        ready_reason = "EngineUnavailable" if not engine_ok else "GatewayUnavailable"
    limited, limit_reason, limit_message = scaling_limited(spec)
    conditions = [
        condition(
            ConditionType.READY, serving, ready_reason, f"{engine_message}; {gateway_message}"
        ),
        condition(ConditionType.SPEC_VALID, True, "Accepted", "the spec is valid"),
        condition(ConditionType.ENGINE_AVAILABLE, engine_ok, engine_reason, engine_message),
        condition(
            ConditionType.GATEWAY_AVAILABLE,
            gateway_ok,
            "MinimumReplicasAvailable" if gateway_ok else "NoReplicaReady",
            gateway_message,
        ),
        progress,
        condition(ConditionType.SCALING_LIMITED, limited, limit_reason, limit_message),
    ]
    selector = ",".join(f"{k}={v}" for k, v in owner.selector(ENGINE).items())
    status = LLMDeploymentStatus(
        phase=phase,
        replicas=engines.replicas,
        ready_replicas=engines.ready,
        updated_replicas=engines.updated,
        selector=selector,
        endpoint=owner.endpoint(config),
        observed_generation=generation,
        conditions=conditions,
    )
    return status.model_dump(by_alias=True, mode="json", exclude_none=True)


def invalid_spec_status(
    message: str,
    generation: int,
    previous: Sequence[Mapping[str, Any]],
    now: str,
    reason: str = "InvalidSpec",
) -> dict[str, Any]:
    """The status of an object whose spec cannot be served: it does not parse (InvalidSpec), or
    the API server refused a child built from it (ChildRejected). Failed, with the reason on
    SpecValid and Ready; the children (if any) keep running the last spec that worked."""
    conditions = [
        _condition(ConditionType.READY, "False", reason, message, generation, previous, now),
        _condition(ConditionType.SPEC_VALID, "False", reason, message, generation, previous, now),
    ]
    status = LLMDeploymentStatus(
        phase=Phase.FAILED, observed_generation=generation, conditions=conditions
    )
    return status.model_dump(by_alias=True, mode="json", exclude_none=True)
