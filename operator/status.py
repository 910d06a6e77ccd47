"""The one status builder: an LLMDeployment's status from its children's status.

Conditions keep their `lastTransitionTime` while their status stays the same, so building the
status again from unchanged children yields the same object (no write, no event).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from kvfleet.operator.common import ENGINE, OperatorConfig, Owner
from kvfleet.operator.spec import Condition, ConditionType, LLMDeploymentStatus, Phase

ConditionStatus = Literal["True", "False", "Unknown"]


@dataclass(frozen=True)
class RolloutState:
    """What a Deployment's status says, read defensively (a new Deployment has no status)."""

    replicas: int
    ready: int
    updated: int
    complete: bool  # the controller saw the newest template and every pod runs it
    stalled: str | None  # the Deployment's Progressing message when its deadline passed

    @classmethod
    def of(cls, deployment: Mapping[str, Any] | None, want: int) -> RolloutState:
        if deployment is None:
            return cls(0, 0, 0, False, None)
        status = deployment.get("status") or {}
        generation = deployment.get("metadata", {}).get("generation", 0)
        replicas = int(status.get("replicas", 0))
        updated = int(status.get("updatedReplicas", 0))
        seen = int(status.get("observedGeneration", 0)) >= generation
        stalled = None
        for condition in status.get("conditions") or []:
            if condition.get("reason") == "ProgressDeadlineExceeded":
                stalled = str(condition.get("message", "the rollout passed its deadline"))
        return cls(
            replicas=replicas,
            ready=int(status.get("availableReplicas", 0)),
            updated=updated,
            complete=seen and updated == want and replicas == want,
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
    rolling = not (engines.complete and gateways.complete)
    if engines.stalled or gateways.stalled:
        progress = condition(
            ConditionType.PROGRESSING,
            False,
            "ProgressDeadlineExceeded",
            engines.stalled or gateways.stalled or "",
        )
    elif rolling:
        progress = condition(
            ConditionType.PROGRESSING, True, "RollingOut", "engine or gateway pods are updating"
        )
    else:
        progress = condition(
            ConditionType.PROGRESSING, False, "RolloutComplete", "every pod runs the current spec"
        )
    ready = engine_ok and gateway_ok
    if want == 0:
        phase = Phase.SCALED_TO_ZERO
    elif ready and not rolling:
        phase = Phase.READY if engines.ready >= want else Phase.DEGRADED
    elif ready or engines.updated > 0:
        phase = Phase.PROGRESSING
    else:
        phase = Phase.PENDING
    conditions = [
        condition(
            ConditionType.READY,
            ready,
            "Serving"
            if ready
            else ("EngineUnavailable" if not engine_ok else "GatewayUnavailable"),
            f"{engine_message}; {gateway_message}",
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
    message: str, generation: int, previous: Sequence[Mapping[str, Any]], now: str
) -> dict[str, Any]:
    """The status of an object whose spec does not parse: Failed, with the reason on SpecValid and
    Ready. The children (if any) keep running the last valid spec."""
    conditions = [
        _condition(ConditionType.READY, "False", "InvalidSpec", message, generation, previous, now),
        _condition(
            ConditionType.SPEC_VALID, "False", "InvalidSpec", message, generation, previous, now
        ),
    ]
    status = LLMDeploymentStatus(
        phase=Phase.FAILED, observed_generation=generation, conditions=conditions
    )
    return status.model_dump(by_alias=True, mode="json", exclude_none=True)
