"""Reconciling one LLMDeployment: desired children from its spec, applied; status from the children.

Everything here is kopf-free so it can be tested against a fake API; `main.py` maps the errors to
kopf's (InvalidSpecError -> PermanentError, transient KubeError -> TemporaryError).
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Callable, Mapping
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
from kvfleet.operator.kube import KubeApi
from kvfleet.operator.spec import parse_spec
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


@dataclass
class Reconciler:
    """One per operator process: the API, the images, and a clock (tests pass a fixed one)."""

    api: KubeApi
    config: OperatorConfig
    clock: Callable[[], str] = utc_now
    _monitoring: frozenset[str] | None = field(default=None, repr=False)

    def monitoring_kinds(self) -> frozenset[str]:
        """Prometheus operator kinds whose CRDs exist, looked up once per process."""
        if self._monitoring is None:
            found = {kind for kind, crd in MONITORING_CRDS.items() if self.api.has_crd(crd)}
            self._monitoring = frozenset(found)
        return self._monitoring

    def reconcile(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """Apply every child, remove monitoring objects no longer wanted, write the status.
        Raises InvalidSpecError (after writing a Failed status) for a bad spec."""
        try:
            owner = owner_of(body)
        except ValueError as exc:
            self.reject(body, str(exc))
            raise
        children = desired_children(owner, self.config, self.monitoring_kinds())
        applied: dict[tuple[str, str], dict[str, Any]] = {}
        for child in children:
            result = self.api.apply(child)
            applied[(child["kind"], child["metadata"]["name"])] = result
        wanted = {(c["kind"], c["metadata"]["name"]) for c in children}
        for unwanted in monitoring_children(owner):
            kind, name = unwanted["kind"], unwanted["metadata"]["name"]
            stale = kind in self.monitoring_kinds() and (kind, name) not in wanted
            if stale and self._owned(kind, owner, name):
                logger.info("deleting %s %s/%s: monitoring is off", kind, owner.namespace, name)
                self.api.delete(kind, owner.namespace, name)
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

    def reject(self, body: Mapping[str, Any], message: str) -> None:
        meta = body["metadata"]
        previous = (body.get("status") or {}).get("conditions") or []
        generation = int(meta.get("generation", 1))
        status = invalid_spec_status(message, generation, previous, self.clock())
        if _differs(body.get("status") or {}, status):
            self.api.patch_status(meta["namespace"], meta["name"], status)

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
        return status

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
