"""Reconciling one LLMDeployment: desired children from its spec, applied; status from the children.

Everything here is kopf-free so it can be tested against a fake API; `main.py` maps the errors to
kopf's (InvalidSpecError -> PermanentError, transient KubeError -> TemporaryError).
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvfleet.operator.build_engine import (
    build_engine_deployment,
    build_engine_pdb,
    build_engine_service,
)
from kvfleet.operator.build_gateway import (
    build_gateway_configmap,
    build_gateway_deployment,
    build_gateway_role,
    build_gateway_role_binding,
    build_gateway_service,
    build_gateway_service_account,
)
from kvfleet.operator.build_monitoring import (
    MONITORING_CRDS,
    build_engine_pod_monitor,
    build_gateway_service_monitor,
    build_prometheus_rule,
)
from kvfleet.operator.common import ENGINE, GATEWAY, OperatorConfig, Owner
from kvfleet.operator.conditions import ConditionType
from kvfleet.operator.events import EventRecorder, EventType
from kvfleet.operator.kube import KubeApi, KubeError
from kvfleet.operator.spec import InvalidSpecError, parse_spec
from kvfleet.operator.spec_base import KIND
from kvfleet.operator.status import build_status, invalid_spec_status

logger = logging.getLogger(__name__)


def utc_now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def owner_of(body: Mapping[str, Any]) -> Owner:
    """The parsed object; InvalidSpecError names each bad field."""
    meta = body["metadata"]
    return Owner(
        name=meta["name"],
        namespace=meta["namespace"],
        uid=meta["uid"],
        spec=parse_spec(body.get("spec")),
        generation=int(meta.get("generation", 1)),
    )


def desired_children(
    owner: Owner, config: OperatorConfig, monitoring_kinds: frozenset[str]
) -> list[dict[str, Any]]:
    """Every object the LLMDeployment should own, in apply order (RBAC before the pods using
    it, config before its readers). `monitoring_kinds`: Prometheus operator kinds the cluster has.
    """
    children = [
        build_gateway_service_account(owner),
        build_gateway_role(owner),
        build_gateway_role_binding(owner),
        build_gateway_configmap(owner),
        build_engine_service(owner),
        build_engine_deployment(owner, config),
        build_engine_pdb(owner),
        build_gateway_deployment(owner, config),
        build_gateway_service(owner),
    ]
    if owner.spec.monitoring.enabled:
        children += [m for m in monitoring_children(owner) if m["kind"] in monitoring_kinds]
    return children


def monitoring_children(owner: Owner) -> list[dict[str, Any]]:
    return [
        build_engine_pod_monitor(owner),
        build_gateway_service_monitor(owner),
        build_prometheus_rule(owner),
    ]


class ChildRejectedError(ValueError):
    """The API server refused a child built from the spec (not a transient failure)."""


# Children whose content comes from the user's spec (quantities, labels, images, arguments):
# dry-run on every spec change before anything is written. The RBAC objects have fixed shapes,
# and a RoleBinding's dry run would fail before its Role exists.
VERIFIED_KINDS = frozenset({"ConfigMap", "Service", "Deployment", "PodDisruptionBudget"})
# Condition transitions worth an Event: (type, status, reason or None for any) -> event type
NOTABLE = {
    (ConditionType.READY, "True", None): EventType.NORMAL,
    (ConditionType.PROGRESSING, "False", "ProgressDeadlineExceeded"): EventType.WARNING,
    (ConditionType.SCALING_LIMITED, "True", None): EventType.WARNING,
}


@dataclass
class Reconciler:
    """One per operator process: the API, the images, and a clock (tests pass a fixed one)."""

    api: KubeApi
    config: OperatorConfig
    clock: Callable[[], str] = utc_now
    events: EventRecorder | None = None
    # (kind, namespace, name) -> the manifest this process last applied
    _applied: dict[tuple[str, str, str], dict[str, Any]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.events is None:
            self.events = EventRecorder(self.api, self.clock)

    def monitoring_kinds(self) -> frozenset[str]:
        """Prometheus operator kinds whose CRDs exist, looked up at every reconcile: the
        Prometheus operator may be installed after the kvfleet operator started."""
        return frozenset(k for k, crd in MONITORING_CRDS.items() if self.api.has_crd(crd))

    def reconcile(self, body: Mapping[str, Any], verify: bool = False) -> dict[str, Any]:
        """Apply every child, remove monitoring objects no longer wanted, write the status.

        `verify` (on spec changes): the API server dry-runs the children built from the spec
        first, so a refused spec changes nothing. Raises InvalidSpecError or ChildRejectedError
        after writing a Failed status and posting a Warning Event.
        """
        try:
            owner = owner_of(body)
        except ValueError as exc:
            self.reject(body, str(exc), "InvalidSpec")
            raise
        monitoring = self.monitoring_kinds()
        children = desired_children(owner, self.config, monitoring)
        if verify:
            for child in children:
                if child["kind"] in VERIFIED_KINDS:
                    self._apply(body, child, dry_run=True)
        applied = {}
        for child in children:
            applied[(child["kind"], child["metadata"]["name"])] = self._apply(body, child)
        wanted = {(c["kind"], c["metadata"]["name"]) for c in children}
        for unwanted in monitoring_children(owner):
            kind, name = unwanted["kind"], unwanted["metadata"]["name"]
            stale = kind in monitoring and (kind, name) not in wanted
            if stale and self._owned(kind, owner, name):
                logger.info("deleting %s %s/%s: monitoring is off", kind, owner.namespace, name)
                self.api.delete(kind, owner.namespace, name)
                self._record(body, EventType.NORMAL, "Deleted", f"Deleted {kind} {name}")
        engine = applied[("Deployment", owner.names(ENGINE))]
        gateway = applied[("Deployment", owner.names(GATEWAY))]
        return self._write_status(body, owner, engine, gateway)

    def refresh_status(self, body: Mapping[str, Any]) -> dict[str, Any] | None:
        """Status from the children as they are now; None for an object with a bad spec."""
        try:
            owner = owner_of(body)
        except ValueError:
            return None
        engine = self.api.get("Deployment", owner.namespace, owner.names(ENGINE))
        gateway = self.api.get("Deployment", owner.namespace, owner.names(GATEWAY))
        return self._write_status(body, owner, engine, gateway)

    def reject(self, body: Mapping[str, Any], message: str, reason: str) -> None:
        """Failed, with the reason in SpecValid and Ready and a Warning Event."""
        meta = body["metadata"]
        previous = (body.get("status") or {}).get("conditions") or []
        generation = int(meta.get("generation", 1))
        status = invalid_spec_status(message, generation, previous, self.clock(), reason)
        if _differs(body.get("status") or {}, status):
            self.api.patch_status(meta["namespace"], meta["name"], status)
        self._record(body, EventType.WARNING, reason, message)

    def _apply(
        self, body: Mapping[str, Any], child: dict[str, Any], dry_run: bool = False
    ) -> dict[str, Any]:
        """One child through server-side apply, with an Event when it was created or changed.
        A refusal that retrying cannot cure fails the LLMDeployment (ChildRejectedError)."""
        kind, meta = child["kind"], child["metadata"]
        try:
            result = self.api.apply(child, dry_run=dry_run)
        except KubeError as exc:
            if exc.transient:
                self._record(
                    body, EventType.WARNING, "ApplyFailed", f"{kind} {meta['name']}: {exc}"
                )
                raise
            message = f"the API server refused {kind} {meta['name']}: {exc.message}"
            self.reject(body, message, "ChildRejected")
            raise ChildRejectedError(message) from exc
        if dry_run:
            return result.object
        key = (kind, meta["namespace"], meta["name"])
        before = self._applied.get(key)
        self._applied[key] = child
        if result.created:
            self._record(body, EventType.NORMAL, "Created", f"Created {kind} {meta['name']}")
        elif before is not None and before != child:
            self._record(body, EventType.NORMAL, "Updated", f"Updated {kind} {meta['name']}")
        if kind == "Deployment" and meta["name"].endswith(f"-{ENGINE}") and before is not None:
            was, now = before["spec"]["replicas"], child["spec"]["replicas"]
            if was != now:
                self._record(
                    body,
                    EventType.NORMAL,
                    "Scaled",
                    f"Scaled engine replicas from {was} to {now}",
                )
        return result.object

    def _write_status(
        self,
        body: Mapping[str, Any],
        owner: Owner,
        engine: Mapping[str, Any] | None,
        gateway: Mapping[str, Any] | None,
    ) -> dict[str, Any]:
        current = body.get("status") or {}
        previous = current.get("conditions") or []
        status = build_status(owner, self.config, engine, gateway, previous, self.clock())
        if _differs(current, status):
            self.api.patch_status(owner.namespace, owner.name, status)
            was = {c.get("type"): (c.get("status"), c.get("reason")) for c in previous}
            for condition in status["conditions"]:
                state = (condition["status"], condition["reason"])
                if was.get(condition["type"]) == state:
                    continue
                for (kind, wanted, reason), event_type in NOTABLE.items():
                    if (
                        condition["type"] == kind
                        and wanted == state[0]
                        and reason in (None, state[1])
                    ):
                        self._record(body, event_type, condition["reason"], condition["message"])
        return status

    def _record(self, body: Mapping[str, Any], kind: EventType, reason: str, message: str) -> None:
        assert self.events is not None  # set in __post_init__
        self.events.record(body, kind, reason, message)

    def _owned(self, kind: str, owner: Owner, name: str) -> bool:
        found = self.api.get(kind, owner.namespace, name)
        refs = (found or {}).get("metadata", {}).get("ownerReferences") or []
        return any(ref.get("uid") == owner.uid for ref in refs)


def _differs(current: Mapping[str, Any], status: Mapping[str, Any]) -> bool:
    """Whether writing `status` (a merge patch) would change `current`."""
    return any(current.get(key) != value for key, value in status.items())


def owner_reference(child: Mapping[str, Any]) -> tuple[str, str] | None:
    """(namespace, name) of the LLMDeployment controlling a child object, if any."""
    meta = child.get("metadata") or {}
    for ref in meta.get("ownerReferences") or []:
        if ref.get("kind") == "LLMDeployment" and ref.get("controller"):
            return str(meta.get("namespace")), str(ref["name"])
    return None


@dataclass
class Resyncer:
    """The periodic resync of every LLMDeployment: puts back what someone changed or deleted by
    hand and catches up on missed events.

    NOTE: not a kopf timer: kopf puts its finalizer on every object a timer or daemon serves, and
    then deleting an LLMDeployment hangs while the operator is down. Children are removed by
    owner-reference garbage collection, so nothing needs to run at deletion.
    """

    reconciler: Reconciler
    namespaces: Sequence[str] = ()  # empty: every namespace
    monotonic: Callable[[], float] = time.monotonic
    first_retry_s: float = 60.0
    max_retry_s: float = 3600.0
    # uid -> (generation, delay before the next retry, not before) of refused objects
    _backoff: dict[str, tuple[int, float, float]] = field(default_factory=dict, repr=False)

    def run_once(self) -> None:
        api = self.reconciler.api
        if self.namespaces:
            bodies = [body for ns in self.namespaces for body in api.list(KIND, ns)]
        else:
            bodies = api.list(KIND)
        for body in bodies:
            try:
                self.resync(body)
            except KubeError as exc:  # the next round tries again
                meta = body["metadata"]
                logger.warning("resync of %s/%s failed: %s", meta["namespace"], meta["name"], exc)

    def resync(self, body: Mapping[str, Any]) -> None:
        meta = body["metadata"]
        if meta.get("deletionTimestamp"):
            return
        uid, generation = str(meta["uid"]), int(meta.get("generation", 1))
        status = body.get("status") or {}
        reasons = {c.get("type"): c.get("reason") for c in status.get("conditions") or []}
        failed = status.get("phase") == "Failed" and status.get("observedGeneration") == generation
        if failed and reasons.get(ConditionType.SPEC_VALID) == "InvalidSpec":
            return  # nothing to apply until the spec changes (reported when it did)
        now = self.monotonic()
        held = self._backoff.get(uid)
        if held is not None and held[0] == generation and now < held[2]:
            return  # refused recently: retried with backoff, not every round
        try:
            self.reconciler.reconcile(body, verify=failed)
        except (InvalidSpecError, ChildRejectedError):
            delay = self.first_retry_s
            if held is not None and held[0] == generation:
                delay = min(held[1] * 2, self.max_retry_s)
            self._backoff[uid] = (generation, delay, now + delay)
            return
        self._backoff.pop(uid, None)
